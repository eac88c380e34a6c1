"""Several processes per request (cosmos3_core/parallel) on the CPU with gloo, tiny checkpoint with sound and an action
head, fp32: every split's latents, sound latents and actions equal one process's (single-shot and AR windows, sound,
robot actions of each band kind, step caching, batched with other requests), the row-split VAE decode equals one
decode, and a worker killed mid-request fails the requests in flight, then the group serves again."""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import Generator
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.parallel.config import ParallelConfig
from cosmos3_core.parallel.denoise import assign, join_reused, strip_reused
from cosmos3_core.parallel.group import Group
from cosmos3_core.requests import Defaults, Limits
from cosmos3_core.rows import Branch, Row, RowOutput, denoise_step_row
from cosmos3_core.stages import DecodeStage, PrefillStage
from tests.conftest import rel_l2
from tests.test_video_input import make_clip

H, W, FPS = 64, 96, 16.0
IMAGE, CLIP = make_clip(1, 40, 56, seed=1)[0], make_clip(5, 48, 64, seed=2)
RAW = np.random.default_rng(0).standard_normal((4, 9)).astype(np.float32)
# a batch of strangers: CFG t2v, a guidance-1 request (one branch), a chained and a kv AR stream, t2v with sound,
# robot actions (policy with CFG: a noisy band; forward dynamics at guidance 1: a clean one; policy with sound: vision
# | sound | action in one segment), and step caching (SeaCache: CFG t2v, a CFG policy request, guidance 1 with
# sound — some ticks then send the group nothing); (prompt, parameters, image, clip, raw actions)
SEA = {"policy": "sea", "threshold": 1.0, "retention_steps": 2, "max_consecutive_cached": 0}
REQUESTS = [
    ("a robot stacks cubes", {"seed": 1, "steps": 3, "guidance_scale": 6.0, "num_frames": 9}, None, None, None),
    ("a cat on a sofa", {"seed": 2, "steps": 2, "guidance_scale": 1.0, "num_frames": 5}, None, None, None),
    ("a train crosses a bridge", {"seed": 3, "steps": 2, "guidance_scale": 4.0, "num_frames": 37,
                                  "window_mode": "chained", "window_frames": 17, "overlap_frames": 8}, None, None, None),
    ("waves on a beach", {"seed": 4, "steps": 2, "guidance_scale": 5.0, "num_frames": 25, "window_mode": "kv",
                          "window_frames": 9, "context_frames": 5}, None, None, None),
    ("a dog barks", {"seed": 5, "steps": 2, "guidance_scale": 5.0, "num_frames": 9, "enable_sound": True},
     None, None, None),
    ("pick up the red cube", {"seed": 6, "steps": 3, "negative_prompt": "blurry", "action": {
        "mode": "policy", "chunk_size": 8, "domain": "bridge_orig_lerobot", "resolution_tier": 256}}, IMAGE, None, None),
    ("drive forward", {"seed": 7, "steps": 2, "guidance_scale": 1.0, "action": {
        "mode": "forward_dynamics", "chunk_size": 4, "domain": "av", "resolution_tier": 256}}, None, CLIP, RAW),
    ("push the block", {"seed": 8, "steps": 2, "enable_sound": True, "action": {
        "mode": "policy", "chunk_size": 5, "domain": "pusht", "resolution_tier": 256}}, IMAGE, None, None),
    ("a lighthouse at dusk", {"seed": 9, "steps": 6, "guidance_scale": 5.0, "num_frames": 9, "cache": SEA},
     None, None, None),
    ("pick up the cup", {"seed": 10, "steps": 6, "cache": SEA, "action": {
        "mode": "policy", "chunk_size": 4, "domain": "pusht", "resolution_tier": 256}}, IMAGE, None, None),
    ("a bird sings", {"seed": 11, "steps": 6, "guidance_scale": 1.0, "num_frames": 9, "enable_sound": True,
                      "cache": SEA}, None, None, None),
]  # fmt: skip
CACHED = [i for i, r in enumerate(REQUESTS) if "cache" in r[1]]


class Collect:
    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.sound: torch.Tensor | None = None
        self.actions: torch.Tensor | None = None
        self.skipped: dict | None = None  # a cached request's `cache_skipped`
        self.errors: list[str] = []
        self.steps = 0

    def progress(self, step, steps, window, windows):
        self.steps += 1

    def chunk(self, latents, info):
        self.chunks.append(latents.clone())

    def done(self, latents, info, sound=None, actions=None):
        self.chunk(latents, info)
        self.sound, self.actions, self.skipped = sound, actions, info.get("cache_skipped")

    def error(self, message):
        self.errors.append(message)

    def cancelled(self):
        return False

    @property
    def latents(self) -> torch.Tensor:
        return torch.cat(self.chunks, dim=2)


@pytest.fixture(scope="module")
def parts(action_ckpt):
    ckpt = Checkpoint.open(action_ckpt)
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=H, width=W, fps=FPS), Limits(max_windows=8))
    prefilled = [prefill.run(prefill.validate(prompt, params, image, clip, raw), image, clip, raw)
                 for prompt, params, image, clip, raw in REQUESTS]  # fmt: skip
    return ckpt, prefilled


def deployment(ckpt: Checkpoint, **parallel) -> Deployment:
    # JSON captions are long in a byte-level tokenizer: pages for the whole batch's text at once
    return Deployment(checkpoint=str(ckpt.root), device="cpu", dtype="float32", pool_pages=512,
                      parallel=ParallelConfig(**parallel))  # fmt: skip


def run_batch(engine: DenoiseEngine, prefilled) -> list[Collect]:
    sinks = [Collect() for _ in prefilled]
    for pre, sink in zip(prefilled, sinks):
        engine.submit(pre, sink)
    engine.run_until_idle()
    assert all(not s.errors for s in sinks), [s.errors for s in sinks]
    assert engine.pool.pages_used == 0
    return sinks


@pytest.fixture(scope="module")
def single(parts):
    ckpt, prefilled = parts
    engine = DenoiseEngine.from_deployment(ckpt, deployment(ckpt))
    sinks = run_batch(engine, prefilled)
    # what the batch must exercise: sound, noisy and clean action bands, returned actions
    assert [s.sound is not None for s in sinks] == [False] * 4 + [True, False, False, True, False, False, True]
    shapes = [None if s.actions is None else tuple(s.actions.shape) for s in sinks]
    assert shapes == [None] * 5 + [(8, 10), None, (5, 2), None, (4, 2), None]
    assert all(sinks[i].skipped["cond"] for i in CACHED), [sinks[i].skipped for i in CACHED]  # each reuses steps
    assert engine.stats.max_requests_in_tick > 4
    return sinks


def check_equal(got: list[Collect], want: list[Collect]) -> None:
    for i, (s, ref) in enumerate(zip(got, want)):
        assert s.skipped == ref.skipped, (i, s.skipped, ref.skipped)  # the same steps reused
        for name in ("latents", "sound", "actions"):
            a, b = getattr(s, name), getattr(ref, name)
            if b is None:
                assert a is None, (i, name)
                continue
            assert a.shape == b.shape, (i, name)
            assert rel_l2(a, b) <= 1e-5, (i, name, rel_l2(a, b))


def test_config_errors_name_the_field(tmp_path):
    for bad, field in (({"cfg": 3}, "parallel.cfg"), ({"ulysses": 3}, "parallel.ulysses"), ({"vae": 0}, "parallel.vae"),
                       ({"tp": 2}, "parallel: keys")):  # fmt: skip
        path = tmp_path / "d.yaml"
        path.write_text(f"parallel: {bad}\n".replace("'", ""))
        with pytest.raises(ValueError, match=field):
            Deployment.load(path)
    with pytest.raises(ValueError, match="parallel.ulysses: 8 must divide"):
        ParallelConfig(ulysses=8).check_model(heads=4, kv_heads=2)
    assert Deployment.load(None, parallel={"cfg": 2, "ulysses": 2, "vae": 4}).parallel.ranks == 4


def test_kv_heads_and_assignment():
    p = ParallelConfig(ulysses=4)
    assert [p.kv_heads_of(j, 4, 2) for j in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # shared K/V heads
    assert [ParallelConfig(ulysses=2).kv_heads_of(j, 16, 8) for j in range(2)] == [(0, 4), (4, 8)]

    def row(n: int, branches: int, sound: int = 0, action: int = 0) -> SimpleNamespace:
        return SimpleNamespace(tokens=torch.zeros(n, 1), sound=torch.zeros(sound, 1), action=torch.zeros(action, 1),
                               branches=(None,) * branches)  # fmt: skip

    # two-branch rows split by branch; one-branch rows (guidance 1) go where there is least work
    assert assign([row(10, 2), row(5, 1), row(5, 1), row(20, 1)], cfg=2) == [[0, 1], [0], [1], [0]]
    assert assign([row(10, 2), row(5, 1)], cfg=1) == [[0, 0], [0]]
    # sound and action tokens are work too
    assert assign([row(4, 1, sound=3), row(6, 1), row(1, 1)], cfg=2) == [[0], [1], [1]]
    assert assign([row(4, 1, action=3), row(6, 1), row(1, 1)], cfg=2) == [[0], [1], [1]]


def test_ulysses2_equals_one_process(parts, single):
    ckpt, prefilled = parts
    group = Group(deployment(ckpt, ulysses=2).worker_spec(ckpt.root, ("denoise",)))
    try:
        engine = DenoiseEngine.from_deployment(ckpt, deployment(ckpt, ulysses=2), group=group)
        check_equal(run_batch(engine, prefilled), single)
    finally:
        group.close()


@pytest.mark.parametrize("split", [{"cfg": 2, "ulysses": 2, "vae": 4}, {"ulysses": 4}])
def test_four_processes_equal_one(parts, single, split):
    ckpt, prefilled = parts
    gen = Generator(deployment(ckpt, **split), ckpt)
    try:
        check_equal(run_batch(gen.engine, prefilled), single)
        if split.get("vae"):
            check_decode(ckpt, gen.decode)
    finally:
        gen.close()


def test_fp8_cfg2_ulysses2_equals_one_process(parts, single):
    """`precision: fp8` under `parallel`: the workers quantize at load like rank 0, each row carries its step's
    precision to them (encode/decode rows), and Ulysses' per-rank slices of a pack that mixes W8A16 and W8A8 rows
    (3-step requests at their W8A8 middle step beside others at a W8A16 step) give one process's result. The action
    bands' domain-aware linears stay in the model dtype."""
    ckpt, prefilled = parts
    policy = {"first_steps": 1, "last_steps": 1}
    fp8 = Checkpoint.open(ckpt.root, "fp8", policy)

    def fp8_deployment(**split) -> Deployment:
        return replace(deployment(ckpt, **split), precision="fp8", fp8_policy=policy)

    one = DenoiseEngine.from_deployment(fp8, fp8_deployment())
    ticks: list[list[bool]] = []
    step = one.step
    one.step = lambda rows: (ticks.append([r.a16 for r in rows]), step(rows))[1]
    want = run_batch(one, prefilled)
    assert any(len(set(t)) == 2 for t in ticks)  # some tick packs both precisions
    assert type(one.model.action_proj_in).__name__ == "DomainAwareLinear"
    gen = Generator(fp8_deployment(cfg=2, ulysses=2), fp8)
    try:
        check_equal(run_batch(gen.engine, prefilled), want)
    finally:
        gen.close()
    assert rel_l2(want[0].latents, single[0].latents) > 1e-4  # FP8 really ran


@pytest.fixture(scope="module")
def cli2(parts):
    """The offline CLI's path: one group of 2 processes for CFG-parallel denoise and the row-split decode. (A
    process drives one group at a time: the tests above close theirs, these share this one.)"""
    ckpt, _ = parts
    gen = Generator(deployment(ckpt, cfg=2, vae=2), ckpt)
    yield gen
    gen.close()


def test_cfg2_equals_one_process(parts, single, cli2):
    check_equal(run_batch(cli2.engine, parts[1]), single)


def close_enough(got, want) -> None:
    """Equal up to float rounding: each rank convolves fewer rows, so a frame value can round the other way."""
    diff = abs(got.astype(int) - want.astype(int))
    assert got.shape == want.shape and diff.max() <= 1 and (diff > 0).mean() < 1e-3, (diff.max(), (diff > 0).mean())


def check_decode(ckpt: Checkpoint, split: DecodeStage) -> None:
    """Whole videos and a stream's chunks (the causal cache per rank across chunks); uneven row splits."""
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, ckpt.config.latent_channel, 3, 6, 5, generator=g)  # 6 latent rows: 2+2+1+1 on 4
    whole = DecodeStage(ckpt, "cpu", torch.float32).run(latents)
    close_enough(split.run(latents), whole)
    pieces = [split.start_chunk("s", latents[:, :, a:b], last=b == 3)().numpy() for a, b in ((0, 1), (1, 3))]
    close_enough(torch.cat([torch.from_numpy(x) for x in pieces]).numpy(), whole)


def test_row_split_decode_equals_one_decode(parts, cli2):
    check_decode(parts[0], cli2.decode)


def test_worker_killed_mid_request_fails_it_then_serves(parts, single, cli2):
    ckpt, prefilled = parts
    engine, group = cli2.engine, cli2.group
    generation = group.generation
    sinks = [Collect(), Collect()]
    for pre, sink in zip(prefilled[:2], sinks):
        engine.submit(pre, sink)
    engine.tick()
    os.kill(group.procs[0].pid, signal.SIGKILL)
    group.procs[0].wait()
    failures = engine.stats.tick_failures
    # the engine heals the failed tick itself (engine._heal): every live request ends with the loss's cause
    assert engine.tick() == 0 and engine.stats.tick_failures == failures + 1 and engine.failed_ticks == 1
    for s in sinks:
        assert len(s.errors) == 1, s.errors
        assert re.search(r"parallel worker lost during 'step'.*rank 1 .* exited with code -9", s.errors[0]), s.errors
    assert engine.num_live == 0 and engine.pool.pages_used == 0 and not group.running
    t0 = time.monotonic()
    check_equal(run_batch(engine, prefilled), single)  # a fresh group, the same results
    check_decode(ckpt, cli2.decode)
    assert group.generation == generation + 1 and group.running and engine.failed_ticks == 0
    print(f"restart + batch + decode: {time.monotonic() - t0:.1f}s")


def test_reusing_branches_stay_on_rank_0():
    """Step caching over a group: a row's reusing branches are stripped from what is sent (no residual crosses the
    group) and joined back in branch order, a reusing branch recording no residual."""

    def row(reuse, record=True) -> Row:
        branches = tuple(Branch((), torch.zeros(4, 8), torch.zeros(4, 8)) for _ in reuse)
        latents = torch.zeros(1, 2, 1, 4, 4)
        return denoise_step_row(latents, 0.5, torch.tensor([0]), branches, 2, torch.float32, reuse=reuse, record=record)

    r = torch.ones(4, 2)
    rows = [row((None, None)), row((None, r)), row((r, r)), row((None,), record=False)]
    running, reused = strip_reused(rows)
    assert running[0] is rows[0] and running[3] is rows[3] and running[2] is None
    (cond, uncond) = rows[1].branches
    assert running[1].branches[0] is cond and running[1].reuse == (None,) and running[1].record
    assert reused[0] is None and reused[1].branches[0] is uncond and reused[1].reuse[0] is r
    assert not reused[1].record and reused[2].branches is rows[2].branches and reused[3] is None

    def out(*names) -> RowOutput:
        return RowOutput([torch.tensor(float(ord(n))) for n in names], [], residual=[torch.zeros(1) for _ in names])

    joined = join_reused(rows[1], out("c"), RowOutput([torch.tensor(float(ord("u")))], []))
    assert [v.item() for v in joined.velocity] == [ord("c"), ord("u")]
    assert joined.residual[0] is not None and joined.residual[1] is None
    all_reused = join_reused(rows[2], None, RowOutput([torch.tensor(1.0), torch.tensor(2.0)], []))
    assert [v.item() for v in all_reused.velocity] == [1.0, 2.0] and all_reused.residual == [None, None]
