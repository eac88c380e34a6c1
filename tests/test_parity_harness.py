"""bench.parity on the tiny preset (CPU, fp32 against fp32): the harness runs end to end, its numbers are sane,
its pass/fail logic holds, and the checkpoint writer's LLM-like weights load in diffusers and in ours alike."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bench import parity


def test_pass_fail_logic():
    assert parity.passes(0.0705, 0.0700)  # ratio 1.007
    assert parity.passes(0.0735, 0.0700)  # exactly at 1.05
    assert not parity.passes(0.0740, 0.0700)  # 1.057
    assert parity.passes(5e-5, 0.0) and not parity.passes(2e-4, 0.0)  # fp32 against fp32: the floor decides
    assert parity.passes(0.072, 0.07, bar=1.05) and not parity.passes(0.072, 0.07, bar=1.01)


def test_metrics():
    a = np.full((2, 4, 4, 3), 100, np.uint8)
    assert parity.psnr(a, a) == math.inf
    assert parity.psnr(a, a + 1) == pytest.approx(20 * math.log10(255))
    x = torch.ones(10)
    assert parity.rel_l2(x * 1.1, x) == pytest.approx(0.1)


def test_cases_and_selection():
    names = [c.name for c in parity.cases_for("edge")]
    assert len(names) == len(set(names)) == 16 and "i2v-33f-8s-flow" in names
    assert [c.name for c in parity.select("edge", ["t2v-9f-4s-*"])] == ["t2v-9f-4s-native", "t2v-9f-4s-flow"]
    with pytest.raises(SystemExit):
        parity.select("edge", ["nothing"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    import os

    tmp = tmp_path_factory.mktemp("parity")
    old = os.environ.get("COSMOS3_CACHE")
    os.environ["COSMOS3_CACHE"] = str(tmp / "cache")
    try:
        out = tmp / "run.json"
        result = parity.main(["--preset", "tiny", "--device", "cpu", "--cases", "t2v-5f-4s-native", "i2v-5f-4s-flow",
                              "--json", str(out)])  # fmt: skip
    finally:
        if old is None:
            os.environ.pop("COSMOS3_CACHE")
        else:
            os.environ["COSMOS3_CACHE"] = old
    return result, out, tmp


def test_tiny_harness_fp32_against_fp32(tiny_run):
    result, _, _ = tiny_run
    assert result["dtype"] == "float32" and result["variants"] == ["sdpa"]
    assert list(result["cases"]) == ["t2v-5f-4s-native", "i2v-5f-4s-flow"]
    for row in result["cases"].values():
        runs = row["runs"]
        assert runs["diffusers"]["rel_l2"] == 0.0  # diffusers fp32 twice on the CPU: the same numbers
        assert runs["sdpa"]["rel_l2"] < 1e-5  # ours in fp32 against diffusers in fp32
        assert runs["sdpa"]["psnr_db"] > 60 and runs["sdpa"]["backend"] == "sdpa"
        assert row["pass"]


def test_report_and_markdown(tiny_run, tmp_path):
    from bench.report import SECTION

    result, saved, _ = tiny_run
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# Benchmarks\n\n## Earlier\n\ntext\n\n{SECTION}\n\n| row |\n")
    parity.main(["--report", str(saved), "--md", str(md)])
    parity.main(["--report", str(saved), "--md", str(md)])
    text = md.read_text()
    assert text.index("## Earlier") < text.index(parity.HEADING) < text.index(SECTION)  # rows section stays last
    assert text.count(parity.HEADING) == 1 and text.count("### tiny") == 2
    assert "| t2v-5f-4s-native | 0.000 % |" in text and "2/2 cases pass" in text
    assert json.loads(saved.read_text())["cases"].keys() == result["cases"].keys()


def test_a_second_run_reuses_the_fp32_reference(tiny_run, monkeypatch):
    """The fp32 references are kept under the checkpoint: a second run on one of the cases skips the fp32 phase
    and gets the same numbers; a case not run before still runs it."""
    result, _, tmp = tiny_run
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp / "cache"))
    again = parity.main(["--preset", "tiny", "--device", "cpu", "--cases", "t2v-5f-4s-native"])
    assert again["timings"]["diffusers_fp32_s"] == 0.0
    first, second = result["cases"]["t2v-5f-4s-native"]["runs"], again["cases"]["t2v-5f-4s-native"]["runs"]
    assert second["sdpa"]["rel_l2"] == first["sdpa"]["rel_l2"] and second["diffusers"]["rel_l2"] == 0.0
    new = parity.main(["--preset", "tiny", "--device", "cpu", "--cases", "t2v-5f-4s-native", "t2v-5f-8s-native"])
    assert new["timings"]["diffusers_fp32_s"] > 0 and new["cases"]["t2v-5f-8s-native"]["pass"]


def test_reference_path_is_keyed_on_everything_the_reference_depends_on(tmp_path):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "transformer" / "config.json").write_text('{"num_layers": 2}')
    case, other = parity.select("tiny", ["t2v-5f-4s-native", "t2v-5f-8s-native"])
    p = parity.params_of(case, "tiny", 0)
    path = parity.reference_path(tmp_path, case, p, "cpu")
    assert path == parity.reference_path(tmp_path, case, dict(p), "cpu")
    others = {parity.reference_path(tmp_path, other, p, "cpu"), parity.reference_path(tmp_path, case, p, "cuda"),
              parity.reference_path(tmp_path, case, p | {"seed": 1}, "cpu")}  # fmt: skip
    (tmp_path / "transformer" / "config.json").write_text('{"num_layers": 2, "action_gen": true}')  # a part added
    others.add(parity.reference_path(tmp_path, case, p, "cpu"))
    assert path not in others and len(others) == 4


def test_weights_are_llm_like_and_load_in_both(tiny_run):
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.layers import GEN, UND

    _, _, tmp = tiny_run
    root = tmp / "cache" / "parity-tiny-s0"
    stored = load_file(root / "transformer" / "diffusion_pytorch_model.safetensors")
    assert torch.equal(stored["layers.0.input_layernorm.weight"].float(), torch.ones(64))
    assert not stored["proj_in.bias"].any()
    w = stored["layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.bfloat16 and abs(w.float().std().item() - 0.02) < 0.002
    assert stored["time_embedder.linear_1.weight"].dtype == torch.float32
    ours = Checkpoint.open(root).load_transformer({GEN, UND}, "cpu", torch.float32).state_dict()
    assert all(torch.equal(v, stored[k].float()) for k, v in ours.items())
    flow = root.with_name(root.name + "-flow")  # the schedule override: a linked copy with its own model_index.json
    assert json.loads((flow / "model_index.json").read_text())["use_native_flow_schedule"] is False
    assert Checkpoint.open(flow).use_native_flow_schedule is False


def test_aggregate_over_seeds():
    per_seed = [
        {"rel_l2": 0.3, "psnr_db": 40.0, "backend": "sdpa"},
        {"rel_l2": 0.4, "psnr_db": 38.0, "backend": "sdpa"},
    ]
    agg = parity.aggregate(per_seed)
    assert agg["rel_l2"] == pytest.approx(math.sqrt((0.09 + 0.16) / 2)) and agg["rel_l2_range"] == [0.3, 0.4]
    assert agg["psnr_db"] == 38.0 and agg["backend"] == "sdpa" and agg["seeds"] == per_seed


def test_tiny_cache_and_seeds(tmp_path, monkeypatch):
    """--cache and --seeds on one 8-step case (fp32 against fp32): diffusers and ours skip the same branch-steps
    for each seed, the fp32 reference runs uncached, the aggregates are the RMS over the seeds."""
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path / "cache"))
    result = parity.main(["--preset", "tiny", "--device", "cpu", "--cases", "t2v-5f-8s-native", "--cache",
                          '{"policy": "sea"}', "--seeds", "2"])  # fmt: skip
    assert result["seeds"] == [0, 1] and result["cache"] == {"policy": "sea"}
    row = result["cases"]["t2v-5f-8s-native"]
    ours, theirs = row["runs"]["sdpa"], row["runs"]["diffusers"]
    assert [d["skipped"] for d in ours["seeds"]] == [d["skipped"] for d in theirs["seeds"]]
    assert ours["skip_frac"] == theirs["skip_frac"] > 0  # SeaCache reused some steps
    assert 0 < theirs["rel_l2"] < 1e-3  # cached against the uncached fp32 reference
    assert ours["rel_l2"] == pytest.approx(parity.rms([d["rel_l2"] for d in ours["seeds"]]))
    assert row["pass"] and ours["ratio"] == pytest.approx(1.0, abs=0.05)
    table = parity.table(result)
    assert "diffusers float32 + SeaCache" in table and "branch-steps skipped" in table and " [" in table
    assert 'SeaCache {"policy": "sea"}' in parity.summary(result) and "noise seeds 0–1" in parity.summary(result)
