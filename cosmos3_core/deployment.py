"""Deployment configuration (`configs/*.yaml`): which checkpoint, where, how big the pool and queue are,
request defaults per task and limits. One file picks a deployment; it renders `model_repository`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from . import memory
from .lora_store import LoraSettings
from .memory import MemoryPlan
from .model.checkpoint import Checkpoint
from .model.fp8 import validate_precision
from .model.provision import resolve_checkpoint
from .parallel.config import ParallelConfig
from .parallel.group import WorkerSpec
from .requests import Defaults, Limits, TaskDefaults
from .safety import NONE, check_spec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INSTANCES = {"prefill": 1, "denoise": 1, "vae_decode": 1}  # the default instance count of each model
# the embedded default of both the server and the offline CLI, so the same flags give the same video from either
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def use_device(device: str | torch.device) -> None:
    """Make the instance's GPU current in the calling thread (current devices are per thread: a new thread starts on
    GPU 0, whose streams its events, graph captures and allocations would otherwise use)."""
    if str(device).startswith("cuda"):
        torch.cuda.set_device(device)


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`--set KEY=YAML` items (the CLI's, the server's and the benchmarks') → top-level config overrides for
    `Deployment.load`, e.g. `precision=fp8`, `checkpoint=random:edge`. ValueError names an item without `=`, or
    with a null value (`Deployment.load` takes None as "not given": such a key is set in the config file)."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=YAML, e.g. precision=fp8")
        overrides[key] = yaml.safe_load(value)
        if overrides[key] is None:
            raise ValueError(f"--set {item!r}: a null value cannot override a key; set it in the config file")
    return overrides


def _section(kind: type, raw: Any, where: str, build: bool = True) -> Any:
    """A config section (a mapping) → `kind(**raw)`; a key `kind` has no field for is an error naming it (not a
    TypeError from the constructor). `build` False: only the check."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a mapping of fields; got {raw!r}")
    unknown = set(raw) - {f.name for f in fields(kind)}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return kind(**raw) if build else None


def _check_lora(raw: dict[str, Any], parallel: ParallelConfig, where: str) -> None:
    """The adapter settings, and what they cannot be served with yet (errors name the setting)."""
    for key, hi in (("max_loras", 64), ("max_lora_rank", 1024)):
        value = raw.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
            raise ValueError(f"{where}: {key}: an integer in [1, {hi}]; got {value!r}")
    lora_dir = raw.get("lora_dir", "")
    if not isinstance(lora_dir, str):
        raise ValueError(f"{where}: lora_dir: a folder path; got {lora_dir!r}")
    if not lora_dir:
        return
    if not Path(lora_dir).is_dir():
        raise ValueError(f"{where}: lora_dir: {lora_dir} is not a folder")
    raw["lora_dir"] = str(Path(lora_dir).resolve())  # the rendered deployment's stages may run elsewhere
    if parallel.denoise_ranks > 1:
        raise ValueError(f"{where}: lora_dir: adapters need a single-GPU denoise (parallel cfg and ulysses must be 1)")


def _check_memory_keys(raw: dict[str, Any], where: str) -> None:
    util = raw.get("gpu_memory_utilization", 0.9)
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise ValueError(f"{where}: gpu_memory_utilization: a share of the card in (0, 1]; got {util!r}")
    if not isinstance(raw.get("expandable_segments", True), bool):
        raise ValueError(f"{where}: expandable_segments: true or false; got {raw['expandable_segments']!r}")
    cap = raw.get("max_capture_rows", 0)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"{where}: max_capture_rows: a row count ≥ 0; got {cap!r}")
    for key, least in (("pool_pages", 1), ("max_step_rows", 64)):
        value = raw.get(key, "auto")
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise ValueError(f"{where}: {key}: an integer ≥ {least}, or auto; got {value!r}")


def _check_session_keys(raw: dict[str, Any], where: str) -> None:
    ttl, most = raw.get("session_ttl_s", 120.0), raw.get("max_sessions", 16)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= 86400:
        raise ValueError(f"{where}: session_ttl_s: seconds in (0, 86400]; got {ttl!r}")
    if isinstance(most, bool) or not isinstance(most, int) or most < 0:
        raise ValueError(f"{where}: max_sessions: a count ≥ 0; got {most!r}")


@dataclass(frozen=True)
class Deployment:
    checkpoint: str = ""  # empty: the tiny checkpoint (model/provision.py); rendered deployments hold the path
    device: str = "auto"  # auto: cuda if available else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    # checkpoint: serve the weights as stored (an FP8 checkpoint in FP8, with its step policy); fp8: also quantize a
    # 16-bit checkpoint's layer linears at load (E4M3, per output channel; activations per token), see model/fp8.py
    precision: str = "checkpoint"
    # FP8 step policy overrides, the checkpoint schema's fields: first_steps, last_steps (W8A16 windows, in steps),
    # overlap, reasoner (a16 | native); unset fields keep the checkpoint's policy, else the official 3 + 3
    fp8_policy: dict[str, Any] = field(default_factory=dict)
    # K/V pool pages; auto: what the card leaves after the memory plan's other entries (memory.py), up to max_queue
    # requests' text and an AR stream's context
    pool_pages: int | str = 256
    page_size: int = 16
    # the share of the card the server's processes may use together (vLLM's name): the memory plan must fit it, or
    # the server refuses to load, saying what to change (memory.py, `make plan`)
    gpu_memory_utilization: float = 0.9
    # CUDA only: torch's allocator maps memory in growable segments, so blocks freed by steps of other sizes are
    # reused instead of held apart (the step's reserved memory stays near its live peak; memory.py)
    expandable_segments: bool = True
    # packed rows a denoise step may hold (requests wait for room); auto: the largest request the limits admit
    max_step_rows: int | str = "auto"
    max_queue: int = 16
    decode_chunk_frames: int = 4  # latent frames per streamed piece (decode + transfer overlap); 0: whole windows
    # torch.compile the GEN layer stack and (on CUDA) the VAE decoder's fused kernels; dynamic shapes
    compile: bool = False
    attention: str = "auto"  # sdpa | flashinfer | auto (flashinfer on CUDA when installed, else sdpa)
    # the GEN attention in FP8 (E4M3 q and [prefix | own] K/V, per-head dynamic scales), every step and row
    # whatever the precision. CUDA: FlashInfer's FA3 FP8 kernel (Hopper; else the
    # load fails); attention sdpa (or the CPU): the same quantization simulated (fake quant), the reference.
    # A single-GPU denoise only. See attention.py
    fp8_attention: bool = False
    cuda_graphs: bool = True  # CUDA only: capture each step layout's forward on its second use, then replay
    # with cuda_graphs and FlashInfer: packed-row buckets (ascending multiples of 64, e.g. [4096, 8192, 16384, 32768]):
    # a step runs in the layout of the smallest bucket its rows fit (padding rows cost their compute), so a new mix
    # of request sizes replays an existing capture; the warmup captures every bucket (step.py). Not given: derived
    # from warmup_requests (each shape alone, with 1..its CFG branches running; logged at load). [] or a pack larger
    # than the largest: a layout per exact size mix. A single-GPU denoise only (parallel groups keep exact layouts)
    graph_buckets: list[int] | None = None
    # CUDA graphs held at once (each keeps its activations' memory): a layout that captures beyond releases the least
    # recently used one's graph (it runs eager, then captures again, when used next); the warmup captures the buckets
    # first. 0: no captures
    max_captures: int = 16
    # layouts of more packed rows always run eagerly: their launches are a negligible share of the step, and a graph
    # would hold a second copy of the step's activations (memory.py). 0: no bound
    max_capture_rows: int = 65536
    warmup_requests: list[dict[str, Any]] = field(default_factory=list)  # request parameters run at startup
    drain_timeout_s: float = 20.0  # on shutdown, live requests get this long to finish before they are ended
    state_dir: str = ""  # the facts its processes share (triton/state.py; set by serve.render)
    # per model, on the server's one GPU (CUDA_VISIBLE_DEVICES picks it: run one server per GPU). vae_decode is 1:
    # the chunks of a stream must reach the instance that holds their decoder cache
    instances: dict[str, int] = field(default_factory=lambda: dict(INSTANCES))
    defaults: Defaults = field(default_factory=Defaults)
    limits: Limits = field(default_factory=Limits)
    # several GPUs per request (cosmos3_core/parallel): {cfg: 1|2, ulysses: 1|2|4|8, vae: N}; rank r on cuda:r
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # LoRA adapters chosen per request (`parameters.lora`, docs/lora.md): each subfolder of lora_dir is one, as
    # transformer.save_lora_adapter writes it; max_loras resident at once (least recently used out, never one a live
    # request uses), each of rank ≤ max_lora_rank. "": none. FP8: the delta in the activation dtype over the FP8 base.
    # Not with a parallel denoise (refused)
    lora_dir: str = ""
    max_loras: int = 4
    max_lora_rank: int = 64

    @property
    def lora(self) -> LoraSettings | None:
        return LoraSettings(self.lora_dir, self.max_loras, self.max_lora_rank) if self.lora_dir else None

    # the guardrail (safety.py): cosmos (NVIDIA's, as diffusers runs it: prompt, then every piece of frames), none, or
    # module:callable (a factory returning a checker). Not given: none; the configs of real checkpoints say cosmos
    safety_checker: str = "none"
    safety_checker_optional: bool = False  # a request may send parameters.enable_safety_check false
    # AR sessions (`parameters.session`, docs/requests.md#sessions): an idle kept session ends this long after it was
    # kept; at most max_sessions live at once (the least recently kept idle one is evicted first; 0: none kept)
    session_ttl_s: float = 120.0
    max_sessions: int = 16

    @property
    def torch_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.startswith("cuda") else torch.float32
        return DTYPES[self.dtype]

    def planned(
        self, ckpt: Checkpoint, card: int | None = None, peak_warmup: bool = True
    ) -> tuple[Deployment, MemoryPlan]:
        """This deployment with `pool_pages` and `max_step_rows` resolved by its memory plan on this machine's card
        (`card` bytes: another's), and the plan. On CUDA, `PlanError` when the plan does not fit the card, and the
        largest admitted request joins `warmup_requests`: each part reaches its peak at load, not at a request.
        `peak_warmup` False (a part reloaded after its first load proved that peak: `ServerState.proven_peak`)
        leaves it out."""
        if self.torch_device.startswith("cuda"):
            memory.use_allocator(self.expandable_segments)
        card = memory.card_bytes(self.torch_device) if card is None else card
        p = memory.plan(self, ckpt.root, ckpt.config, card)
        memory.check(p)
        warmup, largest = self.warmup_requests, p.largest.warmup_request(self.limits)
        fits = p.largest.rows <= p.max_step_rows  # else the scheduler refuses it: max_step_rows bounds the peak
        if self.torch_device.startswith("cuda") and peak_warmup and fits and largest not in warmup:  # added once
            warmup = [*warmup, largest]
        return replace(self, pool_pages=p.pool_pages, max_step_rows=p.max_step_rows, warmup_requests=warmup), p

    def open_checkpoint(self) -> Checkpoint:
        """The deployment's checkpoint (generated on first use when it is the tiny or a `random:` one), with its
        precision."""
        return Checkpoint.open(resolve_checkpoint(self.checkpoint), self.precision, self.fp8_policy)

    @classmethod
    def load(cls, path: str | Path | None, **overrides: Any) -> Deployment:
        raw: dict[str, Any] = yaml.safe_load(Path(path).read_text()) if path else {}
        raw = {**(raw or {}), **{k: v for k, v in overrides.items() if v is not None}}
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        d = raw.pop("defaults", {}) or {}
        tasks = {t: _section(TaskDefaults, d.pop(t), f"{path}: defaults.{t}") for t in ("t2i", "t2v", "i2v") if t in d}
        _section(Defaults, d, f"{path}: defaults", build=False)
        if raw.get("dtype", "auto") not in (*DTYPES, "auto"):
            raise ValueError(f"{path}: dtype must be one of {', '.join(DTYPES)}, auto")
        raw["fp8_policy"] = raw.get("fp8_policy") or {}
        validate_precision(raw.get("precision", "checkpoint"), raw["fp8_policy"], str(path))
        if not isinstance(raw.get("fp8_attention", False), bool):
            raise ValueError(f"{path}: fp8_attention: true or false; got {raw['fp8_attention']!r}")
        buckets = raw.get("graph_buckets")
        cap = raw.get("max_capture_rows", 65536)
        if buckets and isinstance(buckets, list) and isinstance(cap, int) and cap and max(map(int, buckets)) > cap:
            raise ValueError(f"{path}: graph_buckets: {max(buckets)} rows is over max_capture_rows ({cap}): such a "
                             "bucket is never captured, only padded; raise max_capture_rows or drop the bucket")  # fmt: skip
        if buckets is not None and (
            not isinstance(buckets, list)
            or any(not isinstance(b, int) or b <= 0 or b % 64 for b in buckets)
            or buckets != sorted(set(buckets))
        ):
            raise ValueError(f"{path}: graph_buckets: ascending positive multiples of 64 rows; got {buckets}")
        if not isinstance(raw.get("max_captures", 0), int) or raw.get("max_captures", 0) < 0:
            raise ValueError(f"{path}: max_captures: a count ≥ 0; got {raw['max_captures']}")
        _check_memory_keys(raw, str(path))
        _check_session_keys(raw, str(path))
        raw["safety_checker"] = check_spec(raw.get("safety_checker", NONE), str(path))
        if not isinstance(raw.get("safety_checker_optional", False), bool):
            raise ValueError(f"{path}: safety_checker_optional: true or false; got {raw['safety_checker_optional']!r}")
        limits = _section(Limits, raw.pop("limits", None) or {}, f"{path}: limits")
        given = raw.pop("instances", None) or {}
        if set(given) - set(INSTANCES) or any(not isinstance(n, int) or n < 1 for n in given.values()):
            raise ValueError(f"{path}: instances: counts ≥ 1 for {', '.join(INSTANCES)}; got {given}")
        if given.get("vae_decode", 1) != 1:
            raise ValueError(f"{path}: instances.vae_decode must be 1: a stream's chunks share one decoder cache")
        try:
            parallel = ParallelConfig.from_dict(raw.pop("parallel", None))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e
        _check_lora(raw, parallel, str(path))
        for single in ("fp8_attention", "graph_buckets"):  # rank steps keep bf16 attention and exact layouts
            if raw.get(single) and parallel.denoise_ranks > 1:
                raise ValueError(f"{path}: {single}: a single-GPU denoise only (parallel cfg and ulysses must be 1)")
        if parallel.ranks > 1 and given.get("denoise", 1) != 1:
            raise ValueError(f"{path}: parallel: one denoise instance drives the group (instances.denoise is 1)")
        return cls(**raw, instances={**INSTANCES, **given}, defaults=Defaults(**d, **tasks), limits=limits,
                   parallel=parallel)  # fmt: skip

    def worker_spec(self, checkpoint: str | Path, roles: tuple[str, ...]) -> WorkerSpec:
        """What the group's workers load for `roles` ("denoise", "decode") from the resolved `checkpoint`."""
        dtype = str(self.torch_dtype).removeprefix("torch.")
        p = self.parallel  # a group of only what its roles use: the Triton denoise and decode instances each have one
        if "decode" not in roles:
            p = replace(p, vae=1)
        if "denoise" not in roles:
            p = replace(p, cfg=1, ulysses=1)
        return WorkerSpec(str(checkpoint), self.torch_device, dtype, p, roles, self.pool_pages,
                          self.page_size, self.attention, self.compile, self.cuda_graphs,
                          max_captures=self.max_captures, precision=self.precision,
                          fp8_policy=dict(self.fp8_policy),
                          env={"PYTORCH_CUDA_ALLOC_CONF": memory.allocator_settings(self.expandable_segments)})  # fmt: skip
