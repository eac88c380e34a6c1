"""Initial noise, per-request schedulers and classifier-free guidance.

Noise is drawn on the CPU from `torch.Generator().manual_seed(seed)` in fp32 (so a seed gives the same
latents on any device, and the same as the reference pipeline given a CPU generator), then moved.
Each request owns its scheduler (UniPC keeps multistep history on the instance). Its sigmas live on the
latents' device: UniPC moves each sigma it reads with `.to(device)`, and from the CPU that is a blocking copy,
six per step, each leaving the GPU idle while the host catches up.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .caches import memo_json
from .from_diffusers import diffusers_imports, from_diffusers


class _SolveWithoutHostCheck(TorchFunctionMode):
    """Within it, on this thread only, `torch.linalg.solve` runs as `solve_ex`: the error flag stays on the
    device instead of being read back to the host (a sync)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.linalg.solve:
            return torch.linalg.solve_ex(*args, **(kwargs or {}))[0]
        return func(*args, **(kwargs or {}))


@functools.cache
def scheduler_class() -> type:
    """diffusers' UniPC with its corrector's solve made sync-free: `torch.linalg.solve` reads its error flag back
    to the host, a sync that leaves the GPU idle while the host launches the rest of the step. The corrector's
    matrix has distinct nodes, so it is never singular. The swap is a torch function mode, local to the calling
    thread and to this call: nothing process-wide changes. Made at first use: diffusers' import takes seconds,
    and the stubs that never sample (vae_decode) never pay it."""

    class Scheduler(from_diffusers("UniPCMultistepScheduler")):
        def multistep_uni_c_bh_update(self, *args, **kwargs) -> torch.Tensor:
            with _SolveWithoutHostCheck():
                return super().multistep_uni_c_bh_update(*args, **kwargs)

    with diffusers_imports():  # the first from_config imports its compatible schedulers' modules
        Scheduler.from_config({})
    return Scheduler


def initial_noise(shape: tuple[int, ...], seed: int, device: torch.device | str) -> torch.Tensor:
    return initial_noise_bands([shape], seed, device)[0]


def initial_noise_bands(shapes: list[tuple[int, ...]], seed: int, device: torch.device | str) -> list[torch.Tensor]:
    """One noise tensor per shape, drawn in order from one generator: the pipeline's order is vision (its full latent
    shape, clean frames included), then sound `[sound_dim, T]`, then action `[chunk, action_dim]` (P:950-988)."""
    gen = torch.Generator("cpu").manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float32).to(device) for shape in shapes]


def checkpoint_shift(base_config: dict[str, Any]) -> float:
    """The flow_shift the reference pipeline samples with: the scheduler config's (or the class default). Kept per
    config on this machine (`caches.memo_json`): the class needs diffusers' import, which a prefill that samples
    nothing would otherwise pay at every start and reload."""

    def shift() -> float:
        return float(scheduler_class().from_config(base_config).config.flow_shift)

    kept = memo_json("unipc-flow-shift", json.dumps(base_config, sort_keys=True, default=str), shift)
    return float(kept) if isinstance(kept, (int, float)) else shift()  # a memo of another shape: counted again


def make_scheduler(
    base_config: dict[str, Any], steps: int, shift: float | None, native_flow_schedule: bool, device: torch.device | str
) -> Any:  # the scheduler_class() instance
    overrides = {} if shift is None else {"flow_shift": float(shift)}
    sched = scheduler_class().from_config(base_config, **overrides)
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
