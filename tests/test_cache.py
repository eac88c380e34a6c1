"""Step caching (SeaCache, cosmos3_core/cache.py) against diffusers' own: `Cosmos3OmniPipeline` with
`pipe.transformer.enable_cache(SeaCacheConfig(...))` on the same tiny checkpoint, seed and request (fp32, CPU).

Our latents equal the pipeline's (rel-L2 <= 1e-4) and each CFG branch skips the same steps — a diffusers call
skipped when its transformer's block stack did not run (`bench.inprocess.StackCalls`: a forward hook on its first
layer, what the benchmark counts too) — for t2v and i2v, guidance 1 and > 1, the default config and non-default
ones (order-1 extrapolation, order 0, no run limit); every case skips steps, and skipping moves the pipeline's
latents past three times the tolerance. A cached request packed with
uncached and differently cached ones equals each alone, and a reusing request runs no forward. Sound and robot
action requests (policy, forward and inverse dynamics) equal the pipeline with its SeaCache too. Bad `cache` fields
are refused naming the field (request, deployment config, CLI); served equals offline (one served test). Step
caching over a parallel group: tests/test_parallel.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import yaml

from bench.inprocess import StackCalls, sea_cache_config
from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import Generator, main
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.requests import Defaults, Limits, RequestError, SeaCacheParams, validate
from cosmos3_core.stages import PrefillStage
from tests.conftest import reference_pipeline, rel_l2, run_reference

PROMPT = "a red cube slides across a wooden table"
TASKS = {
    "t2v": (dict(num_frames=9, height=32, width=64, steps=10, guidance_scale=6.0, shift=10.0, seed=3, fps=16.0), False),
    "t2v_guidance1": (dict(num_frames=9, height=32, width=64, steps=10, guidance_scale=1.0, shift=10.0, seed=3), False),
    "i2v": (dict(num_frames=9, height=32, width=64, steps=10, guidance_scale=5.0, shift=8.0, seed=2), True),
    "i2v_guidance1": (dict(num_frames=5, height=32, width=32, steps=8, guidance_scale=1.0, shift=5.0, seed=5), True),
}  # fmt: skip
CONFIGS = {
    "default": {},  # reuses at steps 1 and 2 from one residual, then the run limit forces step 3
    "extrapolate": {"threshold": 1.0, "retention_steps": 2, "max_consecutive_cached": 0},  # order 1 from 2 residuals
    "order0": {"threshold": 0.6, "residual_order": 0, "cache_end_steps": 2},
}


def reference(pipe, params: dict, config: dict, image) -> tuple[torch.Tensor, dict[str, list[int]]]:
    """The pipeline's latents with SeaCache on, and the steps each branch skipped."""
    pipe.transformer.enable_cache(sea_cache_config({"cache": {"policy": "sea", **config}}))
    calls = StackCalls(pipe.transformer)
    try:
        latents = run_reference(pipe, PROMPT, params, image)
    finally:
        calls.remove()
        pipe.transformer.disable_cache()
    return latents, calls.skipped(1 if params["guidance_scale"] == 1.0 else 2)


@pytest.fixture(scope="module")
def stacks(tiny_ckpts):
    """Per variant: (the reference pipeline, our offline Generator) on the same checkpoint, fp32 CPU."""
    made: dict = {}

    def get(variant: str):
        if variant not in made:
            d = Deployment.load(None, checkpoint=str(tiny_ckpts[variant]), device="cpu", dtype="float32")
            made[variant] = (reference_pipeline(tiny_ckpts[variant]), Generator(d))
        return made[variant]

    return get


def ours(gen: Generator, params: dict, config: dict, image) -> tuple[torch.Tensor, dict[str, list[int]]]:
    p = gen.prefill.validate(PROMPT, {**params, "cache": {"policy": "sea", **config}}, image)
    out = gen.run(gen.prefill.run(p, image))
    return out.latents, out.info["cache_skipped"]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("variant", ["nano", "edge"])
def test_cached_latents_and_skips_equal_pipeline(stacks, variant, task, config, test_image):
    pipe, gen = stacks(variant)
    params, with_image = TASKS[task]
    image = test_image if with_image else None
    theirs, their_skips = reference(pipe, params, CONFIGS[config], image)
    mine, my_skips = ours(gen, params, CONFIGS[config], image)
    assert their_skips["cond"], "the case must skip steps, else it checks nothing"
    assert my_skips == their_skips
    assert mine.shape == theirs.shape
    assert rel_l2(mine, theirs) <= 1e-4


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_skipped_steps_move_latents_past_the_tolerance(stacks, task, test_image):
    """The equality above could not hold by accident: with and without SeaCache the pipeline's latents differ by
    more than three times the tolerance (5e-4 to 7e-2 here)."""
    pipe, gen = stacks("nano")
    params, with_image = TASKS[task]
    image = test_image if with_image else None
    uncached = gen.latents(PROMPT, params, image)
    for config in CONFIGS.values():
        cached, _ = reference(pipe, params, config, image)
        assert rel_l2(cached, uncached) > 3e-4, config


@pytest.fixture(scope="module")
def engine_parts(nano_ckpt):
    ckpt = Checkpoint.open(nano_ckpt)
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=32, num_frames=5), Limits())
    return ckpt, prefill


class Done:
    def __init__(self):
        self.latents, self.info, self.errors = None, None, []

    def progress(self, step, steps, window, windows): ...
    def chunk(self, latents, info): ...

    def done(self, latents, info):
        self.latents, self.info = latents, info

    def error(self, message):
        self.errors.append(message)

    def cancelled(self):
        return False


PACKED = [  # a cached request with CFG, an uncached one, and one cached otherwise at guidance 1, other sizes
    {"seed": 1, "steps": 10, "cache": {"policy": "sea"}},
    {"seed": 2, "steps": 7, "num_frames": 9},
    {"seed": 3, "steps": 9, "height": 48, "guidance_scale": 1.0, "cache": {"policy": "sea", **CONFIGS["extrapolate"]}},
]


def run_engine(engine_parts, requests: list[dict]) -> tuple[list[Done], DenoiseEngine, list[tuple[int, int]]]:
    """→ the requests' sinks, the engine, and per tick (requests in it, rows in its packed forward)."""
    ckpt, prefill = engine_parts
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=512, page_size=16, max_queue=8)
    sinks = [Done() for _ in requests]
    for params, sink in zip(requests, sinks):
        engine.submit(prefill.run(prefill.validate("a prompt", params, None), None), sink)
    ticks = []
    while engine.has_work():
        ticks.append((engine.tick(), engine.stats.rows_last_tick))
    assert not any(s.errors for s in sinks)
    return sinks, engine, ticks


def test_packed_cached_and_uncached_requests_equal_each_alone(engine_parts):
    packed, _, ticks = run_engine(engine_parts, PACKED)
    # rows per request (tokens × branches): 2×2, 3×2 and 4×1; a tick of all three where the first reuses both
    # branches packs only the others' 10 rows (and all 14 when every branch runs)
    assert (3, 14) in ticks and (3, 10) in ticks
    for params, got in zip(PACKED, packed):
        (alone,), _, _ = run_engine(engine_parts, [params])
        assert torch.equal(got.latents, alone.latents), params
        assert got.info.get("cache_skipped") == alone.info.get("cache_skipped")
    assert packed[0].info["cache_skipped"]["cond"] and "cache_skipped" not in packed[1].info


def test_reusing_request_runs_no_forward(engine_parts):
    """A request alone whose branches both reuse at a step adds no rows: that step runs no packed forward."""
    (done,), engine, _ = run_engine(engine_parts, [PACKED[0]])
    skipped = done.info["cache_skipped"]
    assert skipped["cond"] == skipped["uncond"] and skipped["cond"]
    forwards = sum(layout.runs for layout in engine.step.layouts.values())
    assert forwards == PACKED[0]["steps"] - len(skipped["cond"])


def check(params: dict, defaults: Defaults | None = None):
    return validate("p", params, None, defaults or Defaults(), Limits(), 16, 4, 3.0)


@pytest.mark.parametrize(
    "cache, message",
    [
        ("sea", "cache: must be a JSON object"),
        ({}, "cache.policy: must be one of sea, got None"),
        ({"policy": "tea"}, "cache.policy: must be one of sea, got 'tea'"),
        ({"policy": "sea", "threshhold": 0.3}, "cache.threshhold: unknown field"),
        ({"policy": "sea", "a b": 1}, "cache: unknown field 'a b'"),
        ({"policy": "sea", "threshold": -0.1}, "cache.threshold: must be a finite number >= 0"),
        ({"policy": "sea", "threshold": float("nan")}, "cache.threshold: must be a finite number"),
        ({"policy": "sea", "threshold": "0.3"}, "cache.threshold: must be a finite number"),
        ({"policy": "sea", "residual_order": 2}, "cache.residual_order: must be 0 or 1"),
        ({"policy": "sea", "residual_order": True}, "cache.residual_order: must be 0 or 1"),
        ({"policy": "sea", "retention_steps": -1}, "cache.retention_steps: must be in [0,"),
        ({"policy": "sea", "retention_steps": 1.5}, "cache.retention_steps: must be an integer"),
        ({"policy": "sea", "cache_end_steps": "x"}, "cache.cache_end_steps: must be an integer"),
        ({"policy": "sea", "max_consecutive_cached": True}, "cache.max_consecutive_cached: must be an integer"),
        ({"policy": "sea", "power_exp": 0}, "cache.power_exp: must be a finite number > 0"),
        ({"policy": "sea", "power_exp": 10**400}, "cache.power_exp: must be a finite number"),
    ],
)
def test_bad_cache_fields_are_named(cache, message):
    with pytest.raises(RequestError) as e:
        check({"cache": cache})
    assert message in str(e.value)


def test_cache_defaults_and_deployment_default(tmp_path):
    assert check({"cache": {"policy": "sea"}}).cache == SeaCacheParams()  # diffusers' SeaCacheConfig() defaults
    assert check({}).cache is None  # off by default
    on = Defaults(cache={"policy": "sea", "threshold": 0.5})
    assert check({}, on).cache == SeaCacheParams(threshold=0.5)
    assert check({"cache": None}, on).cache is None  # a request turns a deployment's default off
    # AR streams take the request's cache and the default too: tests/test_cache_ar.py
    p = check({"cache": {"policy": "sea", "residual_order": 0}})
    assert p.resolved()["cache"] == {**vars(SeaCacheParams(residual_order=0))}  # echoed with `done`
    assert type(p).from_json(p.to_json()) == p
    rendered = tmp_path / "rendered.yaml"  # as serve.render hands the deployment to the Triton models
    rendered.write_text(yaml.safe_dump(dataclasses.asdict(Deployment(defaults=on))))
    assert Deployment.load(rendered).defaults.cache == SeaCacheParams(threshold=0.5)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"defaults": {"cache": {"policy": "sea", "threshold": -1}}}))
    with pytest.raises(ValueError, match="cache.threshold"):
        Deployment.load(config)


def test_cli_cache_option(nano_ckpt, tmp_path, capsys):
    base = ["--checkpoint", str(nano_ckpt), "--prompt", PROMPT, "--out", str(tmp_path / "o.pt"), "--height", "32",
            "--width", "32", "--num-frames", "5", "--steps", "6", "--seed", "1"]  # fmt: skip
    for bad, message in (
        ("{not json", "cache: is not valid JSON"),
        ('{"policy": "sea", "power_exp": -1}', "cache.power_exp: must be a finite number > 0"),
    ):
        assert main([*base, "--cache", bad]) == 2
        assert message in capsys.readouterr().err
    assert main([*base, "--cache", '{"policy": "sea", "threshold": 1.0}']) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("cache_skipped "))
    skipped = json.loads(line.removeprefix("cache_skipped "))
    assert skipped["cond"] and skipped["cond"] == skipped["uncond"]


@pytest.mark.served
def test_served_cache_equals_offline_and_names_bad_fields(server, offline):
    from client.stream import ServerError, generate

    params = {"num_frames": 9, "steps": 8, "seed": 4, "cache": {"policy": "sea", "threshold": 0.6}}
    served = generate(server.url, "a lighthouse at dusk", params)
    p = offline.prefill.validate("a lighthouse at dusk", params, None)
    out = offline.run(offline.prefill.run(p, None))
    latents, info = out.latents, out.info
    assert np.array_equal(served.video, offline.decode.run(latents))
    done = next(e for e in served.events if e["type"] == "done")
    assert done["cache_skipped"] == info["cache_skipped"] and info["cache_skipped"]["cond"]
    assert done["params"]["cache"] == p.resolved()["cache"]
    with pytest.raises(ServerError, match="cache.residual_order: must be 0 or 1"):
        generate(server.url, "x", {**params, "cache": {"policy": "sea", "residual_order": 3}})


def test_scheduler_decides_each_branch_before_the_rows_and_extrapolates():
    """Without a model (hand-made outputs, residual k at step k): with a threshold nothing reaches, the decisions
    follow the forced steps alone — step 0 (retention), 3 (after 2 reuses), 5 (the end) run; the reuse at step 4
    extrapolates from steps 0 and 3 (3 + (3 - 0) · 1/3 = 4); `done` reports the skipped steps per branch."""
    from tests.test_scheduler import Recorder, output, request, scheduler

    s, sink = scheduler(), Recorder()
    s.submit(request(steps=6, cache=SeaCacheParams(threshold=1e9)), sink)
    seen = []
    for _ in range(6):
        (job,) = s.schedule()
        seen.append([None if r is None else r.unique().tolist() for r in job.reuse])
        out = output(job)
        out.residual = [torch.full((4, 8), float(job.step)) if r is None else None for r in job.reuse]
        s.update([job], [out])
    assert seen == [[None, None], [[0.0]] * 2, [[0.0]] * 2, [None, None], [[4.0]] * 2, [None, None]]
    assert sink.final["cache_skipped"] == {"cond": [1, 2, 4], "uncond": [1, 2, 4]}


def test_cached_sound_request_equals_pipeline(tmp_path_factory):
    """With sound the GEN sequence is vision then sound tokens: the residual a skip reuses covers both, and the
    vision latents and the waveform equal the pipeline's with the same SeaCache (the same steps skipped)."""
    from cosmos3_core.tools.make_tiny import make_tiny

    ckpt = make_tiny(tmp_path_factory.mktemp("snd") / "nano", variant="nano", seed=7, sound=True)
    pipe = reference_pipeline(ckpt)
    gen = Generator(Deployment.load(None, checkpoint=str(ckpt), device="cpu", dtype="float32"))
    params = dict(num_frames=9, height=32, width=48, steps=10, guidance_scale=5.0, shift=8.0, seed=2, fps=16.0)
    config = CONFIGS["extrapolate"]
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, flow_shift=params["shift"])
    pipe.transformer.enable_cache(sea_cache_config({"cache": {"policy": "sea", **config}}))
    calls = StackCalls(pipe.transformer)
    theirs = pipe(prompt=PROMPT, num_frames=9, height=32, width=48, fps=16.0, num_inference_steps=10,
                  guidance_scale=5.0, generator=torch.Generator().manual_seed(2), output_type="latent",
                  enable_sound=True, enable_safety_check=False)  # fmt: skip
    calls.remove()
    p = gen.prefill.validate(PROMPT, {**params, "enable_sound": True, "cache": {"policy": "sea", **config}}, None)
    out = gen.run(gen.prefill.run(p, None))
    latents, sound, info = out.latents, out.sound, out.info
    assert info["cache_skipped"] == calls.skipped(2) and info["cache_skipped"]["cond"]
    assert rel_l2(latents, theirs.video) <= 1e-4
    wave = torch.as_tensor(gen.decode.audio(sound))
    assert rel_l2(wave, theirs.sound.float().reshape(wave.shape)) <= 1e-4


def test_sea_filter_equals_diffusers():
    """The indicator's filter, bit for bit (a 1-frame latent, sigma at and beyond the clamps, other priors)."""
    from diffusers.hooks.sea_cache import _apply_sea_filter

    from cosmos3_core.cache import SeaGains, sea_filter

    g = torch.Generator().manual_seed(0)
    gains = SeaGains(capacity=4)  # the engine's kept gains: fewer entries than the cases below, so some are dropped
    for shape in ((3, 4, 6, 8), (1, 2, 2, 16)):
        x = torch.randn(shape, generator=g)
        for sigma in (0.0, 0.3, 0.9999999, 1.0):
            for power in (0.5, 3.0):
                theirs = _apply_sea_filter(x, sigma, power)
                assert torch.equal(sea_filter(x, sigma, power), theirs)
                for _ in range(2):  # computed into `gains`, then read from it
                    assert torch.equal(sea_filter(x, sigma, power, gains), theirs)
                assert len(gains._gains) <= 4


def test_a_kept_sea_gain_leaves_the_step_an_fft_a_product_and_an_inverse():
    """With the engine's `SeaGains`, a step whose shape and sigma were seen runs 8 ops, not 55: on a step whose
    branches all reuse, each is a kernel launch the GPU waits for (measured on the H200 with `bench.timeline`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cosmos3_core.cache import SeaGains, sea_filter

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    x, gains = torch.randn(8, 15, 26, 48).bfloat16(), SeaGains()
    sea_filter(x, 0.7, 2.0, gains)
    with Count():
        sea_filter(x, 0.7, 2.0, gains)
    assert Count.ops <= 8, Count.ops


ACTION_CASES = [  # tests.test_action's case tuples: (mode, domain, tier, chunk, input, raw rows, extra)
    ("policy", "bridge_orig_lerobot", 256, 8, (40, 56, 0), 0, {"negative_prompt": "blurry"}),  # CFG, noisy band
    ("forward_dynamics", "av", 256, 4, (48, 64, 5), 4, {"guidance_scale": 1.0}),  # one branch, clean band
    ("policy", "av", 256, 5, (48, 64, 0), 0, {"sound": True}),  # vision | sound | action in one residual
    ("inverse_dynamics", "pusht", 256, 4, (40, 56, 5), 0, {}),  # no noisy vision frame: diffusers fails open
]


@pytest.fixture(scope="module")
def action_stack(action_ckpt):
    d = Deployment.load(None, checkpoint=str(action_ckpt), device="cpu", dtype="float32")
    return reference_pipeline(action_ckpt), Generator(d)


@pytest.mark.parametrize("case", ACTION_CASES, ids=[f"{c[0]}-{c[1]}{'-sound' if c[6].get('sound') else ''}"
                                                    for c in ACTION_CASES])  # fmt: skip
def test_cached_action_request_equals_pipeline(action_stack, case):
    """diffusers' SeaCache runs on action requests: the indicator is the vision latents, the reused residual spans
    the action (and sound) tokens. Ours skips the same steps and its latents, actions (and waveform) equal the
    pipeline's; inverse dynamics, with no noisy vision frame, skips nothing on either side."""
    from tests.test_action import PROMPT as ACTION_PROMPT
    from tests.test_action import SHIFT, inputs_of
    from tests.test_action import reference as action_reference

    pipe, gen = action_stack
    mode, domain, tier, chunk, _, _, extra = case
    image, clip, raw = inputs_of(case)
    steps, seed, config = 10, 3, CONFIGS["extrapolate"]
    branches = 1 if extra.get("guidance_scale", 5.0) == 1.0 else 2
    pipe.transformer.enable_cache(sea_cache_config({"cache": {"policy": "sea", **config}}))
    calls = StackCalls(pipe.transformer)
    try:
        ref_v, ref_a, ref_s = action_reference(pipe, case, image, clip, raw, steps=steps, seed=seed)
    finally:
        calls.remove()
        pipe.transformer.disable_cache()
    params = {"steps": steps, "seed": seed, "shift": SHIFT, "guidance_scale": extra.get("guidance_scale", 5.0),
              "fps": extra.get("fps", 24.0), "enable_sound": extra.get("sound", False),
              "action": {"mode": mode, "chunk_size": chunk, "domain": domain, "resolution_tier": tier},
              "cache": {"policy": "sea", **config}}  # fmt: skip
    if "negative_prompt" in extra:
        params["negative_prompt"] = extra["negative_prompt"]
    p = gen.prefill.validate(ACTION_PROMPT, params, image, clip, raw)
    out = gen.run(gen.prefill.run(p, image, clip, raw))
    assert out.info["cache_skipped"] == calls.skipped(branches)
    assert bool(out.info["cache_skipped"]["cond"]) == (mode != "inverse_dynamics"), out.info["cache_skipped"]
    assert out.latents.shape == ref_v.shape and rel_l2(out.latents, ref_v) <= 1e-4, rel_l2(out.latents, ref_v)
    if ref_a is None:
        assert out.actions is None
    else:
        assert out.actions.shape == ref_a.shape and rel_l2(out.actions, ref_a) <= 1e-4, rel_l2(out.actions, ref_a)
    if ref_s is not None:
        wave = torch.as_tensor(gen.decode.audio(out.sound))
        assert rel_l2(wave, ref_s.float().reshape(wave.shape)) <= 1e-4


def test_fp8_packed_tick_with_reused_branches_equals_each_alone(tiny_ckpts, tmp_path_factory):
    """FP8 (W8A16 rows packed first; `a16_rows` counts the running branches only): two cached requests (W8A16 at
    their first step and last 2, W8A8 between) packed with an uncached one of another size started 3 ticks later;
    each equals its run alone, and some tick packs a reusing W8A16 row before a W8A8 row that runs (were the reused
    branches counted, that row would run W8A16)."""
    from cosmos3_core.tools.make_fp8 import make_fp8, policy_json

    fp8 = make_fp8(tiny_ckpts["nano"], tmp_path_factory.mktemp("fp8") / "nano", policy_json(1, 2))
    ckpt = Checkpoint.open(fp8)
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=32, num_frames=5), Limits())
    sea = {"policy": "sea", **CONFIGS["extrapolate"]}
    requests = [
        prefill.run(prefill.validate(PROMPT, {"seed": 1, "steps": 8, "cache": sea}, None), None),
        prefill.run(prefill.validate("blue", {"seed": 2, "steps": 8, "height": 48, "num_frames": 9}, None), None),
        prefill.run(prefill.validate("red", {"seed": 3, "steps": 8, "guidance_scale": 1.0, "cache": sea}, None), None),
    ]

    def run(items, start_later=()):
        engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=128, page_size=16, max_queue=4)
        ticks: list[list[tuple[bool, int]]] = []  # per tick, per row: (a16, branches that run)
        step = engine.step
        # a fresh layout each tick: a16_rows is computed, not found in a layout of the same running rows
        engine.step = lambda rows: (ticks.append([(r.a16, sum(x is None for x in r.reuse)) for r in rows]),
                                    step.layouts.clear(), step(rows))[2]  # fmt: skip
        sinks = [Done() for _ in items]
        for i, (r, s) in enumerate(zip(items, sinks)):
            if i not in start_later:
                engine.submit(r, s)
        for _ in range(3):
            engine.tick()
        for i in start_later:
            engine.submit(items[i], sinks[i])
        engine.run_until_idle()
        assert not any(s.errors for s in sinks)
        return sinks, ticks

    packed, ticks = run(requests, start_later=(1,))
    assert packed[0].info["cache_skipped"]["cond"] and packed[2].info["cache_skipped"]["cond"]
    assert any(any(a and not n for a, n in t) and any(n and not a for a, n in t) for t in ticks), ticks
    for request, got in zip(requests, packed):
        (alone,), _ = run([request])
        torch.testing.assert_close(got.latents, alone.latents, rtol=0, atol=1e-6)
        assert got.info.get("cache_skipped") == alone.info.get("cache_skipped")
