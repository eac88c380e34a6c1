"""The kernel caches: one root, explicit folders win, and the server's environment carries them to the stubs."""

from __future__ import annotations

from cosmos3_core.caches import KERNEL_CACHE_VARS, cache_root, use_kernel_caches
from cosmos3_core.triton.launcher import server_env


def test_kernel_caches_fill_only_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path))
    env = {"TRITON_CACHE_DIR": "/elsewhere"}
    folders = use_kernel_caches(env)
    assert cache_root() == tmp_path
    assert folders["TRITON_CACHE_DIR"] == "/elsewhere"
    assert folders["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kernels" / "inductor")
    assert folders["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "kernels" / "flashinfer")
    assert set(env) == set(KERNEL_CACHE_VARS)


def test_the_stubs_inherit_the_kernel_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path))
    for var in KERNEL_CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    use_kernel_caches()
    env = server_env(tritonserver=tmp_path / "tritonserver")
    assert env["FLASHINFER_WORKSPACE_BASE"] == str(tmp_path / "kernels" / "flashinfer")
