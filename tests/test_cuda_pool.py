"""Triton's CUDA pool is sized so that every GPU tensor between the stages crosses on the device.

A Python model's GPU output or input larger than the pool (`--cuda-memory-pool-byte-size`, 64 MiB by default)
crosses through host shared memory, where the input of a decoupled model is freed when `execute` returns. Nano's
text K/V at an ordinary prompt is 70 MB; served Nano packs came back black that way (H200, 2026-12-02).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cosmos3_core.deployment import Deployment
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.triton.launcher import ServerConfig, server_command
from cosmos3_core.triton.serve import cuda_pool_bytes
from cosmos3_core.wire import max_text_kv_bytes

MIB = 1 << 20


def test_nano_text_kv_exceeds_tritons_default_pool():
    # Nano: 36 layers, 8 K/V heads of 128, bf16: the matrix's prompt (473 tokens, both branches) and the limit
    assert 2 * 36 * 473 * 8 * 128 * 2 > 64 * MIB
    assert max_text_kv_bytes(36, 8, 128, 2, 1024) == 288 * MIB


def test_a_gpu_deployment_gets_a_pool_for_its_largest_text_kv(nano_ckpt):
    d = Deployment.load("configs/tiny.yaml")
    assert cuda_pool_bytes(d) == 0  # the CPU: no pool
    gpu = dataclasses.replace(d, device="cuda", dtype="bfloat16", checkpoint=str(nano_ckpt))
    cfg = Checkpoint.open(nano_ckpt).config
    kv = max_text_kv_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 2, d.limits.max_prompt_tokens)
    need = (gpu.instances["prefill"] + gpu.instances["denoise"]) * kv + 64 * MIB
    assert cuda_pool_bytes(gpu) == -(-need // (64 * MIB)) * 64 * MIB


def test_the_pool_reaches_tritonserver():
    cfg = ServerConfig(Path("repo"), 1, 2, 3, cuda_pool_bytes=640 * MIB)
    assert f"--cuda-memory-pool-byte-size=0:{640 * MIB}" in server_command(cfg, Path("ts"), Path("be"))
    cpu = dataclasses.replace(cfg, cpu_only=True)
    assert not any("cuda-memory-pool" in a for a in server_command(cpu, Path("ts"), Path("be")))
