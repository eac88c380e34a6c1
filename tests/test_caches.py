"""The kernel caches: one root, explicit folders win, and the server's environment carries them to the stubs;
FlashInfer's modules built ahead: per GPU arch, the ones the deployment loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from cosmos3_core.caches import KERNEL_CACHE_VARS, cache_root, cuda_arch, flashinfer_aot_dir, use_kernel_caches
from cosmos3_core.deployment import Deployment
from cosmos3_core.tools.warm import flashinfer_kernels
from cosmos3_core.triton.launcher import server_env

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_kernel_caches_fill_only_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path))
    env = {"COSMOS3_CACHE": str(tmp_path), "TRITON_CACHE_DIR": "/elsewhere"}  # a mapping's own root
    folders = use_kernel_caches(env)
    assert cache_root() == tmp_path
    assert folders["TRITON_CACHE_DIR"] == "/elsewhere"
    assert folders["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kernels" / "inductor")
    assert folders["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "kernels" / "flashinfer")
    assert set(env) == {*KERNEL_CACHE_VARS, "COSMOS3_CACHE"}


def test_every_server_environment_carries_the_kernel_caches(monkeypatch, tmp_path):
    """`server_env` (every launch: serve, the benchmarks, the tests) names the caches under the environment's
    $COSMOS3_CACHE; a folder named already wins."""
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path))
    for var in KERNEL_CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    env = server_env(tritonserver=tmp_path / "tritonserver")
    assert {var: env[var] for var in KERNEL_CACHE_VARS} == {
        var: str(tmp_path / "kernels" / sub) for var, sub in KERNEL_CACHE_VARS.items()
    }
    base = {"COSMOS3_CACHE": str(tmp_path / "other"), "TRITON_CACHE_DIR": "/elsewhere"}
    env = server_env(base, tritonserver=tmp_path / "tritonserver")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "other" / "kernels" / "inductor")
    assert env["TRITON_CACHE_DIR"] == "/elsewhere"
    assert "TORCHINDUCTOR_CACHE_DIR" not in base  # the caller's mapping is not changed


def test_flashinfer_modules_built_ahead_are_kept_per_gpu_arch(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "fi"))
    assert [cuda_arch(9, 0), cuda_arch(8, 9), cuda_arch(10, 0)] == ["9.0a", "8.9", "10.0a"]  # as flashinfer targets
    assert flashinfer_aot_dir(cuda_arch(9, 0)) == tmp_path / "fi" / "aot" / "sm90a"


def test_warm_builds_the_flashinfer_modules_the_deployment_loads():
    edge = Deployment.load(CONFIGS / "bench_edge.yaml")
    assert flashinfer_kernels(edge, 128, "9.0a") == [("fa3", torch.bfloat16, 128, False)]
    assert flashinfer_kernels(edge, 128, "8.0") == [("fa2", torch.bfloat16, 128, False)]
    assert flashinfer_kernels(edge, 96, "9.0a") == [("fa2", torch.bfloat16, 96, False)]  # fa3: head_dim 64/128/256
    assert flashinfer_kernels(Deployment(), 128, "9.0a") == [("fa3", torch.bfloat16, 128, False)]  # auto: as on a GPU
    assert flashinfer_kernels(replace(edge, dtype="float16"), 128, "9.0a") == [("fa3", torch.float16, 128, False)]
    assert flashinfer_kernels(replace(edge, attention="sdpa"), 128, "9.0a") == []
    assert flashinfer_kernels(Deployment.load(CONFIGS / "tiny.yaml"), 128, "9.0a") == []  # CPU, fp32
