"""Find a checkpoint's components (diffusers layout) and load them, checking every key and shape.

Layout read: `model_index.json`, `transformer/config.json` + `diffusion_pytorch_model.safetensors` (or the
sharded `diffusion_pytorch_model.safetensors.index.json`), `vae/` (AutoencoderKLWan), `scheduler/`
(UniPCMultistepScheduler config), `text_tokenizer/` (transformers AutoTokenizer). Every problem is a
`CheckpointError` raised at load time naming the file and the key.

Weights are placed with `assign=True` onto a model built on the meta device, so nothing is allocated twice;
a stage loads only the towers it runs (`parts`). The timestep embedder stays fp32, as in the reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .config import CheckpointError, ModelConfig, read_json
from .layers import Cosmos3Transformer

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
FP32_PREFIXES = ("time_embedder.",)


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    config: ModelConfig
    scheduler_config: dict[str, Any]
    use_native_flow_schedule: bool
    default_use_system_prompt: bool
    random_weights: bool = False  # a real-shape skeleton for speed runs (tools/random_checkpoint.py)

    @classmethod
    def open(cls, root: str | Path) -> Checkpoint:
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
        return cls(
            root=root,
            config=cfg,
            scheduler_config=sched,
            use_native_flow_schedule=bool(index.get("use_native_flow_schedule", False)),
            default_use_system_prompt=bool(index.get("default_use_system_prompt", True)),
            random_weights=bool(index.get("random_weights", False)),
        )

    def weight_files(self) -> dict[str, Path]:
        """Map every stored key to the safetensors file holding it."""
        tdir = self.root / "transformer"
        if (tdir / INDEX).is_file():
            weight_map = read_json(tdir / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{tdir / INDEX}: missing key 'weight_map'")
            return {k: tdir / f for k, f in weight_map.items()}
        if not (tdir / WEIGHTS).is_file():
            raise CheckpointError(f"{tdir / WEIGHTS}: file not found (nor {INDEX})")
        with safe_open(tdir / WEIGHTS, framework="pt") as f:
            return {k: tdir / WEIGHTS for k in f.keys()}

    def load_transformer(
        self, parts: set[str] | frozenset[str], device: str | torch.device, dtype: torch.dtype
    ) -> Cosmos3Transformer:
        if self.random_weights:
            return self._random_transformer(parts, device, dtype)
        with torch.device("meta"):
            model = Cosmos3Transformer(self.config, frozenset(parts))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        files = self.weight_files()
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
                    if key not in stored:
                        raise CheckpointError(f"{path}: missing key {key!r}")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != expected[key]:
                        raise CheckpointError(
                            f"{path}: key {key!r} has shape {list(shape)}, expected {list(expected[key])}"
                        )
                    want = torch.float32 if key.startswith(FP32_PREFIXES) else dtype
                    state[key] = f.get_tensor(key).to(device=device, dtype=want)
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    def _random_transformer(
        self, parts: set[str] | frozenset[str], device: str | torch.device, dtype: torch.dtype
    ) -> Cosmos3Transformer:
        torch.manual_seed(0)
        with torch.device(device):
            model = Cosmos3Transformer(self.config, frozenset(parts))
        for p in model.parameters():
            if p.ndim > 1:  # scaled so activations stay O(1) through the stack
                torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        model.to(dtype)
        if hasattr(model, "time_embedder"):
            model.time_embedder.float()  # fp32, as loaded checkpoints keep it
        return model.eval().requires_grad_(False)

    def load_vae(self, device: str | torch.device, dtype: torch.dtype):  # -> AutoencoderKLWan
        from diffusers import AutoencoderKLWan

        if self.random_weights:
            torch.manual_seed(0)
            return (
                AutoencoderKLWan.from_config(read_json(self.root / "vae" / "config.json"))
                .to(device, dtype)
                .eval()
                .requires_grad_(False)
            )

        try:
            vae = AutoencoderKLWan.from_pretrained(self.root / "vae", torch_dtype=dtype)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{self.root / 'vae'}: cannot load AutoencoderKLWan ({e})") from e
        return vae.to(device).eval().requires_grad_(False)

    def load_tokenizer(self):  # -> transformers.PreTrainedTokenizerBase
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.root / "text_tokenizer")
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.root / 'text_tokenizer'}: cannot load tokenizer ({e})") from e
