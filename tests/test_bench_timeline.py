"""`bench.timeline`'s analysis of a trace (no GPU: a trace written here): each denoise phase's kernel time by class."""

from __future__ import annotations

import json

from bench.timeline import analyze, kernel_class


def test_kernel_time_is_split_by_class_within_each_denoise_phase(tmp_path, capsys):
    def kernel(name: str, ts: int, dur: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "phase:prefill", "ts": 0, "dur": 100, "tid": 1},
        kernel("nvjet_tst_256x128_64x4_2x1_v_bz_TNT", 10, 50),  # prefill's: not a denoise phase's
        {"ph": "X", "cat": "user_annotation", "name": "phase:denoise 0", "ts": 100, "dur": 1000, "tid": 1},
        kernel("nvjet_tst_256x128_64x4_2x1_v_bz_TNT", 110, 400),
        kernel("void flashinfer::BatchPrefillWithRaggedKVCacheKernel<...>", 520, 300),
        kernel("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", 830, 60),
        kernel("void at::native::index_elementwise_kernel<128, 4>", 900, 40),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    analyze(str(trace), 3)
    out = capsys.readouterr().out
    section = out[out.index("== denoise 0: kernels by class") :]
    assert "(800.0 ms" not in section and "0.8 ms of kernel time" in section  # prefill's GEMM not counted
    lines = {line.split()[0]: line for line in section.splitlines()[1:5]}
    assert "0.4 ms" in lines["gemm"] and "50.0%" in lines["gemm"]
    assert "0.3 ms" in lines["attention"] and "37.5%" in lines["attention"]
    assert [kernel_class(e["name"]) for e in events[3:] if e["cat"] == "kernel"] == [
        "gemm", "attention", "fused (inductor)", "copy, index, cat"
    ]  # fmt: skip
