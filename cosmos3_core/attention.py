"""GEN attention over [prefix K/V in the pool | the segment's own tokens], ragged across a packed step.

A packed step is a list of segments (one per request and CFG branch): rows `start:start+length` of q/k/v
belong to the segment and attend, non-causally and with GQA, to the branch's prefix K/V (text, then any
committed AR context frames; order does not matter, nothing is causal) followed by the segment's own K/V.
Rows between segments are zero padding (see `rows.segments_of`); their output is never read.

Two backends with one contract, chosen by the deployment's `attention`:
- `SdpaAttention` — torch SDPA per segment over gathered prefix pages + own K/V. Any device; the reference.
- `FlashInferAttention` — CUDA: one FlashInfer ragged prefill per layer over `[prefix | own]` K/V, gathered per
  segment into one buffer (`gather_layout`: the prefix tokens from the pool's pages, then the own rows), as SDPA
  and diffusers attend: one softmax over every key. (A paged call over the prefix plus a ragged one over the own
  tokens, merged by their log-sum-exp, rounds two partial outputs to bf16 before the merge: 1.6x the max error at
  the Edge step shape, while one ragged call with a 300-token prefix copied ran as fast, on the H200
  in 2026-11; the gather padded to its capacity is not timed yet.) `plan` does all host work once
  per step (every layer shares it) and writes only into buffers the plan owns, so a captured CUDA graph replays
  it with new prefixes; the gather's prefix capacity is a power of two (`prefix_capacity`), part of the layout
  key. With `fp8` the same call runs on FA3's FP8 kernel.
  Its modules (`flashinfer_module_specs`) are JIT-built on first use, unless built ahead for this GPU arch
  (tools/warm.py, no GPU needed) into `caches.flashinfer_aot_dir`, where they are loaded as they are.

A backend makes one `Plan` per step layout (`graphs.StepLayout`); `plan.update(segments)` runs before each
forward outside any graph, `plan(q, k, v, layer)` inside it. A backend is `bucketable` when a captured plan takes
any segments that fit its rows and segment slots (`make_plan(rows, slots)`) — segment boundaries and prefixes are
plan data, not shapes, up to what `shape_key` names (FlashInfer's gather: its prefix capacity) — so a layout may be
keyed on a bucket rather than the exact mix: FlashInfer (a fixed request
count, padded with empty requests); not SDPA, whose per-segment loop (host code) a capture freezes.
Layouts: q `[rows, heads, d]`, k/v `[rows, kv_heads, d]`; output `[rows, heads * d]`.

FP8 attention (`fp8=True`, the deployment's `fp8_attention`): q, and the K/V of `[prefix | own]` (the prefix —
text and AR context — included), are quantized to E4M3 (`quantize_fp8`: dynamic scales per head, q's amax over
the pack's segment rows, K's and V's over every segment's prefix tokens and own rows, / 448, computed on the device
— no host sync, capturable). FlashInfer runs the one ragged call on FA3's FP8 kernel (Hopper only; the scales go in
as per-head `scale_q/k/v`, the output stays in the model dtype: FA3 has no FP8 output). SDPA "fake-quantizes": the
same values quantized with the same scales and dequantized before its SDPA calls — the reference the GPU tests
hold FlashInfer FP8 to (FlashInfer differs by its own rounding: it quantizes the softmax probabilities to E4M3
too). The scales are per head over every segment of the pack (FA3 takes one scale per head per call), so a
request's FP8 rounding depends on its batch mates' amax — results agree within FP8 rounding, not bit for bit,
across batch mixes. Every row and every step (the FP8 linears' W8A16 step policy does not apply: the switch is
separate). FA3's FP8 kernel must pass a load check first (`fp8_kernel_check`: two sequences of random q/k/v held to
the E4M3 rounding's own error): FlashInfer 0.6.1's kernel is wrong on short sequences (measured on the H200: GQA
at the 100–600 keys tried (384 passed: a lucky length, not a bound), one sequence or two, per call as batched; MHA on 128 + 256 with equal head magnitudes; right at 384
keys and on long ones, a long one right beside a short one too), and a pack can hold short segments
(small requests, padding), so fp8_attention on FlashInfer is refused at load with the measured error until a
FlashInfer that passes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .kv_pool import KVPool, PageList
from .model.attend import sdpa
from .model.fp8 import E4M3, FP8_MAX
from .rows import Segment

BACKENDS = ("auto", "sdpa", "flashinfer")


def fp8_amax(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, d], valid [rows] bool → fp32 [heads]: per head, max |x| over the valid rows (exact)."""
    row_amax = x.abs().amax(dim=2).float()  # [rows, heads]: one read of x
    return torch.where(valid[:, None], row_amax, 0.0).amax(dim=0)


def to_fp8(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, heads, d] with per-head amax [heads] → (E4M3 [rows, heads, d], fp32 scale [heads]), x ≈ e4m3 ·
    scale, scale = amax / 448 (an all-zero head: a tiny scale, no division by zero); rows beyond amax (padding)
    clamp to ±448."""
    scale = amax.clamp_min(1e-12) / FP8_MAX
    return (x / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(E4M3), scale  # x / scale in fp32 (type promotion)


def quantize_fp8(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, heads, d], valid [rows] bool (the rows that set the scale; padding does not) → `to_fp8`'s."""
    return to_fp8(x, fp8_amax(x, valid))


def quantize_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """One layer's FP8 attention inputs: q [rows, heads, d] over its valid `rows`, the gathered k/v [keys, kv_heads, d]
    over the valid `keys` → ((q8, scale_q), (k8, scale_k), (v8, scale_v)), each `quantize_fp8`'s. Compiled
    (`compiled=True` below: one graph for every size) it runs as a few fused kernels instead of ~20 eager passes
    (1.43 ms a layer at Edge's 2 × 12,090 rows on the H200, where FA3's FP8 kernel saves 0.6-0.95 ms: 2026-12-03)."""
    return quantize_fp8(q, rows), quantize_fp8(k, keys), quantize_fp8(v, keys)


def fake_quant_fp8(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """`to_fp8` then back to x's dtype: what FP8 attention's kernel sees, in x's dtype (SDPA's FP8 path)."""
    x8, scale = to_fp8(x, amax)
    return (x8.float() * scale[:, None]).to(x.dtype)


# The FP8 kernel's load check: two short sequences of random q/k/v (FlashInfer 0.6.1's FA3 FP8 kernel is wrong on
# the 100-600-key sequences tried, batched or alone (384 passed), and right on 1,500-2,600: H200,
# 2026-12-02), held to RATIO x the error of E4M3 rounding alone (measured: right 1.0x, these 3.8-4.4x)
FP8_CHECK_LENGTHS = (128, 256)
FP8_CHECK_RATIO = 2.0

Fp8Kernel = Callable[..., torch.Tensor]  # (q8, k8, v8, scale_q, scale_k, scale_v, indptr [batch + 1]) → out


class Fp8KernelDefect(ValueError):
    """The FP8 attention kernel fails `fp8_kernel_check` here: fp8_attention is refused (no retry will fix it)."""


def fp8_kernel_check(
    kernel: Fp8Kernel, heads: int, kv_heads: int, head_dim: int, device: str | torch.device
) -> tuple[float, float]:
    """Run `kernel` on FP8_CHECK_LENGTHS sequences of random q/k/v (per-head scales as `quantize_fp8` makes them)
    → (its rel-L2 to exact fp32 attention, the rel-L2 of exact attention over the dequantized inputs: the E4M3
    rounding's own). A correct kernel is within a small factor of the second (it also rounds P to E4M3)."""
    g = torch.Generator(device=device).manual_seed(0)
    rows = sum(FP8_CHECK_LENGTHS)
    q = torch.randn(rows, heads, head_dim, device=device, generator=g)
    k, v = (torch.randn(rows, kv_heads, head_dim, device=device, generator=g) for _ in range(2))
    every = torch.ones(rows, dtype=torch.bool, device=device)
    (q8, sq), (k8, sk), (v8, sv) = (quantize_fp8(x, every) for x in (q, k, v))
    indptr = torch.tensor([0, *torch.tensor(FP8_CHECK_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    out = kernel(q8, k8, v8, sq, sk, sv, indptr).float().reshape(rows, -1)
    deq = [x8.float() * s[:, None] for x8, s in ((q8, sq), (k8, sk), (v8, sv))]
    exact, rounded = torch.empty_like(out), torch.empty_like(out)
    for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist()):
        exact[a:b] = sdpa(q[a:b], k[a:b], v[a:b], False)
        rounded[a:b] = sdpa(*(x[a:b] for x in deq), False)

    def rel(x: torch.Tensor) -> float:
        return ((x - exact).norm() / exact.norm()).item()

    return rel(out), rel(rounded)


def segment_rows(segments: list[Segment], rows: int) -> torch.Tensor:
    """[rows] bool on the host: True on the segments' rows, False on padding."""
    valid = torch.zeros(rows, dtype=torch.bool)
    for s in segments:
        valid[s.start : s.start + s.length] = True
    return valid


class Plan(Protocol):
    def update(self, segments: list[Segment]) -> None: ...
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor: ...


class Backend(Protocol):
    name: str
    pool: KVPool
    bucketable: bool

    def shape_key(self, segments: list[Segment]) -> tuple: ...
    def make_plan(self, rows: int, slots: int = 0) -> Plan: ...


class SdpaAttention:
    name = "sdpa"
    bucketable = False  # its plan loops over the segments in Python: a capture freezes their boundaries

    def __init__(self, pool: KVPool, fp8: bool = False):
        self.pool = pool
        self.fp8 = fp8  # q and [prefix | own] K/V fake-quantized to E4M3 (see the module docstring)

    def shape_key(self, segments: list[Segment]) -> tuple:
        """What besides the segment lengths fixes this backend's tensor shapes: the prefix token counts."""
        return tuple(tuple(p.num_tokens for p in seg.prefix) for seg in segments)

    def make_plan(self, rows: int, slots: int = 0) -> SdpaPlan:
        return SdpaPlan(self.pool, self.fp8)


class SdpaPlan:
    """Gathers each prefix page list through an index buffer the plan owns (a graph replays with new pages).
    Keeps plain numbers, never the segments' `PageList`s: those are emptied when their request ends, and a plan
    may outlive them (a later request on the same pages is not re-planned)."""

    def __init__(self, pool: KVPool, fp8: bool = False):
        self.pool, self.fp8 = pool, fp8
        self.spans: list[tuple[slice, list[int]]] = []  # per segment: its rows, its prefix lists' token counts
        self.page_index: list[list[torch.Tensor]] = []

    def update(self, segments: list[Segment]) -> None:
        shapes = [[p.index.shape for p in seg.prefix] for seg in segments]
        if shapes != [[b.shape for b in bufs] for bufs in self.page_index]:  # a new layout (or an eager new mix)
            self.page_index = [[p.index.clone() for p in seg.prefix] for seg in segments]
        else:
            for bufs, seg in zip(self.page_index, segments):
                for buf, p in zip(bufs, seg.prefix):
                    buf.copy_(p.index)
        self.spans = [(slice(s.start, s.start + s.length), [p.num_tokens for p in s.prefix]) for s in segments]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        pool = self.pool
        out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        prefix_k = [[pool.k_pages[layer, i].flatten(0, 1)[:n] for i, n in zip(index, counts)]
                    for (_, counts), index in zip(self.spans, self.page_index)]  # fmt: skip
        prefix_v = [[pool.v_pages[layer, i].flatten(0, 1)[:n] for i, n in zip(index, counts)]
                    for (_, counts), index in zip(self.spans, self.page_index)]  # fmt: skip
        if self.fp8:  # q's scales over the segments' rows; K's and V's over theirs and every prefix token
            valid = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
            for rows, _ in self.spans:
                valid[rows] = True
            q = fake_quant_fp8(q, fp8_amax(q, valid))
            quantized = []
            for own, prefixes in ((k, prefix_k), (v, prefix_v)):
                flat = torch.cat([p for seg in prefixes for p in seg])
                every = torch.ones(len(flat), dtype=torch.bool, device=flat.device)
                amax = torch.maximum(fp8_amax(own, valid), fp8_amax(flat, every))
                quantized.append((fake_quant_fp8(own, amax), [[fake_quant_fp8(p, amax) for p in seg]
                                                                for seg in prefixes]))  # fmt: skip
            (k, prefix_k), (v, prefix_v) = quantized
        for (rows, _), keys, values in zip(self.spans, prefix_k, prefix_v):
            out[rows] = sdpa(q[rows], torch.cat([*keys, k[rows]]), torch.cat([*values, v[rows]]), causal=False)
        return out


def flashinfer_backend(major: int, head_dim: int) -> str:
    """FlashInfer's prefill backend on a GPU of compute capability `major`.x: fa3 on Hopper at its head sizes."""
    return "fa3" if major == 9 and head_dim in (64, 128, 256) else "fa2"


def flashinfer_module_specs(backend: str, dtype: torch.dtype, head_dim: int, fp8: bool = False) -> list:
    """FlashInfer's JIT specs of the module `FlashInferPlan` loads → `flashinfer.jit.JitSpec`s: the batch prefill
    module with the arguments its ragged wrapper's `plan` derives from ours (q and kv in `dtype` — with `fp8`, fa3
    only, E4M3 —, out in `dtype`, int32 indices, no positional encoding, sliding window, soft cap or fp16 QK
    reduction). tools/warm.py builds it ahead; keep this in step with the plan's `update`."""
    from flashinfer.jit.attention import gen_batch_prefill_module

    qkv = E4M3 if fp8 and backend == "fa3" else dtype  # fa2 has no FP8 kernel: FlashInferAttention refuses it
    return [gen_batch_prefill_module(backend, qkv, qkv, dtype, torch.int32, head_dim, head_dim, 0, False, False,
                                     False)]  # fmt: skip


class FlashInferAttention:
    """FlashInfer batch prefill, fa3 on Hopper: one ragged call over gathered `[prefix | own]` K/V
    (`FlashInferPlan`), on FA3's FP8 kernel with `fp8`. The gather takes any prefix token by token."""

    name = "flashinfer"
    bucketable = True
    WORKSPACE_BYTES = 256 << 20

    def __init__(
        self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, fp8: bool = False, compiled: bool = False
    ):
        import flashinfer  # noqa: F401 - fail at construction, not mid-step

        from .caches import cuda_arch, use_flashinfer_aot

        self.pool = pool
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        device = pool.k_pages.device
        major, minor = torch.cuda.get_device_capability(device)
        self.aot = use_flashinfer_aot(cuda_arch(major, minor))  # modules built ahead (tools/warm.py): no JIT
        self.backend = flashinfer_backend(major, head_dim)
        self.fp8 = fp8  # the gathered attention on FA3's FP8 kernel (see the module docstring)
        # `compiled` (the deployment's `compile`): the FP8 quantization fused by torch.compile. On CUDA Inductor divides
        # by 448 as a multiply by its fp32 reciprocal, and x / scale approximately: scales within one fp32 unit of the
        # eager ones, so a rare element lands one E4M3 step away (the CPU's code divides exactly)
        self.quantize = torch.compile(quantize_qkv, dynamic=True) if compiled else quantize_qkv
        if fp8 and self.backend != "fa3":
            raise ValueError(
                f"fp8_attention: FlashInfer's FP8 attention is its fa3 backend's (Hopper, head_dim 64/128/256); this "
                f"is compute capability {major}.{minor} at head_dim {head_dim} ({self.backend}). attention: sdpa "
                "runs the FP8 fake-quant reference instead"
            )
        self.workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # shared: runs are serial

    def check(self) -> None:
        """One tiny plan and call: JIT-compiles the kernels now (minutes the first time, then cached) so a
        deployment that cannot build them (no nvcc, an unsupported GPU) fails at load, not on a request. Modules
        built ahead that do not load here (another CUDA major or flashinfer build) are JIT-built instead. With
        `fp8`, the FP8 kernel must also pass `fp8_kernel_check` (else Fp8KernelDefect: fp8_attention refused)."""
        from .caches import use_flashinfer_aot

        try:
            self._check()
        except Exception as e:
            if self.aot is None or isinstance(e, Fp8KernelDefect):
                raise
            print(f"cosmos3: flashinfer modules in {self.aot} do not run here ({str(e)[:300]}); JIT-building them",
                  file=sys.stderr)  # fmt: skip
            self.aot = use_flashinfer_aot(None)
            import flashinfer.prefill

            flashinfer.prefill.get_batch_prefill_module.cache_clear()  # it holds the modules that failed
            self._check()

    def check_fp8_kernel(self) -> None:
        """`fp8_kernel_check` on FA3's FP8 ragged kernel → Fp8KernelDefect when it is off (see FP8_CHECK_LENGTHS)."""
        import flashinfer

        def fa3_fp8(q8, k8, v8, sq, sk, sv, indptr):
            ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=self.backend)
            dt = self.pool.k_pages.dtype
            ragged.plan(indptr, indptr, self.heads, self.kv_heads, self.head_dim, causal=False, q_data_type=E4M3,
                        kv_data_type=E4M3, o_data_type=dt)  # fmt: skip
            return ragged.run(q8, k8, v8, sq, sk, sv, out=torch.empty(q8.shape, dtype=dt, device=q8.device))

        err, rounding = fp8_kernel_check(fa3_fp8, self.heads, self.kv_heads, self.head_dim, self.workspace.device)
        if not err <= FP8_CHECK_RATIO * rounding:  # (NaN refuses too)
            known = " (0.6.1's is wrong on short sequences, 100-600 keys: BENCHMARKS.md, levers that did not pay)"
            raise Fp8KernelDefect(
                f"fp8_attention: FlashInfer {flashinfer.__version__}'s FA3 FP8 kernel fails its load check here: "
                f"rel-L2 {err:.3f} to exact attention on {len(FP8_CHECK_LENGTHS)} sequences of random q/k/v, against "
                f"{rounding:.3f} from E4M3 rounding alone (allowed {FP8_CHECK_RATIO:g}x)"
                f"{known if flashinfer.__version__ == '0.6.1' else ''}; serve without fp8_attention"
            )

    @torch.inference_mode()  # as requests run: a compiled quantization built here serves them (no grad-mode guard)
    def _check(self) -> None:
        if self.fp8:
            self.check_fp8_kernel()
        dev, dt, rows = self.workspace.device, self.pool.k_pages.dtype, 64
        prefix = PageList([0], 1, torch.zeros(1, dtype=torch.long, device=dev))
        plan = self.make_plan(rows)
        plan.update([Segment(start=0, length=rows, prefix=(prefix,), collect_kv=False)])
        q = torch.zeros(rows, self.heads, self.head_dim, dtype=dt, device=dev)
        kv = torch.zeros(rows, self.kv_heads, self.head_dim, dtype=dt, device=dev)
        plan(q, kv, kv, 0)
        torch.cuda.synchronize(dev)

    def shape_key(self, segments: list[Segment]) -> tuple:
        """Prefix lengths are plan data, not shapes; the gather's prefix capacity is a shape."""
        return (prefix_capacity(segments),)

    def make_plan(self, rows: int, slots: int = 0) -> FlashInferPlan:
        return FlashInferPlan(self, rows, slots)


# prefix tokens a gather holds at least: 8 segments (4 CFG requests) at `max_prompt_tokens` (1024), so the warmup's
# bucket captures serve every text-only mix that size. Every entry is copied each layer, used or not: at Edge's 8 KV
# heads × 128 a token's K and V are 4 KB, so 32 MiB written a layer (~10 us at the H200's bandwidth)
PREFIX_MIN_CAPACITY = 8192


def prefix_capacity(segments: list[Segment]) -> int:
    """The gather's prefix capacity for these segments: their prefix tokens rounded up to a power of two, at
    least PREFIX_MIN_CAPACITY (so mixes of a few text-only requests, and the warmup's, share one layout key)."""
    total = sum(p.num_tokens for seg in segments for p in seg.prefix)
    return max(PREFIX_MIN_CAPACITY, 1 << max(total - 1, 0).bit_length())


@dataclass
class GatherLayout:
    """Where `FlashInferPlan` puts each K/V token: kv buffer `[rows + capacity, kv_heads, d]`, request r's keys
    at `kv_indptr[r]:kv_indptr[r + 1]` — its prefix tokens, then its own rows — and its queries at rows
    `qo_indptr[r]:qo_indptr[r + 1]`. Requests: each segment, then its padding rows as a request of their own
    (attending to themselves, never read). Every row of the buffer is written: FA3 loads K/V by whole tiles
    within the buffer (TMA, bounded by its length, not by a request's), masking the scores of rows past a
    request's end but still multiplying their V by 0 — an unwritten NaN there would poison real rows."""

    qo_indptr: list[int]
    kv_indptr: list[int]
    own_dst: torch.Tensor  # [rows] int64: row i of k/v goes to kv row own_dst[i]
    prefix_src: torch.Tensor  # [capacity] int64: token of a layer's pages flattened to [pages * page_size, ...]
    prefix_dst: torch.Tensor  # [capacity] int64: ... goes to kv row prefix_dst[j]; the unused entries copy the
    # pack's first prefix token (`gather_layout`) to the rows after the last request's keys, one each, so the whole
    # buffer is written (no two writes to one row)
    segment_keys: torch.Tensor  # [rows + capacity] bool: the segments' kv rows (prefix and own; not the padding
    # requests' nor the unused entries'): FP8's K and V scales are over these

    def packed(self) -> torch.Tensor:
        """The three index tensors in one [rows + 2 * capacity] (one host-to-device copy); `unpack_index` splits it."""
        return torch.cat([self.own_dst, self.prefix_src, self.prefix_dst])


def unpack_index(index: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`GatherLayout.packed()` (or its device copy) → (own_dst, prefix_src, prefix_dst), views."""
    capacity = (index.shape[0] - rows) // 2
    return index[:rows], index[rows : rows + capacity], index[rows + capacity :]


def gather_kv(
    own: torch.Tensor, pages: torch.Tensor, own_dst: torch.Tensor, prefix_src: torch.Tensor, prefix_dst: torch.Tensor
) -> torch.Tensor:
    """One layer's K (or V) in `GatherLayout`'s order: own [rows, kv_heads, d] and the pool's pages [num_pages,
    page_size, kv_heads, d] → [rows + capacity, kv_heads, d]. Capturable (device index ops only)."""
    buf = torch.empty(len(own_dst) + len(prefix_dst), *own.shape[1:], dtype=own.dtype, device=own.device)
    buf.index_copy_(0, own_dst, own)
    buf.index_copy_(0, prefix_dst, pages.flatten(0, 1).index_select(0, prefix_src))
    return buf


def gather_layout(segments: list[Segment], rows: int, page_size: int, capacity: int) -> GatherLayout:
    """The kv buffer's layout for `segments` packed in `rows` rows (host tensors; see `GatherLayout`)."""
    qo, kv, src, own_dst = [0], [0], [], torch.empty(rows, dtype=torch.long)
    dst, segment_keys = [], torch.zeros(rows + capacity, dtype=torch.bool)
    for i, seg in enumerate(segments):
        end = segments[i + 1].start if i + 1 < len(segments) else rows
        n = sum(p.num_tokens for p in seg.prefix)
        for p in seg.prefix:
            pages = torch.tensor(p.pages, dtype=torch.long)
            src.append((pages[:, None] * page_size + torch.arange(page_size)).flatten()[: p.num_tokens])
        dst.append(torch.arange(kv[-1], kv[-1] + n))
        own_dst[seg.start : seg.start + seg.length] = torch.arange(kv[-1] + n, kv[-1] + n + seg.length)
        segment_keys[kv[-1] : kv[-1] + n + seg.length] = True
        qo.append(seg.start + seg.length)
        kv.append(kv[-1] + n + seg.length)
        if end > qo[-1]:
            own_dst[qo[-1] : end] = torch.arange(kv[-1], kv[-1] + end - qo[-1])
            kv.append(kv[-1] + end - qo[-1])
            qo.append(end)
    prefix_src = torch.cat([*src, torch.zeros(0, dtype=torch.long)])
    prefix_dst = torch.cat([*dst, torch.zeros(0, dtype=torch.long)])
    used = len(prefix_src)
    if used > capacity:
        raise ValueError(f"{used} prefix tokens exceed the plan's capacity of {capacity}")
    pad = torch.arange(capacity - used)
    # the unused entries copy the pack's own first prefix token, never pool token 0: a page no request of this pack
    # need hold, whose stale K/V (a failed request's NaN) FA3 would multiply by 0 in the last request's final tile
    fill = prefix_src[:1].expand(len(pad)) if used else torch.zeros_like(pad)
    return GatherLayout(qo, kv, own_dst, torch.cat([prefix_src, fill]),
                        torch.cat([prefix_dst, kv[-1] + pad]), segment_keys)  # fmt: skip


def _empty_requests(qo: list[int], kv: list[int], batch: int) -> None:
    """Pad the request lists to `batch` requests with empty ones (a bucket's unused slots: no rows, no keys)."""
    if batch and len(qo) - 1 > batch:
        raise ValueError(f"{len(qo) - 1} requests exceed the plan's {batch} ({batch // 2} segment slots)")
    while len(qo) - 1 < batch:
        qo.append(qo[-1])
        kv.append(kv[-1])


class FlashInferPlan:
    """One ragged prefill over `[prefix | own]` K/V per layer (see `GatherLayout`); with the backend's `fp8`, q and
    the gathered K/V quantized to E4M3 first (the module docstring). `slots`: a bucketed layout's segment slots:
    every update plans 2·slots requests (each segment and its padding rows, then empty ones), the fixed batch a
    captured graph needs; 0: as many as the first update's. The prefix capacity is the first update's
    `prefix_capacity` (the layout key holds it, so later updates fit)."""

    def __init__(self, attn: FlashInferAttention, rows: int, slots: int = 0):
        self.attn = attn
        self.rows = rows
        self.batch = 2 * slots
        self.capacity = 0
        self.ragged = None
        self.index: torch.Tensor | None = None  # [rows + 2 * capacity]: own_dst | prefix_src | prefix_dst
        self.valid: torch.Tensor | None = None  # fp8, [2 * rows + capacity] bool: segment rows | segment_keys
        self.staged: tuple[torch.Tensor, ...] = ()  # the pinned host copies (alive until their copies ran)
        # a plan fills pinned host buffers, then copies them to the GPU asynchronously: the next update waits for
        # those copies, or a host running a step ahead would rewrite them before the GPU read them
        self.copied: torch.cuda.Event | None = None

    def update(self, segments: list[Segment]) -> None:
        import flashinfer

        a = self.attn
        dev, dt = a.workspace.device, a.pool.k_pages.dtype
        if self.copied is not None:
            self.copied.synchronize()
        if self.index is None:
            self.capacity = prefix_capacity(segments)
            self.index = torch.zeros(self.rows + 2 * self.capacity, dtype=torch.long, device=dev)
            if a.fp8:
                self.valid = torch.zeros(2 * self.rows + self.capacity, dtype=torch.bool, device=dev)
        layout = gather_layout(segments, self.rows, a.pool.page_size, self.capacity)
        qo, kv = layout.qo_indptr, layout.kv_indptr
        if self.ragged is None:
            self.batch = self.batch or len(qo) - 1
            self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                a.workspace, "NHD", use_cuda_graph=True, backend=a.backend,
                qo_indptr_buf=torch.zeros(self.batch + 1, dtype=torch.int32, device=dev),
                kv_indptr_buf=torch.zeros(self.batch + 1, dtype=torch.int32, device=dev),
            )  # fmt: skip
        _empty_requests(qo, kv, self.batch)
        qkv = E4M3 if a.fp8 else dt  # FP8: E4M3 q and kv, output in the model dtype (FA3 has no FP8 output)
        self.ragged.plan(
            torch.tensor(qo, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32), a.heads, a.kv_heads,
            a.head_dim, causal=False, q_data_type=qkv, kv_data_type=qkv, o_data_type=dt,
        )  # fmt: skip
        self.staged = (layout.packed().pin_memory(),)
        self.index.copy_(self.staged[0], non_blocking=True)
        if self.valid is not None:
            self.staged += (torch.cat([segment_rows(segments, self.rows), layout.segment_keys]).pin_memory(),)
            self.valid.copy_(self.staged[1], non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        pool, index = self.attn.pool, unpack_index(self.index, self.rows)
        k_all, v_all = gather_kv(k, pool.k_pages[layer], *index), gather_kv(v, pool.v_pages[layer], *index)
        if self.valid is None:
            return self.ragged.run(q, k_all, v_all).flatten(-2)  # the buffers: the graph's pool when captured
        rows, keys = self.valid[: self.rows], self.valid[self.rows :]
        # FA3 FP8: per-head scales as run's positional args (scale_q [heads], scale_k/v [kv_heads], fp32)
        (q8, sq), (k8, sk), (v8, sv) = self.attn.quantize(q, k_all, v_all, rows, keys)
        out = torch.empty_like(q)  # run's own default for FP8 input is bf16 whatever the plan's o_data_type
        return self.ragged.run(q8, k8, v8, sq, sk, sv, out=out).flatten(-2)


def make_attention(
    name: str,
    pool: KVPool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    fp8: bool = False,
    compiled: bool = False,
) -> Backend:
    """`auto`: FlashInfer on CUDA when it is installed and its kernels build and run here, else SDPA (saying
    why on stderr). `flashinfer` asked for explicitly fails here instead, and so does `auto` with `fp8` on CUDA
    (fp8_attention asks for FA3's FP8 kernel: an SDPA fallback would be slower than bf16, not faster). SDPA with
    `fp8` (asked for, or `auto` on the CPU) is the fake-quant reference. `compiled`: FlashInfer FP8's quantization
    compiled (`quantize_qkv`)."""
    if name not in BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(BACKENDS)}; got {name!r}")
    on_cuda = pool.k_pages.is_cuda
    if name == "sdpa" or (name == "auto" and not on_cuda):
        return SdpaAttention(pool, fp8)
    if not on_cuda:
        raise ValueError("attention: flashinfer needs a CUDA device")
    try:
        attention = FlashInferAttention(pool, num_heads, num_kv_heads, head_dim, fp8, compiled)
        attention.check()
        return attention
    except Fp8KernelDefect:
        raise
    except Exception as e:
        if name == "flashinfer" or fp8:
            what = "fp8_attention" if fp8 else "attention"
            raise RuntimeError(f"{what}: flashinfer does not run here: {e}") from e
        print(f"cosmos3: attention auto → sdpa (flashinfer unavailable: {str(e)[:300]})", file=sys.stderr)
        return SdpaAttention(pool)
