"""Find a checkpoint's components (diffusers layout) and load them, checking every key and shape.

Layout read: `model_index.json`, `transformer/config.json` + `diffusion_pytorch_model.safetensors` (or the
sharded `diffusion_pytorch_model.safetensors.index.json`), `vae/` (AutoencoderKLWan), `scheduler/`
(UniPCMultistepScheduler config), `text_tokenizer/` (transformers AutoTokenizer). Every problem is a
`CheckpointError` raised at load time naming the file and the key.

Weights are placed with `assign=True` onto a model built on the meta device, so nothing is allocated twice;
a stage loads only the towers it runs (`parts`). The timestep embedder stays fp32, as in the reference.

FP8 (model/fp8.py): a transformer whose `config.json` has a ModelOpt FP8 `quantization_config` stores its layer
linears as E4M3 `weight` + tensorwise `weight_scale` + static `input_scale` (or ModelOpt's own
`weight_quantizer._scale` / `input_quantizer._amax`, read when the plain keys are absent); those load as
`Fp8Linear`, the rest as usual, and its `runtime.diffusion_step_policy` is parsed (fail closed). `precision: fp8`
quantizes a 16-bit checkpoint's layer linears at load. `Checkpoint.fp8` is the plan both stages serve.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..from_diffusers import from_diffusers
from .config import WEIGHTS, CheckpointError, ModelConfig, read_json
from .fp8 import (
    E4M3,
    FP8_MAX,
    Fp8Linear,
    Fp8Plan,
    PolicyError,
    StepPolicy,
    layer_linear_names,
    quantize_layer_linears_,
    resolve_policy,
)
from .fp8 import (
    quantize as quantize_weight,
)
from .layers import Cosmos3Transformer

INDEX = WEIGHTS + ".index.json"
FP32_PREFIXES = ("time_embedder.",)
# an FP8 linear's scale keys → (the key ModelOpt's own quantizer stores the same value under, factor to it)
FP8_SCALE_ALIASES = {
    "weight_scale": ("weight_quantizer._scale", 1.0),
    "input_scale": ("input_quantizer._amax", FP8_MAX),
}


def read_quantization(transformer_config: Path) -> tuple[bool, StepPolicy | None]:
    """`quantization_config` of `transformer/config.json` → (FP8 checkpoint?, its step policy or None). Only
    ModelOpt FP8 is served; anything else, and a malformed policy, is a `CheckpointError` naming the field."""
    qc = read_json(transformer_config).get("quantization_config")
    if qc is None:
        return False, None
    where = f"{transformer_config}: quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: must be a mapping")
    method = str(qc.get("quant_method", "")).strip().lower()
    algo = str(qc.get("quant_algo") or qc.get("quant_type") or "").upper()
    if method != "modelopt" or "FP8" not in algo:
        raise CheckpointError(
            f"{where}: served is quant_method 'modelopt' with quant_algo FP8; got {method!r} / {algo!r}"
        )
    runtime = qc.get("runtime")
    if runtime is None or (isinstance(runtime, dict) and runtime.get("diffusion_step_policy") is None):
        return True, None  # no policy: W8A8 throughout, as distilled FP8 checkpoints run
    if not isinstance(runtime, dict):
        raise CheckpointError(f"{where}.runtime: must be a mapping or null")
    try:
        return True, StepPolicy.parse(
            runtime["diffusion_step_policy"], "quantization_config.runtime.diffusion_step_policy"
        )
    except PolicyError as e:
        raise CheckpointError(f"{transformer_config}: {e}") from e


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    config: ModelConfig
    scheduler_config: dict[str, Any]
    use_native_flow_schedule: bool
    default_use_system_prompt: bool
    random_weights: bool = False  # a real-shape skeleton for speed runs (model/random_checkpoint.py)
    fp8_weights: bool = False  # the layer linears are stored in E4M3 (a ModelOpt FP8 quantization_config)
    fp8: Fp8Plan | None = None  # how the transformer is served in FP8; None: as stored, 16-bit

    @classmethod
    def open(
        cls, root: str | Path, precision: str = "checkpoint", fp8_policy: dict[str, Any] | None = None
    ) -> Checkpoint:
        """`precision` (`checkpoint` | `fp8`) and `fp8_policy` (overrides of the step policy's fields) are a
        deployment's (deployment.py); an FP8 checkpoint is served in FP8 whatever `precision` says."""
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError(f"{root}: checkpoint directory not found")
        index = read_json(root / "model_index.json")
        for component in ("transformer", "vae", "scheduler", "text_tokenizer"):
            if component not in index:
                raise CheckpointError(f"{root / 'model_index.json'}: missing component {component!r}")
            if not (root / component).is_dir():
                raise CheckpointError(f"{root / component}: component directory not found")
        cfg = ModelConfig.from_files(root / "transformer" / "config.json", root / "vae" / "config.json")
        sched = read_json(root / "scheduler" / "scheduler_config.json")
        fp8_weights, policy = read_quantization(root / "transformer" / "config.json")
        plan = None
        if fp8_weights or precision == "fp8":
            plan = Fp8Plan(resolve_policy(policy, fp8_weights, fp8_policy or {}), quantize_at_load=precision == "fp8")
        elif fp8_policy:
            raise PolicyError(
                f"fp8_policy: set, but {root} has 16-bit weights and precision is {precision!r} (not fp8)"
            )
        return cls(
            root=root,
            config=cfg,
            scheduler_config=sched,
            use_native_flow_schedule=bool(index.get("use_native_flow_schedule", False)),
            default_use_system_prompt=bool(index.get("default_use_system_prompt", True)),
            random_weights=bool(index.get("random_weights", False)),
            fp8_weights=fp8_weights,
            fp8=plan,
        )

    def weight_files(self) -> dict[str, Path]:
        """Map every stored key to the safetensors file holding it."""
        return weight_files(self.root)

    def load_transformer(
        self, parts: set[str] | frozenset[str], device: str | torch.device, dtype: torch.dtype
    ) -> Cosmos3Transformer:
        """The towers in `parts`, activations in `dtype`; layer linears `Fp8Linear` when served in FP8. A 16-bit
        checkpoint served in FP8 is quantized while it loads, a weight at a time: no 16-bit tower is ever resident
        (the freed 16-bit weights would stay cached in pieces nothing reuses)."""
        quantize = self.fp8 is not None and self.fp8.quantize_at_load
        if self.random_weights:
            model = self._random_transformer(parts, device, dtype, quantize)
        else:
            model = self._load_weights(parts, device, dtype, quantize)
        if quantize:
            quantize_layer_linears_(model)  # any 16-bit layer linear left (none: the loaders quantized them)
        return model

    def _fp8_linears(self, model: Cosmos3Transformer, files: dict[str, Path], dtype: torch.dtype) -> set[str]:
        """Swap, in the meta model, each layer linear stored in E4M3 for an `Fp8Linear` → their names."""
        stored = stored_fp8_linears(files)
        fp8 = {n for n in layer_linear_names(model) if n in stored}
        _swap_to_fp8(model, fp8, dtype, rowwise=False)  # tensorwise scales, as ModelOpt stores them
        return fp8

    def _load_weights(
        self, parts: set[str] | frozenset[str], device: str | torch.device, dtype: torch.dtype, quantize: bool
    ) -> Cosmos3Transformer:
        with torch.device("meta"):
            model = Cosmos3Transformer(self.config, frozenset(parts))
        files = self.weight_files()
        fp8 = self._fp8_linears(model, files, dtype) if self.fp8_weights else set()
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        # 16-bit layer linears served in FP8: each weight is quantized as it arrives (its scale is not stored)
        to_quantize = {n + ".weight" for n in layer_linear_names(model) if n not in fp8} if quantize else set()
        scales: dict[str, torch.Tensor] = {}
        # the stored key holding each expected one, and the factor it is divided by (FP8 scales may come from
        # ModelOpt's quantizer buffers instead)
        source: dict[str, tuple[str, float]] = {k: (k, 1.0) for k in expected}
        for name in fp8:
            for attr, (alias, factor) in FP8_SCALE_ALIASES.items():
                key = f"{name}.{attr}"
                if key not in files and f"{name}.{alias}" in files:
                    source[key] = (f"{name}.{alias}", factor)
                    files[key] = files[f"{name}.{alias}"]
        by_file: dict[Path, list[str]] = {}
        for key in expected:
            if key not in files:
                where = files[next(iter(files))] if files else self.root / "transformer" / WEIGHTS
                raise CheckpointError(f"{where}: missing key {key!r}")
            by_file.setdefault(files[key], []).append(key)
        state: dict[str, torch.Tensor] = {}
        for path, keys in by_file.items():
            if not path.is_file():
                raise CheckpointError(f"{path}: file not found (named by the index for {keys[0]!r})")
            with safe_open(path, framework="pt", device="cpu") as f:
                stored = set(f.keys())
                for key in keys:
                    src, factor = source[key]
                    if src not in stored:
                        raise CheckpointError(f"{path}: missing key {src!r}")
                    shape = tuple(f.get_slice(src).get_shape())
                    module, _, attr = key.rpartition(".")
                    if module in fp8 and attr in FP8_SCALE_ALIASES:  # one tensorwise scale, stored [] or [1]
                        if math.prod(shape) != 1:
                            raise CheckpointError(
                                f"{path}: key {src!r} has shape {list(shape)}; one tensorwise scale expected"
                            )
                        state[key] = (f.get_tensor(src).to(device=device, dtype=torch.float32) / factor).reshape(())
                        continue
                    if shape != expected[key]:
                        raise CheckpointError(
                            f"{path}: key {src!r} has shape {list(shape)}, expected {list(expected[key])}"
                        )
                    want = torch.float32 if key.startswith(FP32_PREFIXES) else dtype
                    if module in fp8 and attr == "weight":
                        want = E4M3
                    elif f.get_slice(src).get_dtype().startswith("F8"):  # would be cast without its scale
                        raise CheckpointError(
                            f"{path}: key {src!r} is stored in FP8, but only the layer linears of a checkpoint "
                            "with a ModelOpt FP8 quantization_config may be"
                        )
                    state[key] = f.get_tensor(src).to(device=device, dtype=want)
                    if key in to_quantize:
                        state[key], scales[key] = quantize_weight(state[key], rowwise=True)
        if to_quantize:
            _swap_to_fp8(model, {k.removesuffix(".weight") for k in to_quantize}, dtype, rowwise=True)
            state |= {k.removesuffix("weight") + "weight_scale": v for k, v in scales.items()}
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    def _random_transformer(
        self, parts: set[str] | frozenset[str], device: str | torch.device, dtype: torch.dtype, quantize: bool
    ) -> Cosmos3Transformer:
        """Weights drawn in `dtype` on `device`, a module at a time (a layer's linears quantized before the next is
        drawn when served in FP8): what a real checkpoint of this shape costs, nothing more."""
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Cosmos3Transformer(self.config, frozenset(parts))
        for name, module in model.named_children():
            modules = list(module.children()) if isinstance(module, torch.nn.ModuleList) else [module]
            for m in modules:
                m.to(torch.float32 if name == "time_embedder" else dtype)  # on meta: no copy
                m.to_empty(device=device)
                for sub in m.modules():
                    for pname, p in sub.named_parameters(recurse=False):
                        if p.ndim > 1:  # scaled so activations stay O(1) through the stack
                            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
                        elif pname == "weight" and type(sub).__name__ == "RMSNorm":
                            torch.nn.init.ones_(p)
                        else:
                            torch.nn.init.zeros_(p)
                if quantize and name == "layers":  # before the next layer is drawn
                    for lname, lin in [(n, x) for n, x in m.named_modules() if isinstance(x, torch.nn.Linear)]:
                        parent, _, child = lname.rpartition(".")
                        setattr(m.get_submodule(parent), child, Fp8Linear.from_linear(lin))
        for pname, p in list(model.named_parameters(recurse=False)):  # the modality embeddings: zeros
            setattr(model, pname, torch.nn.Parameter(torch.zeros(p.shape, dtype=dtype, device=device)))
        if device != "cpu" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return model.eval().requires_grad_(False)

    def load_vae(
        self, device: str | torch.device, dtype: torch.dtype, halves: tuple[str, ...] = ("encoder", "decoder")
    ):  # -> AutoencoderKLWan
        """The VAE with the `halves` a stage runs on `device` ("encoder": with quant_conv; "decoder": with
        post_quant_conv); the other half stays on the meta device, holding no memory."""
        AutoencoderKLWan = from_diffusers("AutoencoderKLWan")

        if self.random_weights:  # drawn on the target device, as the transformer is (on the host: ~10 s for Wan2.2)
            torch.manual_seed(0)
            with torch.device(device):
                vae = AutoencoderKLWan.from_config(read_json(self.root / "vae" / "config.json"))
        else:
            try:
                vae = AutoencoderKLWan.from_pretrained(self.root / "vae", torch_dtype=dtype)
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                raise CheckpointError(f"{self.root / 'vae'}: cannot load AutoencoderKLWan ({e})") from e
        modules = {"encoder": ("encoder", "quant_conv"), "decoder": ("decoder", "post_quant_conv")}
        for half, names in modules.items():
            for name in names:
                getattr(vae, name).to("meta" if half not in halves else device, dtype)
        vae = vae.eval().requires_grad_(False)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the random draw's fp32 copies, the unused half
        return vae

    def load_vae_decoder(
        self, device: str | torch.device, dtype: torch.dtype
    ):  # -> WanDecoderWeights | AutoencoderKLWan
        """The VAE's decoder half for the decode stage: Wan2.2's as our own weight container (`wan_weights`, no
        diffusers import), any other VAE as diffusers' class (`load_vae` with the decoder half only)."""
        from safetensors import SafetensorError

        from .wan_weights import WanDecoderWeights, unsupported

        if unsupported(self.root / "vae", self.random_weights) is not None:
            return self.load_vae(device, dtype, ("decoder",))
        try:
            return WanDecoderWeights.load(self.root / "vae", device, dtype, self.random_weights)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
            raise CheckpointError(f"{self.root / 'vae'}: cannot load the VAE's decoder ({e})") from e

    def load_tokenizer(self):  # -> transformers.PreTrainedTokenizerBase
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.root / "text_tokenizer")
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.root / 'text_tokenizer'}: cannot load tokenizer ({e})") from e


def weight_files(root: Path) -> dict[str, Path]:
    """Map every key the transformer of the checkpoint at `root` stores to the safetensors file holding it."""
    tdir = Path(root) / "transformer"
    if (tdir / INDEX).is_file():
        weight_map = read_json(tdir / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{tdir / INDEX}: missing key 'weight_map'")
        return {k: tdir / f for k, f in weight_map.items()}
    if not (tdir / WEIGHTS).is_file():
        raise CheckpointError(f"{tdir / WEIGHTS}: file not found (nor {INDEX})")
    with safe_open(tdir / WEIGHTS, framework="pt") as f:
        return {k: tdir / WEIGHTS for k in f.keys()}


def stored_fp8_linears(files: dict[str, Path]) -> frozenset[str]:
    """The modules whose `weight` the checkpoint stores in E4M3 (a ModelOpt FP8 checkpoint's layer linears; its
    FP8 revision may keep some 16-bit), read from the safetensors headers of `files` (`weight_files`): no weight is
    loaded."""
    weights = [k for k in files if k.endswith(".weight")]
    fp8: set[str] = set()
    for path in {files[k] for k in weights}:
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found (named by the index for weights)")
        with safe_open(path, framework="pt", device="cpu") as f:
            fp8 |= {
                k.removesuffix(".weight")
                for k in weights
                if files[k] == path and f.get_slice(k).get_dtype() == "F8_E4M3"
            }
    return frozenset(fp8)


def _swap_to_fp8(model: Cosmos3Transformer, names: set[str], dtype: torch.dtype, rowwise: bool) -> None:
    """Replace the meta model's linears `names` by `Fp8Linear` placeholders (their tensors are assigned)."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        lin = getattr(owner, child)
        with torch.device("meta"):
            setattr(owner, child, Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, rowwise, dtype))
