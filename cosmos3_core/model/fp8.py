"""FP8 linears (E4M3 weights) and the step policy that decides, per denoise step, W8A16 or W8A8.

Where the FP8 weights come from (one module, `Fp8Linear`, for both):
- official checkpoints (Hub revision `fp8`, ModelOpt layout, see `tools/make_fp8.py`): per layer linear
  `X.weight` E4M3 [out, in], `X.weight_scale` fp32 [] (tensorwise), `X.input_scale` fp32 [] (static, calibrated);
  ModelOpt's own copies (`X.weight_quantizer._scale`, `X.input_quantizer._amax` = input_scale · 448) are read when
  the plain keys are absent. `transformer/config.json` carries `quantization_config` (quant_method `modelopt`,
  quant_algo `FP8`) and, optionally, `runtime.diffusion_step_policy`.
- `precision: fp8` on a 16-bit checkpoint: each layer linear quantized at load (`quantize_rowwise`): weight scale
  per output channel [out], input scale per token, computed on the fly.

Numerics, for x [N, in] in the model dtype (`Fp8Linear.forward`):
- W8A16: `F.linear(x, w8.to(x.dtype) * s_w.to(x.dtype), b)` — diffusers' `_w8a16_linear`, op for op.
- W8A8: `q = (x.float() / s_x).clamp(±448).to(e4m3)`, then `torch._scaled_mm(q, w8.t(), s_x, s_w, b, out_dtype=
  x.dtype, use_fast_accum=True)` — what ModelOpt's `fp8_per_tensor_gemm` runs on the GPU for a static s_x (its
  `_to_fp8` is compiled, so x/s_x is one fp32 division, not a bf16 one); rowwise s_x[n] = amax|x[n]| / 448 for
  `precision: fp8`. The bias goes into `_scaled_mm` except with fp32 output, where it is added after (as ModelOpt
  does). torch's CPU build has `_scaled_mm` for E4M3 (tensorwise and rowwise), so CPU tests run the same op as the
  GPU; `w8a8_reference` is the same maths written out (fp8 values exact in fp32, one scale product), for tests.

Step policy (`StepPolicy`, checkpoint schema `first_last_n`, as `diffusers/pipelines/cosmos/mixed_precision.py`
resolves and applies it): W8A16 for the first / last N denoise steps, native W8A8 between; a step in both windows
follows `overlap`; a 1-step request stays W8A8. The GEN tower's linears follow the step; the UND tower's (the
reasoner: prefill, run once per request) follow `reasoner` (a16 | native). Commit passes of AR windows run as the
window's last step did.

Which linears: every layer linear of both towers (`layers.N.self_attn.{to_q,to_k,to_v,to_out,add_q_proj,add_k_proj,
add_v_proj,to_add_out}`, `layers.N.{mlp,mlp_moe_gen}.*_proj`); `proj_in/out`, the timestep embedder and the sound
projections stay 16-bit (the official `ignore` list). Note: diffusers 0.42.1's `_classify_cosmos3_linear` files
`to_q/k/v/out` (the UND attention, in its own transformer) under "generation" and `add_*`/`to_add_out` (the GEN
attention) under "reasoner"; here the towers are what the policy names them, so the text K/V stays step-independent
(cache-once). All-W8A16 and all-W8A8 runs are unaffected by the difference; mixed steps are compared against
diffusers with the classification by tower (tests/test_fp8.py).

Packed steps: requests at different steps share a tick, so precision is per row. The row builder records it
(`Row.a16`); the step packs W8A16 rows first, and every GEN linear runs rows [0, a16_rows) W8A16 and the rest W8A8
(`linear`): linears are token-wise, so each row's result is what it would be alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(E4M3).max
_EPS = 1e-12  # an all-zero row (segment padding) gets a tiny scale, not a division by zero

MODES = ("a16", "native")  # the checkpoint schema's words: W8A16, or the checkpoint's W8A8
PRECISIONS = ("checkpoint", "fp8")  # a deployment's `precision`


class PolicyError(ValueError):
    """A step policy (checkpoint or deployment) that cannot be honoured; the message names the field."""


@dataclass(frozen=True)
class StepPolicy:
    """`first_last_n`: W8A16 for steps [0, first_steps) and [steps - last_steps, steps), W8A8 between."""

    first_steps: int = 3
    last_steps: int = 3
    overlap: str = "a16"  # a step in both windows: a16 (W8A16) or native (W8A8)
    reasoner: str = "a16"  # the UND tower (prefill): a16 or native

    def use_high_precision(self, step: int, steps: int) -> bool:
        """True: this denoise step runs W8A16. `Cosmos3MixedPrecisionConfig.use_high_precision`, rule for rule."""
        if steps <= 0:
            raise ValueError(f"steps must be positive, got {steps}")
        if not 0 <= step < steps:
            raise IndexError(f"step must be in [0, {steps}), got {step}")
        if steps == 1:  # as diffusers / vLLM-Omni: a 1-step request keeps the checkpoint's W8A8
            return False
        first, last = step < self.first_steps, step >= steps - self.last_steps
        if first and last:
            return self.overlap == "a16"
        return first or last

    @property
    def reasoner_a16(self) -> bool:
        return self.reasoner == "a16"

    def with_overrides(self, overrides: dict[str, Any], where: str = "fp8_policy") -> StepPolicy:
        """Replace the fields `overrides` names (a deployment's `fp8_policy`), each validated."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise PolicyError(f"{where}: unknown keys {unknown}; allowed: {', '.join(sorted(known))}")
        for key in ("first_steps", "last_steps"):
            if key in overrides:
                _count(overrides[key], f"{where}.{key}")
        for key in ("overlap", "reasoner"):
            if key in overrides and overrides[key] not in MODES:
                raise PolicyError(f"{where}.{key}: must be one of {', '.join(MODES)}, got {overrides[key]!r}")
        return replace(self, **overrides)

    @classmethod
    def parse(cls, policy: Any, where: str = "quantization_config.runtime.diffusion_step_policy") -> StepPolicy:
        """The checkpoint's `diffusion_step_policy` (schema 1), accepted and refused as diffusers'
        `parse_diffusion_step_policy` does: a missing or unsupported field fails, naming it."""
        if not isinstance(policy, dict):
            raise PolicyError(f"{where}: must be a mapping")
        required = ("schema_version", "type", "index_space", "scope", "default_mode", "first_steps", "last_steps",
                    "overlap", "reasoner")  # fmt: skip
        missing = [k for k in required if k not in policy]
        if missing:
            raise PolicyError(f"{where}: missing fields {missing}")
        expect = {"schema_version": 1, "type": "first_last_n", "index_space": "denoising_loop_iteration",
                  "default_mode": "native"}  # fmt: skip
        for key, value in expect.items():
            if policy[key] != value:
                raise PolicyError(f"{where}.{key}: supported is {value!r}, got {policy[key]!r}")
        scope = policy["scope"]
        if not isinstance(scope, (list, tuple)) or not all(isinstance(s, str) for s in scope):
            raise PolicyError(f"{where}.scope: must be a list of strings")
        if set(scope) != {"transformer"}:
            raise PolicyError(f"{where}.scope: supported is ['transformer'], got {list(scope)}")
        counts = {}
        for key in ("first_steps", "last_steps"):
            spec = policy[key]
            if not isinstance(spec, dict) or spec.get("mode") not in MODES:
                raise PolicyError(f"{where}.{key}: must be a mapping with mode a16 or native and a count")
            count = _count(spec.get("count"), f"{where}.{key}.count")
            counts[key] = count if spec["mode"] == "a16" else 0  # a native window is no window
        overlap = str(policy["overlap"]).strip().lower()  # diffusers normalises this one field, not `reasoner`
        if overlap not in MODES:
            raise PolicyError(f"{where}.overlap: must be one of {', '.join(MODES)}, got {policy['overlap']!r}")
        if policy["reasoner"] not in MODES:
            raise PolicyError(f"{where}.reasoner: must be one of {', '.join(MODES)}, got {policy['reasoner']!r}")
        return cls(counts["first_steps"], counts["last_steps"], overlap, policy["reasoner"])


OFFICIAL_POLICY = StepPolicy()  # the Hub `fp8` revision's: 3 + 3 steps W8A16, overlap and reasoner a16
ALL_NATIVE = StepPolicy(0, 0, "a16", "native")  # an FP8 checkpoint without a policy: W8A8 everywhere


def resolve_policy(checkpoint: StepPolicy | None, fp8_checkpoint: bool, overrides: dict[str, Any]) -> StepPolicy:
    """The policy a deployment runs, as `Cosmos3MixedPrecisionConfig.resolve` builds it: no overrides → the
    checkpoint's policy (an FP8 checkpoint without one runs W8A8 throughout; a 16-bit checkpoint quantized at load
    takes the official one); overrides (a deployment's `fp8_policy`, like diffusers' `mixed_precision_format="fp8"`
    with `mixed_precision_*` arguments) replace fields of the checkpoint's policy, or of the official one."""
    if not overrides:
        return checkpoint or (ALL_NATIVE if fp8_checkpoint else OFFICIAL_POLICY)
    return (checkpoint or OFFICIAL_POLICY).with_overrides(overrides)


def validate_precision(precision: Any, fp8_policy: Any, where: str) -> None:
    """A deployment's `precision` and `fp8_policy`, checked before anything loads; errors name the field."""
    if precision not in PRECISIONS:
        raise PolicyError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not isinstance(fp8_policy, dict):
        raise PolicyError(f"{where}: fp8_policy must be a mapping, got {type(fp8_policy).__name__}")
    OFFICIAL_POLICY.with_overrides(fp8_policy, f"{where}: fp8_policy")


def _count(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PolicyError(f"{where}: must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Fp8Plan:
    """How a checkpoint is served in FP8: the step policy, and whether 16-bit layer linears are quantized at load
    (`precision: fp8`)."""

    policy: StepPolicy
    quantize_at_load: bool


def quantize(w: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (any float dtype) → (E4M3 [out, in], fp32 scale: [out] rowwise, [] tensorwise) with
    w ≈ w8 · scale; the largest |w| of a row (or of the tensor) maps to ±448."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1) if rowwise else wf.abs().amax()
    scale = amax.clamp(min=_EPS) / FP8_MAX
    w8 = (wf / (scale[:, None] if rowwise else scale)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return w8, scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 [out, in] · scale ([] or [out]) → [out, in] in `dtype`, as the W8A16 path computes it."""
    return w8.to(dtype) * scale.to(dtype).reshape(-1, 1)


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, in] → (E4M3 [N, in], fp32 scale: the static [] one, or [N, 1] per token when `input_scale` is None)."""
    xf = x.float()
    scale = input_scale if input_scale is not None else xf.abs().amax(-1, keepdim=True).clamp(min=_EPS) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3), scale


def w8a8_reference(
    x: torch.Tensor, w8: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None, bias=None
) -> torch.Tensor:
    """The W8A8 product written out (tests): E4M3 values and their products are exact in fp32; the sum is fp32;
    one multiply by s_x · s_w; the bias last; then the output dtype."""
    q, sx = quantize_activations(x, input_scale)
    out = (q.float() @ w8.float().t()) * (sx * weight_scale.reshape(1, -1))
    return (out if bias is None else out + bias.float()).to(x.dtype)


class Fp8Linear(nn.Module):
    """A linear with E4M3 weights; `forward(x, a16)` runs it W8A16 (a16) or W8A8. Parameter names are the
    checkpoint's (`weight`, `weight_scale`, `input_scale`, `bias`).

    weight [out, in] E4M3; weight_scale fp32, [] (tensorwise, checkpoints) or [out] (rowwise, quantized at load);
    input_scale fp32 [] static, or None: per token at run time (rowwise); bias [out] in the model dtype or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool, rowwise: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.rowwise = in_features, out_features, rowwise
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3), requires_grad=False)
        self.register_buffer("weight_scale", torch.empty((out_features,) if rowwise else (), dtype=torch.float32))
        self.register_buffer("input_scale", None if rowwise else torch.empty((), dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantize a 16-bit linear rowwise (`precision: fp8`), on its device."""
        has_bias = linear.bias is not None
        with torch.device("meta"):  # placeholders only: every tensor is assigned below
            m = cls(linear.in_features, linear.out_features, has_bias, True, linear.weight.dtype)
        w8, scale = quantize(linear.weight.detach(), rowwise=True)
        m.weight = nn.Parameter(w8, requires_grad=False)
        m.weight_scale = scale
        if has_bias:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return m

    def forward(self, x: torch.Tensor, a16: bool) -> torch.Tensor:
        """x [..., in] → [..., out] in x's dtype."""
        if a16:
            return F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype), self.bias)
        lead = x.shape[:-1]
        q, sx = quantize_activations(x.reshape(-1, self.in_features), self.input_scale)
        sw = self.weight_scale.reshape(1, -1) if self.rowwise else self.weight_scale
        fuse_bias = self.bias is not None and x.dtype != torch.float32  # _scaled_mm takes no bias with fp32 output
        out = torch._scaled_mm(q, self.weight.t(), scale_a=sx, scale_b=sw, bias=self.bias if fuse_bias else None,
                               out_dtype=x.dtype, use_fast_accum=True)  # fmt: skip
        if self.bias is not None and not fuse_bias:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kind = "rowwise, dynamic input" if self.rowwise else "tensorwise, static input"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {kind}"


def linear(m: nn.Module, x: torch.Tensor, a16_rows: int) -> torch.Tensor:
    """x [N, in] → [N, out]. An `Fp8Linear` runs rows [0, a16_rows) W8A16 and rows [a16_rows, N) W8A8, as two
    GEMMs (one when every row has the same precision); a 16-bit linear ignores `a16_rows`."""
    if not isinstance(m, Fp8Linear):
        return m(x)
    if a16_rows >= x.shape[0]:
        return m(x, True)
    if a16_rows <= 0:
        return m(x, False)
    return torch.cat([m(x[:a16_rows], True), m(x[a16_rows:], False)])


def layer_linear_names(model: nn.Module) -> list[str]:
    """The module names of every `nn.Linear` under `layers.` (both towers' attention projections and MLPs): the
    linears an FP8 checkpoint stores in E4M3 and `precision: fp8` quantizes. Nothing outside the layers is: the
    embeddings, `proj_in`/`proj_out`, the sound projections and the action bands' domain-aware linears
    (`action_proj_in`/`action_proj_out`, per-embodiment weights) stay in the model dtype, as diffusers'
    mixed precision leaves them (its `_classify_cosmos3_linear` names only the layers' attention and MLP linears)."""
    return [n for n, m in model.named_modules() if n.startswith("layers.") and isinstance(m, nn.Linear)]


def quantize_layer_linears_(model: nn.Module) -> int:
    """Replace each 16-bit layer linear by its rowwise `Fp8Linear`, in place, one at a time (peak memory: one
    weight). → the number replaced."""
    names = layer_linear_names(model)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, Fp8Linear.from_linear(getattr(owner, child)))
    return len(names)
