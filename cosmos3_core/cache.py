"""Step caching, per request and CFG branch: SeaCache as diffusers 0.42.1 runs it on Cosmos3 (the oracle).

What diffusers does (`hooks/sea_cache.py`, `pipe.transformer.enable_cache(SeaCacheConfig(...))`): each transformer
call runs in a cache context named by its branch (`cond`, `uncond`) with the step index, the scheduler's sigma
and the step count. Before the decoder stack, per branch:
- the **indicator** is the call's raw vision latents [C, T, H, W] (the whole trajectory latent, clean conditioning
  frames included) through the SEA filter: a 3-D FFT over (T, H, W), a per-axis Wiener-like gain
  (1-σ)·P/((1-σ)²·P + σ²) with the clean-signal power prior P = 1/|f|^power_exp, normalised to unit mean, back;
- the **gate**: a step is forced to run in full when it is among the first `retention_steps` or the last
  `cache_end_steps`, when there is no previous indicator, or after `max_consecutive_cached` reuses in a row.
  Otherwise the relative L1 distance mean|I - I_prev| / (mean|I_prev| + 1e-16) is added to an accumulator, and
  the step reuses when the sum stays below `threshold` (a full step resets the accumulator). The indicator
  becomes the previous one whatever the decision;
- what is cached is the **residual of the GEN block stack**, from its input (tokens after `proj_in` and the
  timestep embedding) to its output after the final norm `norm_moe_gen`, over the branch's whole GEN sequence
  (vision, then sound, then action tokens). A reusing step adds the last residual to its input (`residual_order` 1: extrapolated
  linearly from the last two full steps) and goes straight to `proj_out`: no layer runs. Every full step
  records its residual (the last `residual_order + 1` are kept).

Here: the quantity measured is a function of the request's latents and sigma only — nothing computed in the
forward — so the scheduler decides every branch of every request *before* the tick's rows are built
(`Scheduler.schedule`): a reusing branch contributes no rows to the packed forward, while the other requests
(and the request's other branch) still compute. The step (step.py) returns the block-stack residual of each
computed branch of a cached request, read off the packed forward (its input and post-norm output are there
anyway), and computes a reusing branch's velocity on its own (`towers.embed_row`, + residual,
`towers.output_heads`: a few small GEMMs). Decisions need the distance on the host; `host_distances` reads all
the tick's requests in one transfer (diffusers reads once per branch). One `SeaCache` per trajectory: an AR window
is its own denoise loop (its own scheduler and sigmas), so each window starts a fresh one — no indicator, decision
or residual crosses windows — and window 0 decides as the same request without windows would; a kv commit pass is
no step (nothing measured or recorded). diffusers has no windowed pipeline to compare with; a window's first steps
are as noisy as a request's, so the gate's forced first steps apply to each window.

Robot actions: the pipeline runs its SeaCache on action requests too — the indicator is still the vision latents
(clean frame 0 included), the residual spans the action tokens, and a reusing branch's action velocity comes from
its own action embedding + residual through `action_proj_out`. Inverse dynamics has no noisy vision frame: diffusers
then has no indicator and fails open (every step in full, nothing recorded); so does `gated=False` here.

Several GPUs (parallel/denoise.py): the decisions are rank 0's (the scheduler's); reusing branches are computed on
rank 0 alone and the running branches' residuals come back from the group with their velocities.

Both branches see the same latents at the same steps, so diffusers' two per-branch previous indicators are
always equal: one is kept per request and its distance computed once; the accumulator, the run of reuses and
the residual history stay per branch, as diffusers keeps them. Residuals keep the model dtype (diffusers'
`gen_output - gen_input`), so bf16 serving reuses what diffusers' bf16 pipeline would.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .requests import SeaCacheParams

BRANCH_NAMES = ("cond", "uncond")


def sea_gain(grid: tuple[int, int, int], sigma: float, power_exp: float, device: torch.device) -> torch.Tensor:
    """The SEA filter's spectral gain over a (T, H, W) latent grid at `sigma`: fp32 [T, H, W, 1], unit mean."""
    dims = (0, 1, 2)
    sigma = max(1e-6, min(1.0 - 1e-6, sigma))  # both scales stay > 0 at the schedule's ends
    signal, noise = 1.0 - sigma, sigma
    gain = None
    for axis in dims:
        freqs = torch.fft.fftfreq(grid[axis], device=device, dtype=torch.float32)
        clean_power = 1.0 / (freqs.abs().pow(power_exp) + 1e-16)
        axis_gain = signal * clean_power / (signal**2 * clean_power + noise**2 + 1e-16)
        shape = [1] * 4
        shape[axis] = axis_gain.shape[0]
        gain = axis_gain.reshape(shape) if gain is None else gain * axis_gain.reshape(shape)
    # unit mean over the spectrum, so distances compare across steps (the paper's Eq. 7); chosen on the device,
    # not with diffusers' `if` on the mean (a host sync per request and step): the same values
    mean_gain = gain.mean()
    return torch.where(torch.isfinite(mean_gain) & (mean_gain > 0), gain / mean_gain, gain)


class SeaGains:
    """`sea_gain`s kept by (grid, sigma, power_exp, device), least recently used dropped past `capacity`: a gain
    depends on nothing else, so every request, window and step with the same shape and schedule shares it, and a
    step's filter is an FFT, a product and an inverse FFT (8 kernels instead of 55: each a launch the GPU waits
    for on a step whose branches all reuse). One per engine (the scheduler's); Edge's largest is 190 KB."""

    def __init__(self, capacity: int = 128):
        self.capacity = capacity
        self._gains: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def get(self, grid: tuple[int, int, int], sigma: float, power_exp: float, device: torch.device) -> torch.Tensor:
        key = (grid, sigma, power_exp, str(device))
        gain = self._gains.pop(key, None)
        if gain is None:
            gain = sea_gain(grid, sigma, power_exp, device)
            while len(self._gains) >= self.capacity:
                self._gains.popitem(last=False)
        self._gains[key] = gain
        return gain


def sea_filter(latents: torch.Tensor, sigma: float, power_exp: float, gains: SeaGains | None = None) -> torch.Tensor:
    """latents [T, H, W, C] → the SEA-filtered latents, same shape and dtype (diffusers' `_apply_sea_filter`).

    Computed in fp32 whatever the input dtype; `gains`: where the gain is kept (None: computed here)."""
    dtype = latents.dtype
    x = latents.contiguous().float()
    dims = (0, 1, 2)
    spectrum = torch.fft.fftn(x, dim=dims)
    grid = (x.shape[0], x.shape[1], x.shape[2])
    gain = sea_gain(grid, sigma, power_exp, x.device) if gains is None else gains.get(grid, sigma, power_exp, x.device)
    return torch.fft.ifftn(spectrum * gain, dim=dims).real.to(dtype)


@dataclass
class _Branch:
    """One CFG branch's gate state (diffusers' `SeaCacheContextState`, less what the decoder-stack hooks carry)."""

    accumulated: float = 0.0
    consecutive: int = 0  # reuses since the last full step
    history: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (step, residual [N + T_s + T_a, hidden])
    skipped: list[int] = field(default_factory=list)  # 0-based steps that reused


class SeaCache:
    """One request's SeaCache state over one trajectory: `sigmas[i]` is the scheduler's sigma at step i (one per
    step). Per step: `measure` (before the tick's rows: the indicator and, when a gate reads it, its distance on the
    device), `decide` (that distance on the host → per branch the residual to reuse, or None: run in full), then
    after the forward `record` (the full branches' residuals)."""

    def __init__(
        self,
        params: SeaCacheParams,
        branches: int,
        sigmas: list[float],
        dtype: torch.dtype,
        gated: bool = True,
        gains: SeaGains | None = None,
    ):
        """`gated` False: the trajectory has no noisy vision frame (inverse dynamics), hence no indicator: every
        step runs in full and records nothing, as diffusers' SeaCache fails open there. `gains`: the engine's
        filter gains (None: each step computes its own)."""
        self.params, self.sigmas, self.dtype, self.gated, self.gains = params, sigmas, dtype, gated, gains
        self.branches = [_Branch() for _ in range(branches)]
        self.previous: torch.Tensor | None = None  # the last step's indicator [T, H, W, C]

    def _run_limit(self, branch: _Branch) -> bool:
        """This branch has reused `max_consecutive_cached` times in a row: it runs in full."""
        limit = self.params.max_consecutive_cached
        return bool(limit and branch.consecutive >= limit)

    def measure(self, latents: torch.Tensor, step: int) -> torch.Tensor | None:
        """latents [1, C, T, H, W] at `step` (clean frames included, as the pipeline passes them) → the relative L1
        distance to the last step's indicator, a 0-d fp32 tensor on their device; None when every branch is forced
        to run in full (nothing to read back). The indicator is built from the latents in the model dtype, as the
        pipeline's transformer receives them."""
        p = self.params
        if not self.gated:
            return None
        forced = step < p.retention_steps or step >= len(self.sigmas) - p.cache_end_steps or self.previous is None
        indicator = sea_filter(latents[0].to(self.dtype).movedim(0, -1), self.sigmas[step], p.power_exp, self.gains)
        distance = None
        if not forced and not all(self._run_limit(b) for b in self.branches):
            prev = self.previous.float()  # type: ignore[union-attr]
            distance = (indicator.float() - prev).abs().mean() / (prev.abs().mean() + 1e-16)
        self.previous = indicator  # whatever the decision, as diffusers keeps it
        return distance

    def decide(self, step: int, distance: float | None) -> tuple[torch.Tensor | None, ...]:
        """`measure`'s distance, on the host → per branch the residual this step reuses ([N + T_s + T_a, hidden],
        model dtype), or None: run in full."""
        p, out = self.params, []
        for branch in self.branches:
            # no distance: a step every branch runs in full (first/last steps, no previous indicator)
            reuse = distance is not None and not self._run_limit(branch)
            if reuse:
                candidate = branch.accumulated + distance  # type: ignore[operator]
                # a non-finite distance fails open (runs in full), as diffusers' invalid gate does
                reuse = math.isfinite(distance) and candidate < p.threshold  # type: ignore[arg-type]
            if not reuse or not branch.history:  # a full step (or no residual yet) resets the budget
                branch.accumulated = 0.0
                out.append(None)
                continue
            branch.accumulated = candidate
            branch.consecutive += 1
            branch.skipped.append(step)
            out.append(self._residual(step, branch.history[-(p.residual_order + 1) :]))
        return tuple(out)

    @staticmethod
    def _residual(step: int, history: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        latest_step, latest = history[-1]
        if len(history) < 2:
            return latest
        previous_step, previous = history[-2]
        if latest_step == previous_step:
            return latest
        # linear extrapolation in the residual's dtype, as diffusers computes it
        return latest + (latest - previous) * ((step - latest_step) / (latest_step - previous_step))

    def record(self, step: int, residuals: list[torch.Tensor | None]) -> None:
        """After the forward: each full branch's block-stack residual (None for a reusing branch)."""
        keep = self.params.residual_order + 1
        if not self.gated:  # never reused: keep nothing
            return
        for branch, residual in zip(self.branches, residuals):
            if residual is None:
                continue
            branch.consecutive = 0
            branch.history = [*branch.history, (step, residual)][-keep:]

    @property
    def skipped(self) -> dict[str, list[int]]:
        """Per branch name the 0-based steps that reused a residual: the `done` event's `cache_skipped` (with AR
        windows, one of these per window)."""
        names = dict(zip(BRANCH_NAMES, self.branches))
        return {name: list(names[name].skipped) if name in names else [] for name in BRANCH_NAMES}


def host_distances(distances: list[torch.Tensor | None]) -> list[float | None]:
    """The tick's distances on the host, in one device-to-host copy (the decisions need them before the rows)."""
    present = [d for d in distances if d is not None]
    if not present:
        return [None] * len(distances)
    values = iter(torch.stack(present).tolist())
    return [None if d is None else next(values) for d in distances]
