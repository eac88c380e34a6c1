"""FP8 (model/fp8.py): official ModelOpt FP8 checkpoints and `precision: fp8`, against diffusers 0.42.1 + ModelOpt.

The oracle is `Cosmos3OmniPipeline` on the FP8 checkpoint `tools/make_fp8.py` writes, loaded as diffusers loads
ModelOpt checkpoints (ModelOpt restores `modelopt_state.pth`; its patch of `from_pretrained` is applied only around
the one load), with its own step policy (`Cosmos3MixedPrecisionConfig`) and its own W8A16 (`_w8a16_linear`). Two
test-scoped patches, undone after each test:
- the FP8 linears' native W8A8 forward is ModelOpt's own GEMM function `fp8_per_tensor_gemm` (ModelOpt dispatches
  to it only on CUDA; on the CPU its fallback cannot run an E4M3 weight), with dynamo off so its `torch.compile`d
  helpers run eagerly: the same `_scaled_mm`, now on the CPU;
- for mixed W8A16/W8A8 runs, diffusers' `_classify_cosmos3_linear` by tower (GEN: add_*/to_add_out/mlp_moe_gen;
  reasoner = UND: to_*/mlp), as the policy defines it; 0.42.1 swaps the attention projections of the two towers
  (`test_diffusers_own_classification_moves_w8a8_steps` keeps that visible).

Bars (fp32, CPU): every comparison of latents ≤ 1e-4 rel-L2 (measured 1e-6: the same E4M3 codes, fp32 sums in
another order). W8A8 is discontinuous: an activation within ~1e-7 of an E4M3 rounding midpoint could round the
other way and move its token by one E4M3 step (6 %); the fixed cases here have none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import Generator
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.config import CheckpointError
from cosmos3_core.model.fp8 import (
    E4M3,
    FP8_MAX,
    Fp8Linear,
    PolicyError,
    StepPolicy,
    dequantize,
    quantize,
    quantize_activations,
    resolve_policy,
    w8a8_reference,
)
from cosmos3_core.requests import Defaults, Limits
from cosmos3_core.stages import PrefillStage
from cosmos3_core.tools.make_fp8 import make_fp8, policy_json
from tests.conftest import KeepSink, rel_l2, run_reference

PROMPT = "a red cube slides across a wooden table"
T2V = dict(num_frames=9, height=32, width=64, steps=4, guidance_scale=6.0, shift=10.0, seed=3, fps=16.0)
I2V = dict(num_frames=9, height=32, width=64, steps=4, guidance_scale=5.0, shift=8.0, seed=2)
GEN_SUFFIXES = (".self_attn.add_q_proj", ".self_attn.add_k_proj", ".self_attn.add_v_proj", ".self_attn.to_add_out")
UND_SUFFIXES = (".self_attn.to_q", ".self_attn.to_k", ".self_attn.to_v", ".self_attn.to_out")


@pytest.fixture(scope="session")
def fp8_ckpts(tiny_ckpts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {v: make_fp8(tiny_ckpts[v], root / v, policy_json()) for v in ("nano", "edge")}


@pytest.fixture
def eager_modelopt():
    """ModelOpt's GEMM helpers are `torch.compile`d: run them eagerly (on the CPU) for this test."""
    with torch._dynamo.config.patch(disable=True):
        yield


def by_tower(name: str) -> str | None:
    if ".mlp_moe_gen." in name or name.endswith(GEN_SUFFIXES):
        return "generation"
    if ".mlp." in name or name.endswith(UND_SUFFIXES):
        return "reasoner"
    return None


def diffusers_fp8(ckpt: Path, monkeypatch, classify_by_tower: bool = True):
    """The oracle pipeline (see the module docstring)."""
    import diffusers.pipelines.cosmos.mixed_precision as mixed_precision
    from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer
    from modelopt.torch.opt.plugins.huggingface import _patch_model_init_for_modelopt
    from modelopt.torch.quantization.backends.fp8_per_tensor_gemm import fp8_per_tensor_gemm

    assert torch._dynamo.config.disable, "request the `eager_modelopt` fixture"
    if classify_by_tower:
        monkeypatch.setattr(mixed_precision, "_classify_cosmos3_linear", by_tower)
    with _patch_model_init_for_modelopt(Cosmos3OmniTransformer, str(ckpt / "transformer")):
        transformer = Cosmos3OmniTransformer.from_pretrained(ckpt / "transformer", torch_dtype=torch.float32)
    fp8 = 0
    for module in transformer.modules():
        if hasattr(module, "_should_run_real_quant_gemm") and module.weight.dtype == E4M3:
            module.forward = lambda x, m=module: fp8_per_tensor_gemm(m, x, m.bias)  # this instance's only
            fp8 += 1
    per_layer = 12 if transformer.config.hidden_act == "relu2" else 14  # 8 projections + 2 MLPs of 2 or 3
    assert fp8 == per_layer * transformer.config.num_hidden_layers
    pipe = Cosmos3OmniPipeline.from_pretrained(ckpt, transformer=transformer, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, params: dict, policy: StepPolicy | None, image=None) -> torch.Tensor:
    """diffusers' latents; `policy` passed as its `mixed_precision_*` arguments (None: the checkpoint's own)."""
    mixed = {}
    if policy is not None:
        reasoner = "high_precision" if policy.reasoner_a16 else "base_precision"
        mixed = dict(mixed_precision_format="fp8", mixed_precision_first_steps=policy.first_steps,
                     mixed_precision_last_steps=policy.last_steps, mixed_precision_reasoner_policy=reasoner)  # fmt: skip
    return run_reference(pipe, PROMPT, params, image, **mixed)


def ours(ckpt: Path, params: dict, policy: StepPolicy | None, image=None, **deployment) -> torch.Tensor:
    """Our latents (the offline Generator); `policy` as a deployment's `fp8_policy` (None: the checkpoint's)."""
    overrides = {}
    if policy is not None:
        overrides = {"first_steps": policy.first_steps, "last_steps": policy.last_steps, "reasoner": policy.reasoner}
    d = Deployment(checkpoint=str(ckpt), device="cpu", dtype="float32", fp8_policy=overrides, **deployment)
    return Generator(d).latents(PROMPT, dict(params), image)


# ---- the step policy ---------------------------------------------------------------------------------------------


def test_policy_per_step_equals_diffusers():
    from diffusers.pipelines.cosmos.mixed_precision import Cosmos3MixedPrecisionConfig

    for steps in (1, 2, 3, 4, 6, 7, 20, 35):
        for first in (0, 1, 3, 5, 40):
            for last in (0, 1, 3, 4):
                for overlap in ("a16", "native"):
                    theirs = Cosmos3MixedPrecisionConfig("fp8", first, last, "high_precision", overlap)
                    mine = StepPolicy(first, last, overlap, "a16")
                    got = [mine.use_high_precision(i, steps) for i in range(steps)]
                    assert got == [theirs.use_high_precision(i, steps) for i in range(steps)], (first, last, overlap)
    assert StepPolicy().use_high_precision(0, 1) is False  # the 1-step rule
    assert [StepPolicy(3, 3, "native").use_high_precision(i, 4) for i in range(4)] == [True, False, False, True]
    for bad in ((4, 4), (-1, 4)):
        with pytest.raises(IndexError):
            StepPolicy().use_high_precision(*bad)


@pytest.mark.parametrize("checkpoint_policy", [None, policy_json(), policy_json(2, 0, "native", "native")])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"first_steps": 1}, {"last_steps": 0, "reasoner": "native"}, {"overlap": "native", "first_steps": 9}],
)
def test_resolved_policy_equals_diffusers(checkpoint_policy, overrides):
    """An FP8 checkpoint's policy with a deployment's `fp8_policy` overrides, as diffusers resolves the checkpoint's
    `quantization_config` with `mixed_precision_*` arguments (format forced to fp8 when any is given)."""
    from diffusers.pipelines.cosmos.mixed_precision import Cosmos3MixedPrecisionConfig

    qc = {"quant_method": "modelopt", "quant_algo": "FP8"}
    if checkpoint_policy is not None:
        qc["runtime"] = {"diffusion_step_policy": checkpoint_policy}
    names = {"first_steps": "first_steps", "last_steps": "last_steps", "overlap": "overlap"}
    kwargs = {f"mixed_precision_{names[k]}": v for k, v in overrides.items() if k in names}
    if "reasoner" in overrides:
        kwargs["mixed_precision_reasoner_policy"] = {"a16": "high_precision", "native": "base_precision"}[
            overrides["reasoner"]
        ]
    theirs = Cosmos3MixedPrecisionConfig.resolve(
        None, quantization_config=qc, mixed_precision_format="fp8" if overrides else None, **kwargs
    )
    parsed = StepPolicy.parse(checkpoint_policy) if checkpoint_policy is not None else None
    mine = resolve_policy(parsed, True, overrides)
    for steps in (1, 2, 5, 8):
        # diffusers' format "none" leaves every linear on its native W8A8 forward
        want = [theirs.enabled and theirs.use_high_precision(i, steps) for i in range(steps)]
        assert [mine.use_high_precision(i, steps) for i in range(steps)] == want
    assert mine.reasoner_a16 == (theirs.enabled and theirs.reasoner_policy == "high_precision")


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda p: p.pop("overlap"), "missing fields ['overlap']"),
        (lambda p: p.update(schema_version=2), "schema_version"),
        (lambda p: p.update(type="sigma_window"), ".type"),
        (lambda p: p.update(scope=["transformer", "vae"]), ".scope"),
        (lambda p: p.update(first_steps={"count": -1, "mode": "a16"}), ".first_steps.count"),
        (lambda p: p.update(last_steps={"count": 2, "mode": "w4"}), ".last_steps"),
        (lambda p: p.update(reasoner="fp16"), ".reasoner"),
    ],
)
def test_bad_checkpoint_policy_fails_naming_the_field(tiny_ckpts, tmp_path, edit, field):
    """Refused where diffusers' `parse_diffusion_step_policy` refuses it, the error naming the field; a checkpoint
    that carries such a policy does not open."""
    from diffusers.pipelines.cosmos.mixed_precision import parse_diffusion_step_policy

    policy = policy_json()
    edit(policy)
    with pytest.raises((ValueError, TypeError)):
        parse_diffusion_step_policy(policy)
    with pytest.raises(PolicyError, match=field.replace("[", r"\[").replace("]", r"\]")):
        StepPolicy.parse(policy)
    ckpt = _copy_with_config(tiny_ckpts["nano"], tmp_path, {"quant_method": "modelopt", "quant_algo": "FP8",
                                                           "runtime": {"diffusion_step_policy": policy}})  # fmt: skip
    with pytest.raises(CheckpointError, match="diffusion_step_policy"):
        Checkpoint.open(ckpt)


def _copy_with_config(src: Path, tmp_path: Path, quantization_config: dict | None) -> Path:
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    path = dst / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization_config
    path.write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"precision": "fp16"}, "precision must be one of checkpoint, fp8"),
        ({"precision": "fp8", "fp8_policy": {"first_steps": -1}}, r"fp8_policy\.first_steps"),
        ({"precision": "fp8", "fp8_policy": {"last_steps": 2.5}}, r"fp8_policy\.last_steps"),
        ({"precision": "fp8", "fp8_policy": {"overlap": "maybe"}}, r"fp8_policy\.overlap"),
        ({"precision": "fp8", "fp8_policy": {"reasoner": "bf16"}}, r"fp8_policy\.reasoner"),
        ({"precision": "fp8", "fp8_policy": {"frist_steps": 1}}, r"fp8_policy: unknown keys \['frist_steps'\]"),
        ({"precision": "fp8", "fp8_policy": [1, 2]}, "fp8_policy must be a mapping"),
    ],
)
def test_deployment_validation_names_the_field(tmp_path, raw, field):
    import yaml

    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=field):
        Deployment.load(path)


def test_fp8_policy_on_a_16_bit_checkpoint_needs_precision_fp8(nano_ckpt):
    with pytest.raises(PolicyError, match="fp8_policy: set, but"):
        Checkpoint.open(nano_ckpt, "checkpoint", {"first_steps": 2})
    assert Checkpoint.open(nano_ckpt).fp8 is None
    plan = Checkpoint.open(nano_ckpt, "fp8", {"first_steps": 2}).fp8
    assert plan is not None and plan.quantize_at_load and plan.policy == StepPolicy(2, 3, "a16", "a16")


# ---- the official layout -----------------------------------------------------------------------------------------


def test_make_fp8_writes_the_official_layout_and_we_load_it(fp8_ckpts, tiny_ckpts, tmp_path):
    ckpt = fp8_ckpts["nano"]
    tdir = ckpt / "transformer"
    qc = json.loads((tdir / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["quant_algo"], qc["quant_type"]) == ("modelopt", "FP8", "FP8_FP8")
    assert qc["runtime"]["diffusion_step_policy"] == policy_json() and "proj_in" in qc["ignore"]
    assert (tdir / "modelopt_state.pth").is_file()
    sd = load_file(tdir / "diffusion_pytorch_model.safetensors")
    src = load_file(tiny_ckpts["nano"] / "transformer" / "diffusion_pytorch_model.safetensors")
    name = "layers.1.mlp_moe_gen.down_proj"
    assert sd[f"{name}.weight"].dtype == E4M3 and sd["proj_in.weight"].dtype == torch.float32
    ws, xs = sd[f"{name}.weight_scale"], sd[f"{name}.input_scale"]
    assert ws.shape == xs.shape == () and torch.equal(sd[f"{name}.weight_quantizer._scale"], ws)
    assert torch.equal(sd[f"{name}.weight_quantizer._amax"] / FP8_MAX, ws)  # ModelOpt's W8A8 reads amax / 448
    assert torch.equal(sd[f"{name}.input_quantizer._amax"] / FP8_MAX, xs)
    deq = sd[f"{name}.weight"].float() * ws
    assert (deq - src[f"{name}.weight"]).abs().max() <= src[f"{name}.weight"].abs().max() / 16  # E4M3: 3 bits
    c = Checkpoint.open(ckpt)
    assert c.fp8_weights and c.fp8 is not None and c.fp8.policy == StepPolicy() and not c.fp8.quantize_at_load
    model = c.load_transformer({"gen", "und"}, "cpu", torch.float32)
    lin = model.get_submodule(name)
    assert isinstance(lin, Fp8Linear) and torch.equal(lin.weight, sd[f"{name}.weight"])
    assert torch.equal(lin.weight_scale, ws) and torch.equal(lin.input_scale, xs)
    assert type(model.proj_in) is torch.nn.Linear and model.dtype == torch.float32

    # only ModelOpt's own scale copies (a checkpoint saved by diffusers + ModelOpt): the same scales load
    dst = _copy_with_config(ckpt, tmp_path, qc)
    plain = {k: v for k, v in sd.items() if not k.endswith((".weight_scale", ".input_scale"))}
    save_file(plain, dst / "transformer" / "diffusion_pytorch_model.safetensors")
    again = Checkpoint.open(dst).load_transformer({"gen"}, "cpu", torch.float32).get_submodule(name)
    assert torch.equal(again.weight_scale, ws) and torch.equal(again.input_scale, xs)
    # no input scale at all: refused, naming the key
    save_file({k: v for k, v in plain.items() if not k.startswith(f"{name}.input_quantizer")},
              dst / "transformer" / "diffusion_pytorch_model.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match=rf"missing key '{name}.input_scale'"):
        Checkpoint.open(dst).load_transformer({"gen"}, "cpu", torch.float32)
    # E4M3 weights without a quantization_config would be cast without their scale: refused
    save_file(sd, dst / "transformer" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(CheckpointError, match="stored in FP8"):
        Checkpoint.open(_copy_with_config(dst, tmp_path / "x", None)).load_transformer({"gen"}, "cpu", torch.float32)
    with pytest.raises(CheckpointError, match="quant_method 'modelopt'"):
        Checkpoint.open(_copy_with_config(dst, tmp_path / "y", {"quant_method": "torchao", "quant_algo": "FP8"}))


# ---- against diffusers + ModelOpt --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["nano", "edge"])
def test_w8a16_steps_equal_diffusers(fp8_ckpts, variant, monkeypatch, test_image, eager_modelopt):
    """Every step W8A16 (first_steps ≥ steps; reasoner a16): the whole run is diffusers' W8A16 path."""
    ckpt = fp8_ckpts[variant]
    pipe = diffusers_fp8(ckpt, monkeypatch, classify_by_tower=False)  # all W8A16: the classification is moot
    policy = StepPolicy(first_steps=T2V["steps"], last_steps=0)
    ref = reference(pipe, T2V, policy)
    assert pipe._mixed_precision_trace == ["W8A16"] * T2V["steps"]
    assert rel_l2(ours(ckpt, T2V, policy), ref) <= 1e-4
    if variant == "nano":
        policy = StepPolicy(first_steps=0, last_steps=I2V["steps"])
        assert rel_l2(ours(ckpt, I2V, policy, test_image), reference(pipe, I2V, policy, test_image)) <= 1e-4


# (variant, request, policy; None: the checkpoint's own, here 3 + 3 steps with overlap native)
W8A8_CASES = [
    ("nano", dict(T2V, steps=2, seed=0), StepPolicy(0, 0, "a16", "native")),  # W8A8 everywhere
    ("edge", dict(T2V, steps=2, seed=4), StepPolicy(0, 0, "a16", "native")),
    ("edge", dict(T2V, steps=1, seed=1), StepPolicy()),  # 1 step: W8A8 (the reasoner a16)
    ("nano", dict(T2V, steps=3, seed=2), StepPolicy(1, 1, "a16", "a16")),  # W8A16, W8A8, W8A16
    ("edge", dict(T2V, steps=4, seed=0), StepPolicy(1, 1, "a16", "native")),
    ("nano", dict(T2V, steps=4, seed=1), None),  # overlap native: W8A16, W8A8, W8A8, W8A16
]


def test_w8a8_and_mixed_steps_equal_diffusers_modelopt(fp8_ckpts, tmp_path, monkeypatch, eager_modelopt):
    """Native W8A8 steps (ModelOpt's own GEMM function) and mixed schedules, against diffusers with its step policy,
    its W8A16, ModelOpt's W8A8 and the linears classified by tower: rel-L2 ≤ 1e-4 (measured ~1e-6). Each op is
    ModelOpt's bit for bit (`test_native_w8a8_linear_is_modelopts_gemm`), but a run may meet an E4M3 rounding tie
    (module docstring), which the tiny model amplifies; a tie belongs to one seed, so a case may take a second
    seed. A wrong precision, scale or linear fails every seed."""
    overlap = _copy_with_config(fp8_ckpts["nano"], tmp_path, None)  # the same weights, the policy in config.json
    config = json.loads((fp8_ckpts["nano"] / "transformer" / "config.json").read_text())
    config["quantization_config"]["runtime"]["diffusion_step_policy"] = policy_json(3, 3, "native", "a16")
    (overlap / "transformer" / "config.json").write_text(json.dumps(config))
    report = []
    for variant, params, policy in W8A8_CASES:
        ckpt = fp8_ckpts[variant] if policy is not None else overlap
        pipe = diffusers_fp8(ckpt, monkeypatch)
        schedule = policy or StepPolicy(3, 3, "native", "a16")
        steps = params["steps"]
        want = ["W8A16" if schedule.use_high_precision(i, steps) else "W8A8" for i in range(steps)]
        errors = []
        for seed in (params["seed"], params["seed"] + 10):
            ref = reference(pipe, dict(params, seed=seed), policy)
            assert pipe._mixed_precision_trace == want and "W8A8" in want
            errors.append(rel_l2(ours(ckpt, dict(params, seed=seed), policy), ref))
            if errors[-1] <= 1e-4:
                break
        report.append((variant, steps, schedule, errors))
    print("\n".join(f"{v} {n} steps {p}: rel-L2 {', '.join(f'{e:.1e}' for e in es)}" for v, n, p, es in report))
    assert all(errors[-1] <= 1e-4 for *_, errors in report), report


def test_diffusers_own_classification_moves_w8a8_steps(fp8_ckpts, monkeypatch, eager_modelopt):
    """diffusers 0.42.1 as shipped runs the GEN attention projections on the reasoner policy and the UND ones on
    the step policy: its mixed runs differ from the towers' classification (ours) by far more than the bar. When
    diffusers changes this, this test says so."""
    params, policy = dict(T2V, steps=3, seed=2), StepPolicy(1, 1, "a16", "a16")
    shipped = reference(diffusers_fp8(fp8_ckpts["nano"], monkeypatch, classify_by_tower=False), params, policy)
    assert rel_l2(ours(fp8_ckpts["nano"], params, policy), shipped) > 1e-2


def test_native_w8a8_linear_is_modelopts_gemm(fp8_ckpts, monkeypatch, eager_modelopt):
    """Fp8Linear's W8A8 equals ModelOpt's `fp8_per_tensor_gemm` on the same module and input, bit for bit, and the
    written-out maths (`w8a8_reference`) to fp32 rounding."""
    pipe = diffusers_fp8(fp8_ckpts["edge"], monkeypatch)
    model = Checkpoint.open(fp8_ckpts["edge"]).load_transformer({"gen", "und"}, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    for name in ("layers.0.self_attn.to_q", "layers.1.self_attn.add_v_proj", "layers.0.mlp_moe_gen.down_proj"):
        theirs, mine = pipe.transformer.get_submodule(name), model.get_submodule(name)
        x = torch.randn(37, mine.in_features, generator=g) * 3  # some beyond the calibrated range: clamped
        torch.testing.assert_close(mine(x, False), theirs(x), rtol=0, atol=0)
        ref = w8a8_reference(x, mine.weight, mine.weight_scale, mine.input_scale, mine.bias)
        torch.testing.assert_close(mine(x, False), ref, rtol=1e-5, atol=1e-5)
        x16 = x.to(torch.bfloat16)  # bf16 activations: the GPU's dtype
        torch.testing.assert_close(mine(x16, False), w8a8_reference(x16, mine.weight, mine.weight_scale,
                                                                    mine.input_scale), rtol=1e-2, atol=1e-2)  # fmt: skip


# ---- the packed step ---------------------------------------------------------------------------------------------


def test_packed_tick_mixing_w8a16_and_w8a8_rows_equals_each_alone(fp8_ckpts):
    """A (6 steps) is at its W8A8 step 2 when B (4 steps, other size) starts at its W8A16 step 0: that tick packs
    both precisions. Each request's latents equal it run alone, and every tick gave each row its own step's
    precision."""
    ckpt = Checkpoint.open(fp8_ckpts["nano"], "checkpoint", {"first_steps": 2, "last_steps": 2})
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=32, num_frames=5), Limits())
    a = prefill.run(prefill.validate(PROMPT, {"seed": 1, "steps": 6}, None), None)
    b = prefill.run(prefill.validate("blue", {"seed": 2, "steps": 4, "height": 48, "num_frames": 9}, None), None)

    def engine():
        e = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=64, page_size=16, max_queue=4)
        ticks: list[list[tuple[int, bool]]] = []
        step = e.step
        e.step = lambda rows: (ticks.append([(r.tokens.shape[0], r.a16) for r in rows]), step(rows))[1]
        return e, ticks

    alone = []
    for request in (a, b):
        e, _ = engine()
        sink = KeepSink()
        e.submit(request, sink)
        e.run_until_idle()
        alone.append(sink.latents)
    e, ticks = engine()
    sinks = [KeepSink(), KeepSink()]
    e.submit(a, sinks[0])
    e.tick()
    e.tick()
    e.submit(b, sinks[1])
    e.run_until_idle()
    n_a, n_b = ticks[0][0][0], ticks[2][1][0]
    assert n_a != n_b and ticks[2] == [(n_a, False), (n_b, True)]  # A W8A8, B W8A16, in one forward
    policy = ckpt.fp8.policy
    assert [t[0][1] for t in ticks[:6]] == [policy.use_high_precision(i, 6) for i in range(6)]
    assert [t[-1][1] for t in ticks[2:6]] == [policy.use_high_precision(i, 4) for i in range(4)]
    for packed, solo in zip(sinks, alone):
        torch.testing.assert_close(packed.latents, solo, rtol=0, atol=1e-6)
        assert rel_l2(packed.latents, solo) <= 1e-6
    # and the W8A8 steps ran W8A8: A with every step W8A16 ends elsewhere
    a16_ckpt = Checkpoint.open(fp8_ckpts["nano"], "checkpoint", {"first_steps": 6, "last_steps": 0})
    e = DenoiseEngine(a16_ckpt, "cpu", torch.float32, pool_pages=64, page_size=16, max_queue=4)
    e.submit(a, sink := KeepSink())
    e.run_until_idle()
    assert rel_l2(sink.latents, alone[0]) > 1e-3


# ---- precision: fp8 on a 16-bit checkpoint -----------------------------------------------------------------------


def test_rowwise_quantization_error_is_within_e4m3_rounding():
    """Per output channel: the row's largest |w| maps to ±448 exactly; every other element is off by at most half
    an E4M3 step (2⁻⁴ relative in the normal range, scale · 2⁻¹⁰ below it)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different ranges
    w[5] = 0.0  # an all-zero row stays zero
    w8, s = quantize(w, rowwise=True)
    assert w8.dtype == E4M3 and s.shape == (96,)
    deq = dequantize(w8, s, torch.float32)
    bound = torch.maximum(w.abs() * 2.0**-4, s[:, None] * 2.0**-10) * (1 + 1e-6)
    assert ((deq - w).abs() <= bound).all()
    peak = w.abs().argmax(-1)
    assert torch.equal(w8.float().abs().gather(1, peak[:, None])[[i for i in range(96) if i != 5]],
                       torch.full((95, 1), FP8_MAX))  # fmt: skip
    assert deq[5].abs().max() == 0
    q, sx = quantize_activations(w, None)  # activations: the same rule per token
    assert sx.shape == (96, 1) and torch.allclose(sx[:, 0], s)


def test_fp8_linear_w8a16_is_linear_on_dequantized_weights_and_w8a8_is_the_scaled_product():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 48, bias=True)
    torch.nn.init.normal_(lin.weight, generator=g)
    m = Fp8Linear.from_linear(lin)
    x = torch.randn(70, 64, generator=g)
    x[3] = 0.0  # a padding row
    deq = dequantize(m.weight, m.weight_scale, torch.float32)
    torch.testing.assert_close(m(x, True), torch.nn.functional.linear(x, deq, lin.bias), rtol=0, atol=0)
    w8a8 = m(x, False)
    torch.testing.assert_close(w8a8, w8a8_reference(x, m.weight, m.weight_scale, None, m.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(w8a8[3], lin.bias.detach())  # zero row → zero product, then the bias
    q, sx = quantize_activations(x, None)
    assert torch.equal(q.float().abs().amax(-1)[[i for i in range(70) if i != 3]], torch.full((69,), FP8_MAX))


def test_precision_fp8_w8a16_equals_the_checkpoint_with_dequantized_weights(nano_ckpt, tmp_path):
    """`precision: fp8`, every step W8A16 (and reasoner a16): the run equals the 16-bit pipeline on a checkpoint
    whose layer linears hold the dequantized weights — the quantization is the only change."""
    import shutil

    deq_ckpt = tmp_path / "deq"
    shutil.copytree(nano_ckpt, deq_ckpt)
    path = deq_ckpt / "transformer" / "diffusion_pytorch_model.safetensors"
    sd = load_file(path)
    for k in [k for k in sd if k.startswith("layers.") and k.endswith(".weight") and sd[k].ndim == 2]:
        sd[k] = dequantize(*quantize(sd[k], rowwise=True), torch.float32)
    save_file(sd, path)
    policy = StepPolicy(first_steps=T2V["steps"], last_steps=0)
    quantized = ours(nano_ckpt, T2V, policy, precision="fp8")
    plain = Generator(Deployment(checkpoint=str(deq_ckpt), device="cpu", dtype="float32")).latents(PROMPT, T2V)
    torch.testing.assert_close(quantized, plain, rtol=0, atol=1e-6)
    # the default policy (3 + 3 of 8 steps W8A16) runs W8A8 in steps 3 and 4: a different, nearby result
    mixed = ours(nano_ckpt, dict(T2V, steps=8), StepPolicy(), precision="fp8")
    full = Generator(Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32")).latents(
        PROMPT, dict(T2V, steps=8)
    )
    assert 1e-4 < rel_l2(mixed, full) < 0.5


def test_fp8_warmup_compiles_w8a16_w8a8_and_mixed_layouts(fp8_ckpts):
    """Warmup runs a request's W8A16 step beside a 1-step (W8A8) one, then W8A8 alone: no path of the linears is
    first met (and compiled) while serving."""
    ckpt = Checkpoint.open(fp8_ckpts["nano"])
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=32, num_frames=5), Limits())
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=64, page_size=16, max_queue=4)
    took = engine.warmup([prefill.validate("warmup", {"steps": 20}, None)])
    assert {tuple(row[-1] for row in key[0]) for key in engine.step.layouts} == {(True, False), (True,), (False,)}
    parts = engine.warmup_parts  # the server logs startup's parts
    assert set(parts) == {"bucket captures", "requests"} and 0 < parts["requests"] <= took, (parts, took)
    assert engine.stats.ticks == 0 and not engine.has_work()
