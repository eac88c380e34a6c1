"""torch.compile of the GEN layer stack: warmup through the real step, then other sizes never recompile."""

from __future__ import annotations

import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator
from tests.conftest import rel_l2


def test_warmup_then_no_recompile_and_equal_to_eager(nano_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path))  # compiled here, not loaded from an earlier run's artifacts
    warm = [
        {"num_frames": 9, "height": 32, "width": 64},
        {"num_frames": 1, "height": 32, "width": 32, "guidance_scale": 1.0},
    ]
    compiled = Generator(
        Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", compile=True, warmup_requests=warm)
    )
    eager = Generator(Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32"))
    params = {"num_frames": 5, "height": 64, "width": 96, "steps": 3, "seed": 4}  # a size warmup never saw
    # config.patch, not monkeypatch: monkeypatch's undo deletes the attribute, which torch's config module takes
    # as hiding the option, and the next recompile anywhere in the session then fails reading it
    with torch._dynamo.config.patch(error_on_recompile=True):
        served = compiled.latents("a served row of another size", params)
    assert rel_l2(served, eager.latents("a served row of another size", params)) < 1e-5


def test_a_restarted_engine_loads_the_gen_graphs_compiled_ahead(nano_ckpt, tmp_path, monkeypatch, capsys):
    """The two GEN graphs of a 16-bit model are compiled ahead once (`GenKernels.compiled(model, store)`); a later engine
    (a reloaded denoise stub) loads them and traces nothing, and serves the same latents."""
    from cosmos3_core.precompiled import Precompiled

    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path))
    d = Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", compile=True,
                   warmup_requests=[{"num_frames": 9, "height": 32, "width": 64}])  # fmt: skip
    params = {"num_frames": 5, "height": 64, "width": 96, "steps": 2, "seed": 4}
    first = Generator(d).latents("compiled ahead", params)
    store = tmp_path / "kernels" / "precompiled"
    artifacts = sorted(p.name.split("-")[0] for p in store.glob("_gen_*.bin"))
    assert artifacts == ["_gen_qkv", "_gen_residual"], artifacts

    def compiled_again(self, key, args):
        raise AssertionError(f"{self.fn.__name__} compiled again")

    monkeypatch.setattr(Precompiled, "_compile", compiled_again)
    capsys.readouterr()
    again = Generator(d).latents("compiled ahead", params)
    assert torch.equal(again, first)
    err = capsys.readouterr().err
    assert "is traced" not in err and "guards refuse" not in err and "did not load" not in err, err


def test_a_model_with_fp8_linears_is_traced_not_compiled_ahead(tmp_path):
    """An FP8 layer's W8A16/W8A8 split is `a16_rows`, which the ahead path drops (as 0): such a model is traced."""
    from cosmos3_core.model.fp8 import Fp8Linear
    from cosmos3_core.model.towers import GenKernels, _gen_qkv

    sixteen = torch.nn.Sequential(torch.nn.Linear(8, 8))
    fp8 = torch.nn.Sequential(torch.nn.Linear(8, 8), Fp8Linear(8, 8, False, True, torch.bfloat16))
    assert GenKernels.compiled(sixteen, tmp_path).qkv.__qualname__.startswith("_ahead")
    traced = GenKernels.compiled(fp8, tmp_path).qkv
    assert not traced.__qualname__.startswith("_ahead") and getattr(traced, "__wrapped__", None) is _gen_qkv
