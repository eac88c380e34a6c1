"""Cache-once (prefill K/V + GEN-only steps, packed) against the fused reference forward."""

from __future__ import annotations

import pytest
import torch

from cosmos3_core.kv_pool import KVPool
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.layers import GEN, UND
from cosmos3_core.model.rotary import rotary_tables, text_position_ids, vision_position_ids
from cosmos3_core.model.towers import fused_reference, prefill_text_kv
from cosmos3_core.rows import Branch, denoise_step_row
from cosmos3_core.step import DenoiseStep


def make_request(ckpt: Checkpoint, model, pool, text_len: int, grid: tuple[int, int, int], first_noisy: int, seed: int):
    """Random text + latents for one request; returns (row, per-branch reference inputs)."""
    cfg = ckpt.config
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    p = cfg.latent_patch_size
    latents = torch.randn(1, cfg.latent_channel, t, h * p, w * p, generator=g)
    branches, refs = [], []
    for b in range(2):
        ids = torch.randint(0, cfg.vocab_size, (text_len + 3 * b,), generator=g)
        text_rot = rotary_tables(cfg, text_position_ids(len(ids)), torch.float32, "cpu")
        k, v = prefill_text_kv(model, ids, *text_rot)
        pages = pool.alloc(len(ids))
        pool.write(pages, k, v)
        gen_rot = rotary_tables(cfg, vision_position_ids(cfg, grid, len(ids), 16.0), torch.float32, "cpu")
        branches.append(Branch((pages,), *gen_rot))
        refs.append((ids, text_rot, gen_rot))
    noisy = torch.arange(first_noisy, t)
    row = denoise_step_row(latents, 700.0 - 50 * seed, noisy, tuple(branches), p, torch.float32)
    return row, refs


@pytest.mark.parametrize("variant", ["nano", "edge"])
def test_cache_once_equals_fused(tiny_ckpts, variant):
    ckpt = Checkpoint.open(tiny_ckpts[variant])
    model = ckpt.load_transformer({UND, GEN}, "cpu", torch.float32)
    cfg = ckpt.config
    pool = KVPool(64, 4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    # three requests of different sizes, text lengths and conditioning, packed into one step
    specs = [(11, (3, 2, 3), 0, 1), (5, (1, 4, 2), 0, 2), (17, (2, 2, 2), 1, 3)]
    reqs = [make_request(ckpt, model, pool, *s) for s in specs]
    rows = [r for r, _ in reqs]
    packed = DenoiseStep(model, pool)(rows)
    solo = [DenoiseStep(model, pool)([r])[0] for r in rows]
    packed, solo = [o.velocity for o in packed], [o.velocity for o in solo]
    p = cfg.latent_patch_size
    for (_, _, first_noisy, _), (row, refs), v_packed, v_solo in zip(specs, reqs, packed, solo):
        for (ids, text_rot, gen_rot), vp, vs in zip(refs, v_packed, v_solo):
            ref_tokens = fused_reference(model, ids, text_rot, row.tokens, row.timestep, row.noisy_mask, gen_rot)
            from cosmos3_core.rows import unpatchify

            ref = unpatchify(ref_tokens, row.token_shape, p, row.latent_hw)
            keep = torch.zeros(row.token_shape[0])
            keep[first_noisy:] = 1
            ref = ref * keep.view(1, 1, -1, 1, 1)
            assert (vp - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())
            assert torch.allclose(vp, vs, atol=1e-6, rtol=0)
            if first_noisy > 0:
                assert vp[:, :, :first_noisy].abs().max() == 0  # clean frames get no velocity


def test_pool_accounting(nano_ckpt):
    cfg = Checkpoint.open(nano_ckpt).config
    pool = KVPool(10, 4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    a = pool.alloc(9)  # 3 pages
    b = pool.alloc(4)  # 1 page
    assert pool.pages_used == 4 and len(a.pages) == 3 and len(b.pages) == 1
    k = torch.randn(cfg.num_hidden_layers, 9, cfg.num_key_value_heads, cfg.head_dim)
    pool.write(a, k, -k)
    gk, gv = pool.gather(1, a)
    assert torch.equal(gk, k[1]) and torch.equal(gv, -k[1])
    pool.free(a)
    pool.free(b)
    assert pool.pages_used == 0
    with pytest.raises(RuntimeError):
        pool.alloc(41)


def test_a_reused_layout_follows_each_requests_pages_and_inputs(nano_ckpt):
    """One DenoiseStep serves two requests of the same layout (same sizes, same text length, different text K/V,
    latents and timestep) one after the other: the layout's buffers and page-index buffers are refilled, not
    re-made, and the second result equals that request on a fresh step. The plan is updated only when the pages
    change: a request's next step re-plans nothing."""
    ckpt = Checkpoint.open(nano_ckpt)
    model = ckpt.load_transformer({UND, GEN}, "cpu", torch.float32)
    cfg = ckpt.config
    pool = KVPool(64, 4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    first, _ = make_request(ckpt, model, pool, 9, (2, 2, 3), 0, seed=1)
    second, _ = make_request(ckpt, model, pool, 9, (2, 2, 3), 0, seed=2)
    step = DenoiseStep(model, pool)
    step([first])
    (layout,) = step.layouts.values()
    buffers = layout.packed.tokens.data_ptr()
    updates = []
    plan_update = layout.plan.update
    layout.plan.update = lambda segments: (updates.append(1), plan_update(segments))
    reused = step([second])[0].velocity
    assert len(step.layouts) == 1 and layout.packed.tokens.data_ptr() == buffers
    assert len(updates) == 1
    torch.testing.assert_close(step([second])[0].velocity, reused, rtol=0, atol=0)
    assert len(updates) == 1  # same pages as the step before: no re-plan
    fresh = DenoiseStep(model, pool)([second])[0].velocity
    for a, b in zip(reused, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_request_on_a_finished_requests_pages_is_served_right(nano_ckpt):
    """The next request reuses the freed pages (same ids, same text length, same layout) — no re-plan is needed,
    and the plan must not hold on to the finished request's (emptied) page lists."""
    ckpt = Checkpoint.open(nano_ckpt)
    model = ckpt.load_transformer({UND, GEN}, "cpu", torch.float32)
    cfg = ckpt.config
    pool = KVPool(64, 4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    step = DenoiseStep(model, pool)
    first, _ = make_request(ckpt, model, pool, 9, (2, 2, 3), 0, seed=1)
    step([first])
    first_pages = [br.prefix[0].pages.copy() for br in first.branches]
    for br in reversed(first.branches):  # so the pool hands the same ids back in the same order
        pool.free(br.prefix[0])
    second, _ = make_request(ckpt, model, pool, 9, (2, 2, 3), 0, seed=2)
    assert [br.prefix[0].pages for br in second.branches] == first_pages
    reused = step([second])[0].velocity
    fresh = DenoiseStep(model, pool)([second])[0].velocity
    for a, b in zip(reused, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
