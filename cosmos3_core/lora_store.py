"""Adapters by name: the subfolders of a deployment's `lora_dir`, read and checked on first use, resident in the
slots of an `AdapterPool` (model/lora.py) — least recently used first out, never one a live request holds.

Format: what `transformer.save_lora_adapter` writes — one `.safetensors` file (`pytorch_lora_weights.safetensors`,
or the folder's only one) holding `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r] per adapted
linear (keys may carry the pipeline's `transformer.` prefix) and, in its metadata under `lora_adapter_metadata`, the
PEFT `LoraConfig` (r, lora_alpha, rank_pattern, alpha_pattern, use_rslora). Without that metadata every module's
scale is 1 (alpha = r), as diffusers infers it. Pickled weights (.bin, .pt, ...) are refused, never opened.

Errors are `RequestError`s: `lora.name` for a name that is no subfolder (a path, `..`, unknown), `lora` for an
adapter that cannot serve this checkpoint (keys, shapes, rank over `max_lora_rank`, DoRA, biases, non-finite
weights, or weights that overflow the pool's dtype once scaled by lora_alpha / r) — that request fails, and nothing
of the adapter is kept: each stage checks the values of every tower's modules, though it holds only its own. A
subfolder added while serving is found on its first use; a changed weights file (mtime, size) is read again once no
live request holds the old one.

Threads: `check` runs on a request thread (it reads and checks the file once per version of it); `acquire`
and `release` on the thread that runs the model (the engine's, prefill's), which alone writes the pool.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .model.checkpoint import Checkpoint
from .model.config import ModelConfig
from .model.lora import Adapter, AdapterPool, adaptable_shapes
from .requests import RequestError

NAME = re.compile(r"[A-Za-z0-9_.-]+")
WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
PICKLED = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
SUPPORTED_CONFIG = {"use_dora": False, "lora_bias": False}  # LoraConfig fields whose other values we cannot serve


@dataclass(frozen=True)
class LoraSettings:
    """A deployment's adapters: `lora_dir`, `max_loras` resident at once, `max_lora_rank`."""

    dir: str
    max_loras: int
    max_lora_rank: int


@dataclass(frozen=True)
class LoraRef:
    """A checked adapter, as `check` found it: its file's identity and, unless it was resident, its weights."""

    name: str
    key: tuple  # (path, mtime_ns, size) of the weights file
    towers: frozenset[str]  # the towers it adapts ("und", "gen"): a model without them runs it as the base
    adapter: Adapter | None


def adapter_dir(lora_dir: str | Path, name: object) -> Path:
    """The subfolder `name` of `lora_dir`; anything else is an error naming `lora.name`."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name in (".", ".."):
        raise RequestError("lora.name", f"must match [A-Za-z0-9_.-]+ (a subfolder of lora_dir), got {name!r:.100}")
    path = Path(lora_dir) / name
    if not path.is_dir():
        raise RequestError("lora.name", f"no adapter {name!r} in this deployment's lora_dir")
    return path


def weights_file(folder: Path) -> Path:
    if (folder / WEIGHTS).is_file():
        return folder / WEIGHTS
    found = sorted(folder.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    if found:
        raise RequestError("lora", f"{folder.name}: {len(found)} .safetensors files and none named {WEIGHTS}")
    if any(p.suffix in PICKLED for p in folder.iterdir()):
        raise RequestError("lora", f"{folder.name}: pickled weights are refused; save the adapter as safetensors")
    raise RequestError("lora", f"{folder.name}: no .safetensors weights file")


def _pattern(patterns: dict, module: str, default: float) -> float:
    """PEFT's `get_pattern_key`: the first pattern that matches the end of the module name (a `^` anchors it)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _finite(t: torch.Tensor) -> bool:
    """Every element finite. A finite sum says so in one pass without a mask (~6x faster than `isfinite` over a
    whole tensor: an Edge adapter's first use); a non-finite sum (a NaN/inf, or an overflow) gets the exact check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _pool_weights(
    name: str, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B · scaling) as a slot holds them, in `dtype`; RequestError unless every value is finite there. The
    pool's dense delta multiplies every slot's Bᵀ by zeros for rows of other slots (model/lora.py): one inf in a
    resident B would make every row of every pack NaN."""
    a_pool = a.to(dtype)
    b_pool = (b if scaling == 1.0 else b.float() * scaling).to(dtype)
    if _finite(a_pool) and _finite(b_pool):
        return a_pool.contiguous(), b_pool.contiguous()
    if not (_finite(a) and _finite(b)):
        raise RequestError("lora", f"{name}: {module} weights are not all finite")
    raise RequestError(
        "lora", f"{name}: {module} overflows {str(dtype).removeprefix('torch.')} (max {torch.finfo(dtype).max:.4g}) "
        f"in lora_A or in lora_B times lora_alpha / r = {scaling:.4g}"
    )  # fmt: skip


def read_adapter(
    name: str,
    path: Path,
    shapes: dict[str, tuple[str, int, int]],
    max_rank: int,
    dtype: torch.dtype,
    keep: frozenset[str] | None = None,
) -> Adapter:
    """Read and check the adapter in `path` (a weights file) against a checkpoint's adaptable linears → `Adapter`
    with each module's B scaled by its lora_alpha / r (PEFT's scaling), in `dtype` (the pool's). `keep`: the towers
    whose weights it holds (None: all) — a stage's model holds one tower; every module, of any tower, is checked
    (key, shape, rank, finite in `dtype`) here, so a bad adapter fails before any of it is kept."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise RequestError("lora", f"{name}: cannot read {path.name} as safetensors ({e})") from e
    config: dict = {}
    if METADATA_KEY in meta:
        try:
            config = json.loads(meta[METADATA_KEY])
            assert isinstance(config, dict)
        except (ValueError, AssertionError) as e:
            raise RequestError("lora", f"{name}: metadata {METADATA_KEY} is not a JSON object") from e
    for key, ok in SUPPORTED_CONFIG.items():
        if config.get(key, ok) != ok:
            raise RequestError("lora", f"{name}: {key}={config[key]!r} is not supported (plain LoRA only)")
    if all(k.startswith("transformer.") for k in tensors):  # a pipeline's save_lora_weights
        tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, part = key.rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise RequestError("lora", f"{name}: unsupported key {key!r:.120} (only lora_A/lora_B weights)")
        if module not in shapes:
            raise RequestError(
                "lora", f"{name}: {module!r:.120} is not an adaptable linear of this checkpoint (the attention and MLP "
                "linears of its layers)"
            )  # fmt: skip
        pairs.setdefault(module, {})[part[0]] = value
    if not pairs:
        raise RequestError("lora", f"{name}: no LoRA weights in {path.name}")
    r0, alpha0 = config.get("r"), config.get("lora_alpha")
    modules = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise RequestError("lora", f"{name}: {module} has lora_{''.join(ab)} but not both lora_A and lora_B")
        _, fan_in, fan_out = shapes[module]
        a, b = ab["A"], ab["B"]
        r = a.shape[0] if a.ndim == 2 else -1
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise RequestError(
                "lora", f"{name}: {module} lora_A {list(a.shape)}, lora_B {list(b.shape)}; this checkpoint needs "
                f"[r, {fan_in}] and [{fan_out}, r]"
            )  # fmt: skip
        if r > max_rank:
            raise RequestError(
                "lora", f"{name}: {module} has rank {r}, over this deployment's max_lora_rank {max_rank}"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise RequestError("lora", f"{name}: {module} weights must be floating point, got {a.dtype}, {b.dtype}")
        if config:  # PEFT builds the layer from the config: its rank must be the weights'
            want = _pattern(config.get("rank_pattern") or {}, module, r0)
            if want != r:
                raise RequestError("lora", f"{name}: {module} has rank {r} but its config says r={want}")
            alpha = _pattern(config.get("alpha_pattern") or {}, module, alpha0 if alpha0 is not None else r)
            scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        else:
            scaling = 1.0
        if not math.isfinite(scaling):
            raise RequestError("lora", f"{name}: {module}'s lora_alpha / r is not finite")
        weights = _pool_weights(name, module, a, b, scaling, dtype)
        if keep is None or shapes[module][0] in keep:
            modules[module] = weights
    return Adapter(name, modules, frozenset(shapes[m][0] for m in pairs))


class LoraStore:
    """Adapters by name for one model's towers: `check` on any thread, `acquire` / `release` on the model's."""

    def __init__(self, settings: LoraSettings, cfg: ModelConfig, pool: AdapterPool):
        self.settings, self.pool = settings, pool
        self.shapes = adaptable_shapes(cfg)
        self._lock = threading.Lock()
        self.resident: OrderedDict[int, tuple[str, tuple]] = OrderedDict()  # slot → (name, key); LRU first
        # (name, key) → its towers, for every adapter version checked good: a later check reads nothing
        self.known: dict[tuple[str, tuple], frozenset[str]] = {}
        self.pins = [0] * pool.slots  # live holders per slot
        self.loads = 0  # adapters written into a slot (first uses and reloads after an eviction)

    def _key(self, name: str) -> tuple:
        path = weights_file(adapter_dir(self.settings.dir, name))
        st = path.stat()
        return (str(path), st.st_mtime_ns, st.st_size)

    def _read(self, name: str, path: str) -> Adapter:
        """The adapter's modules for the pool's towers, in its dtype (every tower's checked)."""
        return read_adapter(
            name, Path(path), self.shapes, self.settings.max_lora_rank, self.pool.dtype, self.pool.towers
        )

    def check(self, name: object) -> LoraRef:
        """The adapter `name`, checked: known good (no read; `acquire` reads it again if it is not resident), or read
        from its folder now. RequestError otherwise."""
        key = self._key(name)  # type: ignore[arg-type]  # checks the name first
        with self._lock:
            towers = self.known.get((name, key))  # type: ignore[arg-type]
        if towers is not None:
            return LoraRef(name, key, towers, None)  # type: ignore[arg-type]
        adapter = self._read(name, key[0])  # type: ignore[arg-type]
        towers = adapter.towers
        with self._lock:
            self.known[(name, key)] = towers  # type: ignore[index]
        return LoraRef(name, key, towers, adapter)  # type: ignore[arg-type]

    def acquire(self, ref: LoraRef) -> int | None:
        """A slot holding `ref`'s adapter, pinned for the caller until `release`; None while every slot is pinned
        by other adapters (the caller waits). Loads it (evicting the least recently used unpinned one) if needed."""
        with self._lock:
            slot = next((s for s, v in self.resident.items() if v == (ref.name, ref.key)), None)
            if slot is None:
                free = [s for s in range(self.pool.slots) if s not in self.resident]
                idle = [s for s in self.resident if not self.pins[s]]  # LRU order
                if not free and not idle:
                    return None
                slot = free[0] if free else idle[0]
                self.resident.pop(slot, None)
                adapter = ref.adapter
                if adapter is None:  # known good but not resident (evicted since, or never loaded here): read it
                    adapter = self._read(ref.name, ref.key[0])
                self.pool.write(slot, adapter)
                self.loads += 1
            self.resident[slot] = (ref.name, ref.key)
            self.resident.move_to_end(slot)
            self.pins[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self.pins[slot] -= 1

    def names(self) -> dict[int, str]:
        """Slot → the adapter resident there."""
        with self._lock:
            return {s: v[0] for s, v in self.resident.items()}


def open_store(settings: LoraSettings | None, ckpt: Checkpoint, model: nn.Module) -> LoraStore | None:
    """The adapter store of a stage's model (None without `lora_dir`), in the model's activation dtype on its
    device (CUDA's delta is plain GEMMs: any dtype). FP8 layer linears take the delta in the activation dtype over
    their output."""
    if settings is None:
        return None
    pool = AdapterPool(model, settings.max_loras, settings.max_lora_rank)
    return LoraStore(settings, ckpt.config, pool)
