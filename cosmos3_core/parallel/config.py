"""The deployment's `parallel:` block: how one server's GPUs share each request. Plain data, no torch.distributed.

  parallel: {cfg: 1|2, ulysses: 1|2|4|8, vae: N}

- `cfg`: CFG-parallel. Each request's CFG branches (cond, uncond) are computed on different rank groups.
- `ulysses`: sequence parallel inside one branch: every rank of a group runs the linears over 1/ulysses of the
  packed rows and, for attention, exchanges them (all-to-all) for all rows of 1/ulysses of the heads; the K/V
  pool is sharded by K/V heads.
- `vae`: the VAE decode split by rows of the frame over that many ranks (halo exchange per convolution).
The denoise ranks are `cfg × ulysses` (rank = cfg_index · ulysses + ulysses_index), the decode ranks the first
`vae` of them; a group spans `max(cfg × ulysses, vae)` ranks, one per visible GPU on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CFG = (1, 2)
ULYSSES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ParallelConfig:
    cfg: int = 1
    ulysses: int = 1
    vae: int = 1

    def __post_init__(self) -> None:
        if self.cfg not in CFG:
            raise ValueError(f"parallel.cfg: must be one of {CFG}, got {self.cfg!r}")
        if self.ulysses not in ULYSSES:
            raise ValueError(f"parallel.ulysses: must be one of {ULYSSES}, got {self.ulysses!r}")
        if not isinstance(self.vae, int) or isinstance(self.vae, bool) or not 1 <= self.vae <= 8:
            raise ValueError(f"parallel.vae: must be an integer from 1 to 8, got {self.vae!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ParallelConfig:
        raw = raw or {}
        if not isinstance(raw, dict) or set(raw) - {"cfg", "ulysses", "vae"}:
            raise ValueError(f"parallel: keys are cfg, ulysses, vae; got {raw!r}")
        return cls(**raw)

    @property
    def denoise_ranks(self) -> int:
        return self.cfg * self.ulysses

    @property
    def ranks(self) -> int:
        return max(self.denoise_ranks, self.vae)

    def check_model(self, heads: int, kv_heads: int) -> None:
        """Ulysses splits query heads evenly; each rank's query heads must map onto whole K/V heads."""
        u = self.ulysses
        if heads % u or (kv_heads % u and u % kv_heads):
            raise ValueError(
                f"parallel.ulysses: {u} must divide the model's {heads} attention heads and divide or be a multiple "
                f"of its {kv_heads} K/V heads"
            )

    def kv_heads_of(self, index: int, heads: int, kv_heads: int) -> tuple[int, int]:
        """The K/V heads [lo, hi) that Ulysses rank `index` attends with (GQA: query head h reads K/V head
        h // (heads / kv_heads)); ranks share a K/V head when ulysses > kv_heads."""
        per, group = heads // self.ulysses, heads // kv_heads
        return (index * per) // group, ((index + 1) * per - 1) // group + 1


# NVLink multicast stays off in every process of a group (and in anything they start): on the shared multi-GPU
# hosts a program that uses it can take the host's GPUs out of service
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
