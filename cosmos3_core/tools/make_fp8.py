"""Write an FP8 checkpoint in the official layout (ModelOpt FP8, as the Hub `fp8` revision) from a 16-bit one.

Contract
--------
``python -m cosmos3_core.tools.make_fp8 --src DIR --out DIR [--first-steps 3 --last-steps 3 --overlap a16
--reasoner a16 | --no-policy]`` (or :func:`make_fp8`) copies ``DIR`` and rewrites ``transformer/``:

- ``diffusion_pytorch_model.safetensors``: every other tensor as stored; each layer linear ``X`` (both towers'
  attention projections and MLPs — the official ``ignore`` list keeps ``proj_in/out``, the timestep embedder and
  the sound / action projections 16-bit) as ``X.weight`` E4M3 [out, in], ``X.weight_scale`` fp32 [] (tensorwise:
  amax|W| / 448), ``X.input_scale`` fp32 [] (static: the calibrated amax of its input / 448), and ModelOpt's own
  copies ``X.weight_quantizer._amax`` (= weight_scale · 448), ``X.weight_quantizer._scale`` (= weight_scale),
  ``X.input_quantizer._amax`` (= input_scale · 448) — the tensors the cookbook exporter
  (cosmos_framework ``Fp8DiffusersExporter.overlay``) writes;
- ``config.json``: ``quantization_config`` as that exporter stamps it (quant_method ``modelopt``, quant_algo ``FP8``,
  quant_type ``FP8_FP8``, ``ignore``, ``modelopt_config``) plus ``runtime.diffusion_step_policy`` (schema 1,
  ``first_last_n``), unless ``--no-policy`` (a distilled checkpoint's: W8A8 every step);
- ``modelopt_state.pth`` when ``nvidia-modelopt`` is installed: the ModelOpt graph state diffusers needs to load
  the weights (``mto.enable_huggingface_checkpointing()`` restores it). It is the real-quantized state
  (``mtq.quantize`` then ``mtq.compress``, as diffusers+ModelOpt's own ``save_pretrained`` writes it): the
  exporter's quantize-only state makes diffusers 0.42.1 build fake-quant linears its mixed precision does not
  recognise. Our loader never reads it.

Scales are rounded to 20 significant bits so that ``s · 448`` and back is exact: the plain keys and ModelOpt's
amax copies then give the very same scale (diffusers' W8A16 reads ``_scale``, ModelOpt's W8A8 ``amax / 448``).

Calibration: the input amax of each linear is the max |x| it sees while diffusers' ``Cosmos3OmniPipeline`` runs
``CALIBRATION`` on the source checkpoint (CPU, fp32): meant for tiny checkpoints (tests, the CPU parity runs).
Deterministic in the source checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..model.config import WEIGHTS
from ..model.fp8 import E4M3, FP8_MAX, MODES, quantize

__all__ = ["CALIBRATION", "IGNORE", "make_fp8", "policy_json", "quantization_config"]

# linears the official checkpoints keep 16-bit (the exporter's `_DIFFUSERS_IGNORE_MODULES`)
IGNORE = ["proj_in", "proj_out", "time_embedder*", "audio_proj_in", "audio_proj_out", "action_proj_in",
          "action_proj_out", "lm_head", "model.visual*", "visual*"]  # fmt: skip
CALIBRATION: list[dict[str, Any]] = [
    dict(prompt="a red cube slides across a wooden table", num_frames=9, height=32, width=64,
         num_inference_steps=4, guidance_scale=6.0),
    dict(prompt="a robot arm stacks blue blocks", num_frames=1, height=64, width=32,
         num_inference_steps=4, guidance_scale=4.0),
]  # fmt: skip


def policy_json(first_steps: int = 3, last_steps: int = 3, overlap: str = "a16", reasoner: str = "a16") -> dict:
    """`quantization_config.runtime.diffusion_step_policy`, schema 1 (the official one: the defaults)."""
    return {
        "schema_version": 1,
        "type": "first_last_n",
        "index_space": "denoising_loop_iteration",
        "scope": ["transformer"],
        "default_mode": "native",
        "first_steps": {"count": first_steps, "mode": "a16"},
        "last_steps": {"count": last_steps, "mode": "a16"},
        "overlap": overlap,
        "reasoner": reasoner,
    }


def _modelopt_config() -> dict[str, Any]:
    """The exporter's `modelopt_config` (FP8_DEFAULT_CFG's FP8 entries, weights real-quantized, `IGNORE` off)."""
    fp8 = {"num_bits": [4, 3], "axis": None}
    return {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": {**fp8, "fake_quant": False}},
            {"quantizer_name": "*input_quantizer", "cfg": dict(fp8)},
            *({"quantizer_name": f"*{name}*", "enable": False} for name in IGNORE),
        ],
        "algorithm": "max",
    }


def quantization_config(policy: dict | None, modelopt_version: str = "0.47.0") -> dict[str, Any]:
    """`transformer/config.json`'s `quantization_config`, as the exporter's `build_quant_config_json` (+ policy)."""
    qc: dict[str, Any] = {
        "config_groups": {
            "group_0": {
                "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                "targets": ["Linear"],
            }
        },
        "ignore": list(IGNORE),
        "quant_algo": "FP8",
        "producer": {"name": "modelopt", "version": modelopt_version},
        "quant_method": "modelopt",
        "quant_type": "FP8_FP8",
        "weight_only": False,
        "modules_to_not_convert": list(IGNORE),
        "modelopt_config": _modelopt_config(),
    }
    if policy is not None:
        qc["runtime"] = {"diffusion_step_policy": policy}
    return qc


def _exact_scale(s: torch.Tensor) -> torch.Tensor:
    """s rounded to 20 significant bits: s · 448 (= s · 7 · 2⁶) is then exact in fp32, and so is its / 448."""
    mantissa, exponent = torch.frexp(s.float())
    out = torch.ldexp(torch.round(mantissa * 2.0**20) / 2.0**20, exponent)
    assert torch.equal(out * FP8_MAX / FP8_MAX, out)
    return out


def _read_state(tdir: Path) -> dict[str, torch.Tensor]:
    index = tdir / (WEIGHTS + ".index.json")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [WEIGHTS]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(tdir / name, framework="pt") as f:
            state |= {k: f.get_tensor(k) for k in f.keys()}
    return state


def _calibrate(src: Path, calibration: list[dict[str, Any]], device: str = "cpu") -> dict[str, float]:
    """Max |input| of every layer linear over the calibration requests (diffusers' pipeline, fp32, on `device`)."""
    from diffusers import Cosmos3OmniPipeline

    device_map = device if device.startswith("cuda") else None  # a real-shape source calibrates on the GPU
    pipe = Cosmos3OmniPipeline.from_pretrained(src, dtype=torch.float32, device_map=device_map)
    pipe.set_progress_bar_config(disable=True)
    names = [
        n for n, m in pipe.transformer.named_modules() if n.startswith("layers.") and isinstance(m, torch.nn.Linear)
    ]
    amax = dict.fromkeys(names, 0.0)

    def record(name: str, x: torch.Tensor) -> None:
        amax[name] = max(amax[name], x.detach().abs().max().item())

    # hooks on this pipeline's own modules (removed after): the calibration forward is diffusers' unchanged
    hooks = [
        pipe.transformer.get_submodule(n).register_forward_pre_hook(lambda _m, args, n=n: record(n, args[0]))
        for n in names
    ]
    try:
        for i, request in enumerate(calibration):
            pipe(**request, generator=torch.Generator().manual_seed(i), output_type="latent",
                 enable_safety_check=False)  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    unseen = [n for n in names if not amax[n]]
    if unseen:
        raise ValueError(f"calibration never ran (or saw only zeros in) {unseen[:3]}: no input scale for them")
    return amax


def _write_modelopt_state(tdir: Path, config: dict[str, Any], fp8: dict[str, torch.Tensor]) -> bool:
    """`modelopt_state.pth` (ModelOpt's real-quantized graph state) → False when ModelOpt is not installed."""
    try:
        import modelopt.torch.opt as mto
        import modelopt.torch.quantization as mtq
    except ImportError:
        return False
    from diffusers import Cosmos3OmniTransformer

    transformer = Cosmos3OmniTransformer.from_config({k: v for k, v in config.items() if k != "quantization_config"})
    names = {k.removesuffix(".weight") for k in fp8 if k.endswith(".weight")}
    cfg = copy.deepcopy(_modelopt_config())
    cfg["algorithm"] = None  # the scales are set below, not calibrated
    mtq.quantize(transformer, cfg)
    mtq.disable_quantizer(transformer, lambda q: q.rsplit(".", 1)[0] not in names)
    for name in names:
        module = transformer.get_submodule(name)
        with torch.no_grad():  # compress re-quantizes the dequantized weight: the stored E4M3 values exactly
            module.weight.copy_(fp8[f"{name}.weight"].float() * fp8[f"{name}.weight_scale"])
        module.weight_quantizer.amax = fp8[f"{name}.weight_quantizer._amax"].clone()
        module.input_quantizer.amax = fp8[f"{name}.input_quantizer._amax"].clone()
    mtq.compress(transformer)
    torch.save(mto.modelopt_state(transformer), tdir / "modelopt_state.pth")
    return True


def make_fp8(
    src: Path,
    out: Path,
    policy: dict | None = None,
    calibration: list[dict[str, Any]] | None = None,
    device: str = "cpu",
) -> Path:
    """Write the FP8 checkpoint of `src` to `out` (replaced if it exists) → `out`. `policy`: the
    `diffusion_step_policy` to stamp (`policy_json(...)`), None for none. `device`: where the calibration runs."""
    src, out = Path(src), Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("transformer"))
    tdir = out / "transformer"
    tdir.mkdir()
    amax = _calibrate(src, calibration or CALIBRATION, device)
    state = _read_state(src / "transformer")
    fp8: dict[str, torch.Tensor] = {}
    for name in sorted(amax):
        w8, scale = quantize(state[f"{name}.weight"], rowwise=False)
        ws = _exact_scale(scale)
        if not torch.equal(ws, scale):  # re-quantize with the rounded scale (the largest |w| may clamp to 448)
            w8 = (state[f"{name}.weight"].float() / ws).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
        xs = _exact_scale(torch.tensor(amax[name] / FP8_MAX, dtype=torch.float32))
        fp8 |= {
            f"{name}.weight": w8,
            f"{name}.weight_scale": ws,
            f"{name}.input_scale": xs,
            f"{name}.weight_quantizer._amax": ws * FP8_MAX,
            f"{name}.weight_quantizer._scale": ws.clone(),
            f"{name}.input_quantizer._amax": xs * FP8_MAX,
        }
    save_file({**state, **fp8}, tdir / WEIGHTS)
    config = json.loads((src / "transformer" / "config.json").read_text())
    config["quantization_config"] = quantization_config(policy)
    (tdir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not _write_modelopt_state(tdir, config, fp8):
        print(f"{tdir}: no modelopt_state.pth (nvidia-modelopt not installed): our server loads it, diffusers not")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--src", type=Path, required=True, help="16-bit checkpoint dir (diffusers layout)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--first-steps", type=int, default=3)
    ap.add_argument("--last-steps", type=int, default=3)
    ap.add_argument("--overlap", choices=MODES, default="a16")
    ap.add_argument("--reasoner", choices=MODES, default="a16")
    ap.add_argument("--no-policy", action="store_true", help="no diffusion_step_policy: W8A8 every step")
    args = ap.parse_args(argv)
    policy = None if args.no_policy else policy_json(args.first_steps, args.last_steps, args.overlap, args.reasoner)
    print(make_fp8(args.src, args.out, policy))


if __name__ == "__main__":
    main()
