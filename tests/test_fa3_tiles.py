"""The served FlashInfer path on the CPU, with FA3's failure mode: any non-finite K/V within a request's last tile
spreads to it. The real `FlashInferPlan` (gather, padding requests, fixed batch, the re-plan skip) runs over a
stand-in `flashinfer` whose ragged kernel reads K/V by whole 192-row tiles bounded by the buffer, as FA3 does
(masked rows' V times 0: NaN · 0 = NaN), every buffer the GPU would leave unwritten (`torch.empty`) holds NaN, and
so do the pool's free pages. Served Nano once came back black after a first pack: the engine's own bookkeeping must
keep every output finite, packed equal to solo, and one non-finite request must not poison later ones."""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch

import cosmos3_core.attention as attention
from bench.served import PROMPT, variant_request
from cosmos3_core import faults
from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import _CollectSink
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.layers import GEN
from cosmos3_core.requests import warmup_inputs
from cosmos3_core.stages import PrefillStage
from cosmos3_core.step import DenoiseStep
from tests.conftest import rel_l2
from tests.test_buckets import make_row

TILE_KV = 192  # FA3's K/V tile at head_dim 128, non-causal (flashinfer's getCTATileSize)
NAN = float("nan")


class Fa3Ragged:
    """`BatchPrefillWithRaggedKVCacheWrapper` in CUDA-graph mode: a fixed batch, the first plan's rows the most."""

    def __init__(self, workspace, layout, use_cuda_graph=False, backend="fa3", qo_indptr_buf=None, kv_indptr_buf=None):
        assert use_cuda_graph and qo_indptr_buf is not None and kv_indptr_buf is not None
        self.qo, self.kv = qo_indptr_buf, kv_indptr_buf
        self.rows: int | None = None

    def plan(self, qo, kv, heads, kv_heads, head_dim, **kw) -> None:
        assert len(qo) == len(self.qo), "the batch of a captured plan is fixed"
        self.rows = int(qo[-1]) if self.rows is None else self.rows
        assert int(qo[-1]) <= self.rows
        self.qo.copy_(qo)
        self.kv.copy_(kv)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *scales, out=None) -> torch.Tensor:
        qo, kv = self.qo.tolist(), self.kv.tolist()
        assert kv[-1] <= len(k)
        o = torch.full((*q.shape[:2], v.shape[2]), NAN, dtype=q.dtype)  # rows no request covers stay NaN
        g = q.shape[1] // k.shape[1]
        for a, b, ka, kb in zip(qo, qo[1:], kv, kv[1:]):
            if a == b:
                continue
            end = min(len(k), ka + math.ceil((kb - ka) / TILE_KV) * TILE_KV)  # whole tiles, within the buffer
            keys, values = (x[ka:end].repeat_interleave(g, dim=1).float() for x in (k, v))
            s = torch.einsum("qhd,khd->hqk", q[a:b].float(), keys) / math.sqrt(q.shape[-1])
            s[:, :, kb - ka :] = -math.inf  # masked, yet their V is multiplied by 0
            o[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), values).to(q.dtype)
        return o


class NoEvent:
    def record(self, *a) -> None: ...
    def synchronize(self) -> None: ...


def gather_kv_empty(own, pages, own_dst, prefix_src, prefix_dst) -> torch.Tensor:
    """`attention.gather_kv` with its `torch.empty` buffer full of NaN: a row it does not write shows."""
    buf = torch.full((len(own_dst) + len(prefix_dst), *own.shape[1:]), NAN, dtype=own.dtype)
    buf.index_copy_(0, own_dst, own)
    return buf.index_copy_(0, prefix_dst, pages.flatten(0, 1).index_select(0, prefix_src))


class Fa3Attention(attention.FlashInferAttention):
    def __init__(self, pool: KVPool, heads: int, kv_heads: int, head_dim: int):  # no GPU, no flashinfer
        self.pool, self.heads, self.kv_heads, self.head_dim = pool, heads, kv_heads, head_dim
        self.aot, self.backend, self.fp8 = None, "fa3", False
        self.workspace = torch.empty(0)


@pytest.fixture
def fa3(monkeypatch):
    """→ a factory of FA3-like backends over a pool (whose free pages it fills with NaN)."""
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithRaggedKVCacheWrapper = Fa3Ragged  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "Event", NoEvent)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self.clone())
    monkeypatch.setattr(attention, "gather_kv", gather_kv_empty)

    def make(pool: KVPool, cfg) -> Fa3Attention:
        pool.k_pages.fill_(NAN)
        pool.v_pages.fill_(NAN)
        return Fa3Attention(pool, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)

    return make


def finite(outputs) -> list[bool]:
    return [all(bool(v.isfinite().all()) for v in o.velocity + o.sound_velocity) for o in outputs]


def test_a_stale_non_finite_sound_entry_does_not_poison_later_packs(action_ckpt, fa3):
    """A bucket's sound capacity entries that a later mix leaves unused are embedded into its last row: one that
    still held an earlier request's NaN sound latents blackened every later pack of that layout."""
    ckpt = Checkpoint.open(action_ckpt)
    cfg = ckpt.config
    model = ckpt.load_transformer({GEN}, "cpu", torch.float32)
    pool = KVPool(256, 4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    step = DenoiseStep(model, pool, attention=fa3(pool, cfg), cuda_graphs=False, graph_buckets=(512,))
    bad = make_row(cfg, pool, 3, (2, 3, 3), sound=3)
    with torch.inference_mode():
        bad.sound[-1] = NAN  # its last sound token: the bucket's last capacity entry
    first = [make_row(cfg, pool, 1, (2, 2, 3), sound=13), bad]  # 32 sound rows: the capacity
    assert finite(step(first)) == [False, False]  # FA3: a NaN in one request reaches its pack mates
    second = [make_row(cfg, pool, 4, (3, 2, 2), sound=9), make_row(cfg, pool, 5, (2, 2, 2))]  # 18 of 32 entries
    assert finite(step(second)) == [True, True]
    assert len(step.layouts) == 1  # both mixes in one bucket layout


STEPS, SEA_STEPS, FRAMES = 2, 4, 9
SEA = {"cache": {"policy": "sea", "threshold": 1e9, "retention_steps": 1, "cache_end_steps": 1}}
AR = {"num_frames": 25, "window_frames": 17}
ROWS = {  # bench.matrix's rows at the tiny checkpoint's sizes
    "t2v/i2v": ("t2v", {}),
    "AR kv": ("t2v", {**AR, "window_mode": "kv", "context_frames": 17}),
    "sound": ("t2v+sound", {}),
    "action": ("policy", {}),
}
ACTION = {"chunk_size": 16, "domain": "droid_lerobot", "resolution_tier": 256}
WARMUP = [  # every Nano config's kinds: exact layouts, then derived buckets the served packs run in
    {"num_frames": 17, "steps": 2},
    {"num_frames": 25, "window_mode": "chained", "window_frames": 17, "overlap_frames": 8, "steps": 2},
    {"num_frames": 17, "enable_sound": True, "steps": 2},
    {"action": {**ACTION, "mode": "policy"}, "steps": 2},
    {"action": {**ACTION, "mode": "forward_dynamics"}, "steps": 2},
]


def test_the_matrix_sequence_stays_finite_and_packed_equals_solo(action_ckpt, fa3, monkeypatch, capsys):
    """bench.matrix's cells in one engine on the FA3 stand-in (buckets derived from every kind's warmup, layouts
    evicted): each request alone, then packed as a server packs them (each admitted a tick after the last), each
    uncached and with SeaCache. Then a pack whose second request's text V holds a NaN (a bad transfer): the pack
    goes black (`check_finite=1` names the tick and its layout), and the next request alone must not."""
    d = Deployment.load("configs/tiny.yaml", checkpoint=str(action_ckpt))
    d = dataclasses.replace(d, warmup_requests=WARMUP)
    ckpt = d.open_checkpoint()
    prefill = PrefillStage.from_deployment(ckpt, d, "cpu")
    engine = DenoiseEngine.from_deployment(ckpt, d)
    engine.step = DenoiseStep(engine.model, engine.pool, attention=fa3(engine.pool, engine.cfg), cuda_graphs=False)
    step = engine.step
    step.MAX_LAYOUTS = step.max_captures = 4  # evictions, as Nano's served layouts go past max_captures
    engine.derive_buckets = True
    engine.warmup([prefill.validate("warmup", r, *warmup_inputs(r, d.defaults)) for r in WARMUP])
    assert step.buckets
    keys: list[tuple] = []  # every layout a tick ran in
    layout = step.layout

    def logged(rows):
        result = layout(rows)
        keys.append(next(reversed(step.layouts)))
        return result

    step.layout = logged  # type: ignore[method-assign]
    size = (d.defaults.height, d.defaults.width)

    def run(requests: list[tuple], poison: int = -1) -> list[_CollectSink]:
        sinks = []
        for i, (params, image, clip, raw, seed) in enumerate(requests):
            p = prefill.validate(PROMPT, {**params, "seed": seed}, image, clip, raw)
            pre = prefill.run(p, image, clip, raw)
            if i == poison:
                with torch.inference_mode():
                    pre.text_v[0][0, 0, 0, 0] = NAN
            sinks.append(_CollectSink(p.steps, False))
            engine.submit(pre, sinks[-1])
            if i < len(requests) - 1:
                engine.tick()  # the next one joins a tick later
        engine.run_until_idle()
        assert not [s.failure for s in sinks if s.failure]
        return sinks

    for row, (kind, extra) in ROWS.items():
        for cached in (False, True):
            steps = {"steps": SEA_STEPS if cached else STEPS, **(SEA if cached else {}), "num_frames": FRAMES}
            main = variant_request(kind, {**steps, **extra}, *size, ACTION)
            requests = [
                (*main, 1),
                (*variant_request("i2v", steps, *size), 2),
                (*variant_request("t2v", steps, *size), 3),
            ]
            solo = [run([r])[0] for r in requests]
            for s, packed in zip(solo, run(requests)):
                assert bool(s.latents.isfinite().all()), (row, cached)
                assert rel_l2(packed.latents, s.latents) <= 1e-6, (row, cached)
            if cached:
                assert any(any(w.values()) for w in (lambda x: x if isinstance(x, list) else [x])(
                    solo[0].info["cache_skipped"])), (row, "SeaCache reused no step")  # fmt: skip
    t2v = variant_request("t2v", {"steps": STEPS, "num_frames": FRAMES}, *size)
    requests = [(*t2v, 1), (*variant_request("i2v", {"steps": STEPS, "num_frames": FRAMES}, *size), 2), (*t2v, 3)]
    buckets = {k for k in keys if k[0][0] == "bucket"}
    assert buckets and len(set(keys) - buckets) > 2 * len(step.layouts)  # both kinds ran; layouts were evicted
    monkeypatch.setattr(faults, "CHECK_FINITE", True)
    monkeypatch.setattr(faults, "_said", {})  # each site's line budget, fresh (earlier tests may have spent it)
    capsys.readouterr()
    assert not bool(run(requests, poison=1)[0].latents.isfinite().all())  # the stand-in shows FA3's spread
    err = capsys.readouterr().err
    assert "cosmos3: check_finite: admission seed 2: text_v 1 of" in err and "check_finite: tick " in err
    assert "text K/V pages for seeds [2]; 0 non-finite GEN weights" in err  # the first bad tick's inputs
    assert bool(run(requests[:1])[0].latents.isfinite().all())  # nothing of it is left in the engine
