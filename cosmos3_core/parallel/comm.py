"""torch.distributed plumbing shared by rank 0 and the workers: the rank layout's subgroups, and commands.

A command is rank 0 telling every rank what to do next: a header (a small dict, `broadcast_object_list`) that
also lists the shapes and dtypes of the tensors that follow, then each tensor by `broadcast` (NCCL on CUDA, gloo on
the CPU). Bool tensors travel as uint8. Subgroups are made by every rank in the same order (`Comm.build`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import ParallelConfig


@dataclass
class Comm:
    """This rank's place in the layout. Mutable on rank 0: a restarted group refills the same object, so the
    plans and layouts that hold it reach the new subgroups."""

    rank: int
    parallel: ParallelConfig
    ulysses_group: Any = None  # the ranks of this rank's CFG group (None: WORLD, or not a denoise rank)
    decode_group: Any = None  # ranks < vae

    @property
    def cfg_index(self) -> int:
        return self.rank // self.parallel.ulysses

    @property
    def ulysses_index(self) -> int:
        return self.rank % self.parallel.ulysses

    @property
    def denoises(self) -> bool:
        return self.rank < self.parallel.denoise_ranks

    @property
    def decodes(self) -> bool:
        return self.rank < self.parallel.vae

    def build(self) -> None:
        """Make the subgroups. Collective: every rank calls it right after `init_process_group`."""
        p = self.parallel
        self.ulysses_group = self.decode_group = None
        for c in range(p.cfg):
            ranks = list(range(c * p.ulysses, (c + 1) * p.ulysses))
            group = dist.new_group(ranks) if p.ulysses > 1 else None
            if self.denoises and c == self.cfg_index:
                self.ulysses_group = group
        group = dist.new_group(list(range(p.vae))) if p.vae > 1 else None
        if self.decodes:
            self.decode_group = group


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def send_command(header: dict[str, Any], tensors: list[torch.Tensor], device: torch.device | str) -> None:
    """Rank 0: the header (with the tensors' specs added), then each tensor."""
    header = {**header, "specs": [(tuple(t.shape), str(t.dtype)) for t in tensors]}
    dist.broadcast_object_list([header], src=0, device=torch.device(device))
    for t in tensors:
        t = t.to(device)
        dist.broadcast((t.to(torch.uint8) if t.dtype == torch.bool else t).contiguous(), src=0)


def recv_command(device: torch.device | str) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A worker: the next command's header and tensors (on `device`)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, device=torch.device(device))
    header, tensors = box[0], []
    for shape, name in header["specs"]:
        dtype = _dtype(name)
        t = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=device)
        dist.broadcast(t, src=0)
        tensors.append(t.bool() if dtype == torch.bool else t)
    return header, tensors


def all_gather_rows(x: torch.Tensor, group: Any, sizes: list[int], dim: int = 0) -> torch.Tensor:
    """Each rank's `x` (its `sizes[rank]` entries along `dim`) → all ranks' in rank order. Uneven sizes are padded
    to the largest for the collective and trimmed after."""
    n = max(sizes)
    if x.shape[dim] < n:
        pad = list(x.shape)
        pad[dim] = n - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim)
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)
