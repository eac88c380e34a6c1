"""Initial noise, per-request schedulers and classifier-free guidance.

Noise is drawn on the CPU from `torch.Generator().manual_seed(seed)` in fp32 (so a seed gives the same
latents on any device, and the same as the reference pipeline given a CPU generator), then moved.
Each request owns its scheduler (UniPC keeps multistep history on the instance). Its step coefficients are computed
on the host (`Scheduler.host_sigmas`), so a step launches only the ops on the latents (fp32, the shape the engine
steps: `[1, C, T, H, W]`) and never waits on the device. `sigmas` also live on the latents' device for the methods
this does not replace: diffusers moves each sigma it reads with `.to(device)`, and from the CPU that is a blocking copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler


class Scheduler(UniPCMultistepScheduler):
    """diffusers' UniPC, its coefficient maths on the host. diffusers computes each step's coefficients (the
    sigmas' log-SNRs, h, the phi terms, the rhos from a `torch.linalg.solve`) as ~80 ops on 0-d tensors on the
    sigmas' device: on CUDA each is a kernel launch, and the solve reads its error flag back (a sync). Here the same
    ops, in the same order and dtype, run on `host_sigmas` (the CPU copy `set_timesteps` leaves), and only the ops
    on the latents reach the device, ~30 a step: the same values on the CPU bit for bit, on CUDA within an fp32 unit
    of the coefficients (CUDA's and the CPU's log/expm1 may round apart). Configurations this does not cover
    (`solver_p`, thresholding, prediction types but flow) run diffusers' own methods."""

    host_sigmas: torch.Tensor

    def set_timesteps(self, *args: Any, **kwargs: Any) -> None:
        super().set_timesteps(*args, **kwargs)
        self.host_sigmas = self.sigmas.cpu()  # diffusers leaves them on the CPU; make_scheduler moves `sigmas`

    def _own(self) -> bool:
        c = self.config
        return (self.solver_p is None and not c.thresholding and c.solver_type in ("bh1", "bh2")
                and (c.prediction_type == "flow_prediction") == self.predict_x0)  # fmt: skip

    def convert_model_output(self, model_output: torch.Tensor, *args: Any, sample: torch.Tensor = None, **kwargs: Any):
        if args or kwargs or not self._own():
            return super().convert_model_output(model_output, *args, sample=sample, **kwargs)
        return sample - self.host_sigmas[self.step_index] * model_output  # flow: x0 = x - sigma * v

    def _host_terms(self, t: int, s0: int, previous: list[int], order: int) -> tuple[torch.Tensor, ...]:
        """multistep_uni_{p,c}_bh_update's coefficients on the host: t the target sigma's index, s0 the last model
        output's, `previous` the earlier outputs'."""

        def log_snr(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            alpha, sigma = self._sigma_to_alpha_sigma_t(self.host_sigmas[i])
            return alpha, sigma, torch.log(alpha) - torch.log(sigma)

        alpha_t, sigma_t, lambda_t = log_snr(t)
        alpha_s0, sigma_s0, lambda_s0 = log_snr(s0)
        h = lambda_t - lambda_s0
        rks = [(log_snr(si)[2] - lambda_s0) / h for si in previous]
        hh = -h if self.predict_x0 else h
        h_phi_1 = torch.expm1(hh)  # h\phi_1(h) = e^h - 1
        h_phi_k = h_phi_1 / hh - 1
        B_h = hh if self.config.solver_type == "bh1" else torch.expm1(hh)
        powers, R, b, factorial_i = torch.stack([*rks, torch.ones(())]), [], [], 1
        for i in range(1, order + 1):
            R.append(torch.pow(powers, i - 1))
            b.append(h_phi_k * factorial_i / B_h)
            factorial_i *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial_i
        return (
            alpha_t,
            sigma_t,
            alpha_s0,
            sigma_s0,
            h_phi_1,
            B_h,
            torch.stack(rks) if rks else None,
            torch.stack(R),
            torch.stack(b),
        )

    def multistep_uni_p_bh_update(
        self, model_output: torch.Tensor, *args: Any, sample: torch.Tensor = None, order: int = None, **kwargs: Any
    ) -> torch.Tensor:
        if args or kwargs or not self._own():
            return super().multistep_uni_p_bh_update(model_output, *args, sample=sample, order=order, **kwargs)
        i = self.step_index
        terms = self._host_terms(i + 1, i, [i - k for k in range(1, order)], order)
        rks, R, b = terms[6:]
        rhos_p = None
        if rks is not None:  # for order 2, diffusers' simplified version
            rhos_p = torch.ones(1, dtype=sample.dtype) * 0.5 if order == 2 else torch.linalg.solve(R[:-1, :-1], b[:-1])
        return self._close(sample, terms, rhos_p, None)

    def multistep_uni_c_bh_update(
        self,
        this_model_output: torch.Tensor,
        *args: Any,
        last_sample: torch.Tensor = None,
        this_sample: torch.Tensor = None,
        order: int = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if args or kwargs or not self._own():
            return super().multistep_uni_c_bh_update(
                this_model_output, *args, last_sample=last_sample, this_sample=this_sample, order=order, **kwargs
            )
        i = self.step_index
        terms = self._host_terms(i, i - 1, [i - (k + 1) for k in range(1, order)], order)
        R, b = terms[7:]
        # for order 1, diffusers' simplified version; else the solve, on the host: no error flag to read back
        rhos_c = torch.ones(1, dtype=last_sample.dtype) * 0.5 if order == 1 else torch.linalg.solve(R, b)
        rhos_c = rhos_c.to(last_sample.dtype)
        last = rhos_c[-1] * (this_model_output - self.model_outputs[-1])  # rho_t D1_t
        return self._close(last_sample, terms, rhos_c[:-1] if terms[6] is not None else None, last)

    def _close(
        self, x: torch.Tensor, terms: tuple, rhos: torch.Tensor | None, last: torch.Tensor | None
    ) -> torch.Tensor:
        """Both updates' closing lines, diffusers' ops in its order: x_t = x_t_ - c B_h (sum_k rho_k D1_k [+ rho_t D1_t]),
        with D1_k = (m_k - m0) / r_k over the earlier model outputs."""
        alpha_t, sigma_t, alpha_s0, sigma_s0, h_phi_1, B_h, rks = terms[:7]
        m0 = self.model_outputs[-1]
        res: torch.Tensor | int = 0
        if rks is not None:
            D1s = torch.stack([(self.model_outputs[-(k + 2)] - m0) / rk for k, rk in enumerate(rks)], dim=1)
            res = torch.einsum("k,bkc...->bc...", _to_device(rhos.to(x.dtype), x.device), D1s)  # type: ignore[union-attr]
        if last is not None:
            res = res + last
        if self.predict_x0:
            x_t = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0 - alpha_t * B_h * res
        else:
            x_t = alpha_t / alpha_s0 * x - sigma_t * h_phi_1 * m0 - sigma_t * B_h * res
        return x_t.to(x.dtype)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A few host values to the device without a sync: from pinned memory, asynchronously on CUDA."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def initial_noise(shape: tuple[int, ...], seed: int, device: torch.device | str) -> torch.Tensor:
    return initial_noise_bands([shape], seed, device)[0]


def initial_noise_bands(shapes: list[tuple[int, ...]], seed: int, device: torch.device | str) -> list[torch.Tensor]:
    """One noise tensor per shape, drawn in order from one generator: the pipeline's order is vision (its full latent
    shape, clean frames included), then sound `[sound_dim, T]`, then action `[chunk, action_dim]` (P:950-988)."""
    gen = torch.Generator("cpu").manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float32).to(device) for shape in shapes]


def checkpoint_shift(base_config: dict[str, Any]) -> float:
    """The flow_shift the reference pipeline samples with: the scheduler config's (or the class default)."""
    return float(Scheduler.from_config(base_config).config.flow_shift)


def make_scheduler(
    base_config: dict[str, Any], steps: int, shift: float | None, native_flow_schedule: bool, device: torch.device | str
) -> Scheduler:
    overrides = {} if shift is None else {"flow_shift": float(shift)}
    sched = Scheduler.from_config(base_config, **overrides)
    if native_flow_schedule:
        # sigmas linspaced from 1 - 1/T to 0, as the Edge checkpoints are sampled
        sigmas = np.linspace(1.0 - 1.0 / sched.config.num_train_timesteps, 0.0, steps + 1)[:-1]
        sched.set_timesteps(steps, device=device, sigmas=sigmas)
    else:
        sched.set_timesteps(steps, device=device)
    sched.sigmas = sched.sigmas.to(device)  # the same values; UniPC's `.to(device)` of each becomes a no-op
    sched.set_begin_index(0)  # else the first step looks its timestep up with `nonzero` (a host sync)
    return sched


def guided_velocity(branches: list[torch.Tensor], guidance: float) -> torch.Tensor:
    """branches: [cond] or [cond, uncond] velocities (fp32) → the guided velocity."""
    if len(branches) == 1:
        return branches[0]
    cond, uncond = branches
    return uncond + guidance * (cond - uncond)
