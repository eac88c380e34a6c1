"""LoRA adapters: the device slots that hold them and the segmented low-rank delta of a packed forward.

An adapter (diffusers' PEFT format, read and checked by cosmos3_core/lora_store.py) adds to an adapted linear
`y = W x` the delta `s · B (A x)`: A [r, in], B [out, r], s the request's scale times the adapter's own
`lora_alpha / r` (folded into B when it is read). Which linears: `ADAPTABLE`, the attention projections and MLP
linears of every layer of both towers (an adapter on the UND tower changes the text K/V, so prefill applies it).

`AdapterPool(model, slots, rank)`: for each adaptable linear of the towers the model holds, two device buffers
registered on that linear (non-persistent: never in a state dict) — `lora_A` [slots, R, in] and `lora_B`
[slots, R, out] (B transposed: all slots form one [slots·R, out] matrix) in the model's activation dtype, R the pool
rank (`max_lora_rank` rounded up to a multiple of 8, GEMM alignment). An adapter of rank r ≤ R is written into a
slot zero-padded (rows r..R of A and of Bᵀ), modules it does not target stay zero. The buffers never move or grow,
so a captured graph that reads a slot stays valid whatever adapter is written there next.

`AdapterRows`: a pack's choice, per group of rows — group g is rows [offs[g-1], offs[g]) (offs[-1] = 0), reads
slot `slot[g]` scaled by `scale[g]` (0: no adapter, the delta is exactly zero). A packed step has one group per
segment slot (its rows, SEGMENT_ALIGN-padded) plus one for the rows after the last segment, buffers its layout owns
(cosmos3_core/graphs.py); prefill has one group, the whole text.

Two ways to add the rows' deltas, each one pass over the pack — no loop over requests, no host synchronisation
(capturable). CUDA runs the dense form (bench/lora_delta.py, docs/lora.md; tests/test_lora_gpu.py):
- `grouped_delta` (the CPU's): two grouped GEMMs (`torch.nn.functional.grouped_mm`), each group through its own
  slot's A then B. A row's delta depends only on its group's rows and a group's GEMMs have the same shape whatever
  it is packed with, so a request's result does not depend on its neighbours, bit for bit on the CPU.
- `dense_delta` (CUDA's): one GEMM through the A of every slot the pack reads (`AdapterRows.used`, K of them; a
  pack's layout is keyed by K, so a pack of one adapter costs one slot's GEMMs whatever the pool's size):
  `x [A_u0; ...]ᵀ` [N, K·R], each row's columns of other slots replaced by zeros (selected, not multiplied by 0: an
  inf there would be NaN) and its own scaled, then `y + h [Bᵀ_u0; ...]` as one GEMM with the add in its epilogue —
  ordinary cuBLAS GEMMs, where grouped GEMMs of R columns run far below the GPU's peak. A row sees another slot only
  through zeros times that slot's Bᵀ, so every B in the pool must be finite (lora_store.py refuses an adapter whose
  B·lora_alpha/r is not, in the pool's dtype): then one adapter's overflow (x A past fp16's range) stays in its own
  rows.
Two packs skip the per-row delta (still one pass, no loop, no synchronisation):
- `merged` (a packed step whose every row reads one slot at one scale, as a request alone does; CUDA or compiled,
  16-bit linears): the linear runs with that adapter merged into its weight, `x (W + s·B A)ᵀ` — a weight-sized add
  per linear and forward, where the dense delta re-reads x and re-reads and re-writes y (~+14 % of an Edge step;
  docs/lora.md). The slot and scale are still buffers (group 0's): a captured graph serves any adapter.
- `host` (prefill: one request's text, its slot and scale known on the host): `y + s·(x Aᵀ) B` through that slot's
  views, two kernels (the dense form's per-row selection is a dozen launches per linear in an eager prefill).
`adapted(linear, x, a16_rows, rows)`: `fp8.linear` plus the delta; with `rows` None (a pack with no adapter) it is
`fp8.linear` alone, today's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .fp8 import Fp8Linear, linear

# per tower ("und", "gen": layers.UND, layers.GEN), the adaptable linears of a layer, as paths under `layers.N.`
ADAPTABLE: dict[str, tuple[str, ...]] = {
    "und": ("self_attn.to_q", "self_attn.to_k", "self_attn.to_v", "self_attn.to_out",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "gen": ("self_attn.add_q_proj", "self_attn.add_k_proj", "self_attn.add_v_proj", "self_attn.to_add_out",
            "mlp_moe_gen.gate_proj", "mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj"),
}  # fmt: skip
RANK_ALIGN = 8  # GEMMs on CUDA: every dimension a multiple of 16 bytes


def adaptable_shapes(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Every adaptable linear of a checkpoint of this config → (tower, in, out), keyed by its module name
    (`layers.3.self_attn.add_q_proj`): what an adapter's keys and shapes are checked against."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, mlp = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    dims = {"to_q": (h, q), "to_k": (h, kv), "to_v": (h, kv), "to_out": (q, h), "add_q_proj": (h, q),
            "add_k_proj": (h, kv), "add_v_proj": (h, kv), "to_add_out": (q, h), "gate_proj": (h, mlp),
            "up_proj": (h, mlp), "down_proj": (mlp, h)}  # fmt: skip
    out = {}
    for i in range(cfg.num_hidden_layers):
        for tower, paths in ADAPTABLE.items():
            for path in paths:
                leaf = path.rpartition(".")[2]
                if leaf == "gate_proj" and cfg.hidden_act != "silu":  # relu2 MLPs have no gate
                    continue
                out[f"layers.{i}.{path}"] = (tower, *dims[leaf])
    return out


@dataclass(frozen=True)
class Adapter:
    """A checked adapter on the host: per adapted module name of the towers it was read for (lora_store.py: a
    stage's), (A [r, in], B [out, r] · lora_alpha/r) in the pool's dtype, every value finite; `towers`: every tower
    its file adapts."""

    name: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    towers: frozenset[str]


@dataclass
class AdapterRows:
    """A pack's adapter choice by group of rows (see the module docstring); tensors on the model's device."""

    slot: torch.Tensor  # [G] int64: the pool slot each group reads
    scale: torch.Tensor  # [G] fp32: the request's scale; 0 for rows without an adapter (and padding)
    offs: torch.Tensor  # [G] int32: each group's end row, non-decreasing, the last one N
    # [K] int64: the distinct pool slots the pack's groups read, the only ones `dense_delta` goes through (its cost
    # grows with K: one adapter in a pool of 4 reads one slot, not 4); None: every slot of the pool
    used: torch.Tensor | None = None
    # every row reads slot[0] at scale[0] (a pack of one request, or of requests sharing adapter and scale): CUDA
    # and compiled 16-bit linears merge it into their weights (`merged_linear`); a layout key (cosmos3_core/step.py)
    merged: bool = False
    host: tuple[int, float] | None = None  # one group whose (slot, scale) the host knows: prefill's, never captured

    @classmethod
    def single(cls, slot: int, scale: float, rows: int, device: torch.device | str) -> AdapterRows:
        """One group of `rows` rows (prefill's text), its slot and scale on the host too."""
        slots = torch.full((1,), slot, dtype=torch.long, device=device)
        return cls(
            slots,
            torch.full((1,), scale, dtype=torch.float32, device=device),
            torch.full((1,), rows, dtype=torch.int32, device=device),
            slots,
            host=(slot, scale),
        )


class AdapterPool:
    """`slots` adapters of rank ≤ `rank` resident on the device, for the towers `model` holds."""

    def __init__(self, model: nn.Module, slots: int, rank: int):
        if slots < 1 or rank < 1:
            raise ValueError(f"an adapter pool needs slots ≥ 1 and rank ≥ 1; got {slots}, {rank}")
        self.slots, self.rank = slots, -(-rank // RANK_ALIGN) * RANK_ALIGN
        self.towers = frozenset(model.parts)  # the towers whose linears it holds (a stage's model holds one)
        self.dtype = dtype = model.dtype
        device = model.device
        self.linears: dict[str, nn.Module] = {}
        for i, layer in enumerate(model.layers):
            for tower in model.parts:
                for path in ADAPTABLE[tower]:
                    owner, _, leaf = path.rpartition(".")
                    lin = getattr(getattr(layer, owner), leaf, None)
                    if lin is None:  # relu2: no gate_proj
                        continue
                    a = torch.zeros(slots, self.rank, lin.in_features, dtype=dtype, device=device)
                    b = torch.zeros(slots, self.rank, lin.out_features, dtype=dtype, device=device)
                    lin.register_buffer("lora_A", a, persistent=False)
                    lin.register_buffer("lora_B", b, persistent=False)
                    self.linears[f"layers.{i}.{path}"] = lin

    def write(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` in `slot` (what it does not target: zero). The caller makes sure no pack in flight reads
        the slot (lora_store.py pins slots of live requests)."""
        for name, lin in self.linears.items():
            lin.lora_A[slot].zero_()
            lin.lora_B[slot].zero_()
            if name in adapter.modules:
                a, b = adapter.modules[name]
                r = a.shape[0]
                lin.lora_A[slot, :r].copy_(a)
                lin.lora_B[slot, :r].copy_(b.t())


def grouped_delta(y: torch.Tensor, x: torch.Tensor, lin: nn.Module, rows: AdapterRows) -> torch.Tensor:
    """y [N, out] + each group's `scale · B_slot (A_slot x)` for x [N, in], in x's dtype (two grouped GEMMs)."""
    a = lin.lora_A[rows.slot] * rows.scale.to(x.dtype)[:, None, None]  # [G, R, in]
    h = torch.nn.functional.grouped_mm(x, a.transpose(1, 2), offs=rows.offs)  # [N, R]
    return y + torch.nn.functional.grouped_mm(h, lin.lora_B[rows.slot], offs=rows.offs)  # [G, R, out] → [N, out]


def _read(pool: torch.Tensor, rows: AdapterRows) -> torch.Tensor:
    """A pool buffer (`lora_A` / `lora_B`, [slots, R, ·]) → the slots the rows read, [K, R, ·] (a gather: a kernel
    with fixed shapes, capturable; which slots is content)."""
    return pool if rows.used is None else pool.index_select(0, rows.used)


def slot_projection(x: torch.Tensor, lin: nn.Module, rows: AdapterRows) -> torch.Tensor:
    """x [N, in] through the A of every slot the rows read (`rows.used`) at once → h [N, K·R] in x's dtype, each
    row keeping its own slot's R columns times its scale and zeros in the others' — all of them for a row of scale 0
    (no adapter) — (`dense_delta`'s first half). Zeros by selection: a column that overflowed (inf) becomes 0, not
    NaN."""
    a = _read(lin.lora_A, rows)  # [K, R, in]
    n, (k, r) = x.shape[0], a.shape[:2]
    index = torch.arange(n, dtype=rows.offs.dtype, device=x.device)
    group = torch.searchsorted(rows.offs, index, right=True).clamp_(max=len(rows.offs) - 1)  # [N]: each row's group
    scale = rows.scale[group]  # [N]
    columns = torch.arange(k, device=x.device) if rows.used is None else rows.used  # [K]: the slot of each column
    # [N, K]: the one column each row reads (a comparison, not a scatter: under compile one fused elementwise
    # kernel; every op here is a device kernel with fixed shapes — capturable)
    own = (rows.slot[group, None] == columns) & (scale != 0)[:, None]
    h = torch.mm(x, a.view(k * r, -1).t()).view(n, k, r)
    h = torch.where(own[:, :, None], h, 0) * scale.to(x.dtype)[:, None, None]
    return h.view(n, k * r)


def dense_delta(y: torch.Tensor, x: torch.Tensor, lin: nn.Module, rows: AdapterRows) -> torch.Tensor:
    """`grouped_delta`'s sum through the slots the rows read at once: y + `slot_projection` [Bᵀ of those slots]
    (the add in the GEMM's epilogue)."""
    b = _read(lin.lora_B, rows)  # [K, R, out]
    return torch.addmm(y, slot_projection(x, lin, rows), b.view(-1, b.shape[-1]))


def merged_linear(lin: nn.Module, x: torch.Tensor, rows: AdapterRows) -> torch.Tensor:
    """x [N, in] through a 16-bit linear with group 0's adapter merged into its weight: `x (W + s·B A)ᵀ + b`
    (rows.merged: every row reads that slot at that scale). The slot and scale are read on the device (an index
    and a multiply), so a captured graph serves whichever adapter its pack holds."""
    a = lin.lora_A.index_select(0, rows.slot[:1])[0]  # [R, in]
    b = lin.lora_B.index_select(0, rows.slot[:1])[0]  # [R, out]
    return F.linear(x, torch.addmm(lin.weight, b.t() * rows.scale[:1].to(b.dtype), a), lin.bias)


def adapted(lin: nn.Module, x: torch.Tensor, a16_rows: int, rows: AdapterRows | None) -> torch.Tensor:
    """`fp8.linear(lin, x, a16_rows)` plus the rows' adapter deltas (prefill: its one slot directly; eager on the
    CPU: `grouped_delta`; on CUDA or compiled: `merged_linear` for a merged pack's 16-bit linears, else `dense_delta`
    — grouped_mm's compile-time kernel takes bf16 only); exactly `fp8.linear` when `rows` is None or the linear has
    no slots (the pool covers the adaptable linears)."""
    if rows is None or not hasattr(lin, "lora_A"):
        return linear(lin, x, a16_rows)
    dense = x.is_cuda or torch.compiler.is_compiling()
    if rows.host is None and dense and not isinstance(lin, Fp8Linear) and rows.merged:  # FP8: no guard on merged
        return merged_linear(lin, x, rows)
    y = linear(lin, x, a16_rows)
    if rows.host is not None:
        slot, scale = rows.host
        return y if scale == 0 else torch.addmm(y, x @ lin.lora_A[slot].t(), lin.lora_B[slot], alpha=scale)
    return (dense_delta if dense else grouped_delta)(y, x, lin, rows)
