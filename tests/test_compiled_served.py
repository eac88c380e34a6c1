"""`compile: true` served through Triton's own stubs on the CPU: the stubs read torch's UTF-8 Inductor templates
(triton/stub.py: the embedded interpreter read text as ASCII, and such a deployment failed to load), the denoise
compiles its two GEN graphs ahead into the server's cache, and a reloaded denoise loads them (compiles nothing,
traces nothing) and serves again."""

from __future__ import annotations

import pytest

from bench.faults_part import Supervised, kill_part
from client.stream import generate

pytestmark = pytest.mark.served


def test_compile_true_serves_and_a_reloaded_denoise_loads_its_gen_graphs(served_deployment, tmp_path):
    cache = tmp_path / "cache"
    server = Supervised(str(served_deployment[0]), tmp_path / "serve",
                        {"COSMOS3_CACHE": str(cache), "COSMOS3_FAULTS": "step_delay_s=0.05"},
                        ["--set=compile=true"])  # fmt: skip
    try:
        server.wait_ready(600)
        first = generate(server.url, "compiled", {"steps": 2, "seed": 1}, timeout_s=300)
        assert first.events[-1]["type"] == "done"
        artifacts = {p: p.stat().st_mtime_ns for p in (cache / "kernels" / "precompiled").glob("_gen_*.bin")}
        assert sorted(p.name.split("-")[0] for p in artifacts) == ["_gen_qkv", "_gen_residual"]
        log_at = server.log_size()
        r = kill_part(server, "denoise", 40, seed=2, back_timeout_s=180)
        assert r["served_again_s"] is not None and r["restarts_total"] == 1, r
        after = {p: p.stat().st_mtime_ns for p in (cache / "kernels" / "precompiled").glob("_gen_*.bin")}
        assert after == artifacts  # loaded, not compiled again
        log = (server.workdir / "serve.log").read_bytes()[log_at:].decode(errors="replace")
        assert "is traced" not in log and "did not load" not in log and "guards refuse" not in log
    finally:
        server.stop()
