"""Bucketed step layouts (`DenoiseStep(graph_buckets=...)`, graphs.py) on the CPU, through the real step.

SDPA cannot bucket a capture (its per-segment loop is host code), but eager it takes any segments: `BucketedSdpa`
says it can, so the bucket path — a layout sized by its bucket, the mix's geometry refilled as buffer content,
padding rows and unused sound / action entries — runs here, and every request's output is checked against the
exact (unbucketed) layout's. The GPU test (test_gpu.py) checks that a new mix replays a capture.
"""

from __future__ import annotations

import pytest
import torch

from cosmos3_core.attention import SdpaAttention
from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.layers import GEN
from cosmos3_core.rows import ActionBand, Branch, Segment, denoise_step_row
from cosmos3_core.step import DenoiseStep
from tests.conftest import rel_l2

TOL = 1e-6  # fp32: relative L2 of each output against the exact layout's
BUCKETS = (512, 1024)


class BucketedSdpa(SdpaAttention):
    bucketable = True  # eager only (no graphs on the CPU): the plan re-reads the segments every update

    def shape_key(self, segments: list[Segment]) -> tuple:
        return ()  # as a bucketable backend's: prefix lengths are plan data


@pytest.fixture(scope="module")
def parts(action_ckpt):
    """Nano with sound and actions, in fp32 on the CPU, and a pool."""
    ckpt = Checkpoint.open(action_ckpt)
    cfg = ckpt.config
    model = ckpt.load_transformer({GEN}, "cpu", torch.float32)
    pool = KVPool(256, 4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    return cfg, model, pool


def make_row(cfg, pool, seed: int, grid, branches=2, sound=0, action=None, record=False):
    """A random request's row: `grid` (T, h, w) patches, `sound` tokens, `action` (tokens, domain, noisy)."""
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    p = cfg.latent_patch_size
    latents = torch.randn(1, cfg.latent_channel, t, h * p, w * p, generator=g)
    n = t * h * w + sound + (action[0] if action else 0)
    brs = []
    for b in range(branches):
        text = 5 + 3 * b + seed
        pages = pool.alloc(text)
        shape = (cfg.num_hidden_layers, text, cfg.num_key_value_heads, cfg.head_dim)
        pool.write(pages, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        brs.append(
            Branch((pages,), torch.randn(n, cfg.head_dim, generator=g), torch.randn(n, cfg.head_dim, generator=g))
        )
    snd = torch.randn(cfg.sound_dim, sound, generator=g) if sound else None
    act = ActionBand(torch.randn(action[0], cfg.action_dim, generator=g), action[1], action[2]) if action else None
    noisy = torch.arange(1 if t > 1 else 0, t)
    return denoise_step_row(latents, 600.0 - 40 * seed, noisy, tuple(brs), p, torch.float32, sound_latents=snd,
                            action=act, record=record)  # fmt: skip


def assert_same(outs, refs):
    for o, r in zip(outs, refs):
        for name in ("velocity", "sound_velocity", "action_velocity", "residual"):
            a, b = getattr(o, name), getattr(r, name)
            assert len(a) == len(b), name
            for x, y in zip(a, b):
                assert (x.double() - y.double()).norm() <= TOL * y.double().norm(), name  # zero (clean) ones too


def mixes(cfg, pool):
    """Two size mixes of one bucket: 320 and 192 rows (→ 512), 16 and 11 sound rows (→ 16), 11 and 9 action rows
    (→ 16), a recording (cached) request in each."""
    first = [
        make_row(cfg, pool, 1, (2, 2, 3), sound=5, action=(4, 3, True), record=True),
        make_row(cfg, pool, 2, (1, 4, 2), branches=1, action=(3, 7, False)),
        make_row(cfg, pool, 3, (2, 3, 3), sound=3),
    ]
    second = [
        make_row(cfg, pool, 4, (3, 2, 2), sound=3, action=(2, 1, True), record=True),
        make_row(cfg, pool, 5, (1, 5, 5), branches=1, sound=5, action=(5, 9, True)),
    ]
    return first, second


def test_bucketed_equals_exact_and_mixes_share_a_layout(parts):
    cfg, model, pool = parts
    first, second = mixes(cfg, pool)
    exact = DenoiseStep(model, pool)
    bucketed = DenoiseStep(model, pool, attention=BucketedSdpa(pool), graph_buckets=BUCKETS)
    for rows in (first, second, first):  # back to the first mix: its geometry is written again
        assert_same(bucketed(rows), exact(rows))
    assert len(exact.layouts) == 2
    (key, layout), = bucketed.layouts.items()  # fmt: skip
    # (rows, sound capacity, action capacity, W8A16 rows: all of them), the backend, no shape key, a residual, no LoRA
    assert key == (("bucket", 512, 16, 16, 512), "sdpa", (), True, 0, False)
    assert layout.packed.tokens.shape[0] == 512 and layout.packed.segment_timesteps.shape[0] == 64
    # the first mix's 16 sound rows fill their capacity; its 11 action rows leave 5 entries, on the last row
    assert layout.packed.sound_rows[-1].item() < 320 and layout.packed.action_rows[-5:].tolist() == [511] * 5
    alone = [bucketed([r]) for r in second]  # one request per step: smaller buckets, the same results
    for a, r in zip(alone, second):
        assert_same(a, exact([r]))


def test_exact_layouts_where_buckets_do_not_apply(parts):
    cfg, model, pool = parts
    step = DenoiseStep(model, pool, attention=BucketedSdpa(pool), graph_buckets=(128,))
    small, large = make_row(cfg, pool, 6, (1, 2, 2)), make_row(cfg, pool, 7, (2, 4, 4))  # 2 and 4 segments of 64
    step([small])
    assert next(reversed(step.layouts))[0] == ("bucket", 128, 0, 0, 128)
    step([small, large])  # 256 rows: beyond the largest bucket
    assert next(reversed(step.layouts))[0][0] != "bucket"
    p = cfg.latent_patch_size
    branch = Branch(small.branches[0].prefix, small.branches[0].cos[:1], small.branches[0].sin[:1])  # 1 token
    commit = denoise_step_row(torch.zeros(1, cfg.latent_channel, 1, p, p), 0.0, torch.zeros(0, dtype=torch.long),
                              (branch,), p, torch.float32, commit=True)  # fmt: skip
    step([commit])  # an AR commit pass (K/V out): exact
    assert next(reversed(step.layouts))[0][0] != "bucket"
    # SDPA itself never buckets: its layouts are exact
    plain = DenoiseStep(model, pool, graph_buckets=(128,))
    plain([small])
    assert next(iter(plain.layouts))[0][0] != "bucket"


def test_the_warmup_packs_fill_the_buckets_served_mixes_use(parts, monkeypatch):
    """`capture_buckets` runs each bucket's layout on a pack of short rows (CAPTURE_SEGMENT tokens: attention's
    cost is quadratic in a segment's length) that fills the bucket; served mixes of other sizes then run in those
    layouts (on the GPU: replay their captures). Here eager: the step is told it captures, the layouts cannot."""
    import cosmos3_core.step as step_module

    cfg, model, pool = parts
    monkeypatch.setattr(step_module, "CAPTURE_SEGMENT", 192)  # 512 rows: 192 + 192 + 128
    step = DenoiseStep(model, pool, attention=BucketedSdpa(pool), graph_buckets=BUCKETS)
    step.cuda_graphs = True
    packs, layout = [], step.layout
    monkeypatch.setattr(step, "layout", lambda rows: packs.append([r.tokens.shape[0] for r in rows]) or layout(rows))
    step.capture_buckets()
    assert packs == [[192, 192, 128]] * 2 + [[192] * 5 + [64]] * 2  # eager, then the capture
    keys = list(step.layouts)
    assert keys == [(("bucket", n, 0, 0, n), "sdpa", (), False, 0, False) for n in BUCKETS]
    step([make_row(cfg, pool, 30, (1, 2, 2))])  # 2 segments of 64: the 512 bucket
    assert list(step.layouts) == keys[::-1]
    step([make_row(cfg, pool, 31, (2, 8, 8)), make_row(cfg, pool, 32, (4, 8, 8))])  # 768 rows: the 1024 bucket
    assert list(step.layouts) == keys  # no layout of their own


def test_layout_cache_keeps_the_most_recent_layouts(parts):
    cfg, model, pool = parts
    step = DenoiseStep(model, pool)
    step.MAX_LAYOUTS, step.max_captures = 2, 1
    rows = [make_row(cfg, pool, 10 + i, (1, 1, 1 + i), branches=1) for i in range(3)]
    for r in rows + rows[1:2]:
        step([r])
    assert [k[0][0][0] for k in step.layouts] == [3, 2] and step.captures == 0  # the least recently used went
    assert step.capture_buckets() == 0  # no graphs on the CPU: nothing to capture


def test_engine_mixes_within_a_bucket_use_one_layout(nano_ckpt):
    """Requests of different sizes that join and leave: the bucketed engine runs every tick in one layout, where
    exact layouts take one per mix, and each request's latents are the exact run's."""
    d = Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", graph_buckets=[2048], max_captures=3)
    gen = Generator(d)
    assert gen.engine.step.buckets == (2048,) and gen.engine.step.max_captures == 3  # the deployment's
    requests = [
        ("a red fox", {"num_frames": 9, "height": 64, "width": 96, "steps": 4, "seed": 1}),
        ("a blue boat", {"num_frames": 5, "height": 96, "width": 64, "steps": 2, "seed": 2, "guidance_scale": 1.0}),
        ("a green hill", {"num_frames": 1, "height": 64, "width": 64, "steps": 3, "seed": 3}),
    ]

    def run() -> list[torch.Tensor]:
        prefilled = [gen.prefill.run(gen.prefill.validate(prompt, params, None), None) for prompt, params in requests]
        return [r.latents for r in gen.run_together(prefilled)]

    exact = run()  # SDPA: exact layouts, buckets or not
    exact_layouts = len(gen.engine.step.layouts)
    assert all(key[0][0] != "bucket" for key in gen.engine.step.layouts)
    eng = gen.engine
    eng.step = DenoiseStep(eng.model, eng.pool, attention=BucketedSdpa(eng.pool), graph_buckets=(2048,))
    for a, b in zip(run(), exact):
        assert rel_l2(a, b) <= TOL
    assert exact_layouts >= 3 and len(eng.step.layouts) == 1


@pytest.mark.parametrize("buckets", [[100], [128, 64], [0], [64, 64]])
def test_graph_buckets_are_validated(buckets):
    with pytest.raises(ValueError, match="graph_buckets"):
        Deployment.load(None, graph_buckets=buckets)
    with pytest.raises(ValueError, match="max_captures"):
        Deployment.load(None, max_captures=-1)
