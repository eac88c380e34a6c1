"""Our CLI vs diffusers' Cosmos3OmniPipeline on the same tiny checkpoint, seed and request (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosmos3_core.generate import main
from tests.conftest import reference_pipeline, rel_l2, run_reference

PROMPT = "a red cube slides across a wooden table"
CASES = {
    "t2i": dict(num_frames=1, height=64, width=32, steps=4, guidance_scale=4.0, shift=3.0, seed=1),
    "t2v": dict(num_frames=9, height=32, width=64, steps=4, guidance_scale=6.0, shift=10.0, seed=3, fps=16.0),
    "i2v": dict(num_frames=9, height=32, width=64, steps=4, guidance_scale=5.0, shift=8.0, seed=2),
    "t2v_odd_grid": dict(num_frames=5, height=48, width=80, steps=3, guidance_scale=5.0, shift=5.0, seed=6),  # 3×5 latents
    "t2v_guidance1": dict(num_frames=5, height=32, width=32, steps=3, guidance_scale=1.0, shift=5.0, seed=4),
    "t2v_plain": dict(num_frames=5, height=32, width=32, steps=3, guidance_scale=3.0, shift=5.0, seed=5,
                      use_system_prompt=False, add_templates=False, negative_prompt="blurry, static"),
}  # fmt: skip


def cli_args(ckpt, params: dict, out, image_path=None) -> list[str]:
    args = ["--checkpoint", str(ckpt), "--prompt", PROMPT, "--out", str(out)]
    flags = {"negative_prompt": "--negative-prompt", "num_frames": "--num-frames", "guidance_scale": "--guidance"}
    for k, v in params.items():
        if k == "use_system_prompt":
            args.append("--no-system-prompt")
        elif k == "add_templates":
            args.append("--no-templates")
        else:
            args += [flags.get(k, f"--{k}"), str(v)]
    if image_path is not None:
        args += ["--image", str(image_path)]
    return args


@pytest.mark.parametrize("variant", ["nano", "edge"])
@pytest.mark.parametrize("case", list(CASES))
def test_cli_latents_match_pipeline(tiny_ckpts, variant, case, tmp_path, test_image):
    import imageio.v2 as imageio

    ckpt, params = tiny_ckpts[variant], CASES[case]
    image_path = None
    if case == "i2v":
        image_path = tmp_path / "cond.png"
        imageio.imwrite(image_path, test_image)
    out = tmp_path / "latents.pt"
    assert main(cli_args(ckpt, params, out, image_path)) == 0
    ours = torch.load(out)
    ref = run_reference(reference_pipeline(ckpt), PROMPT, params, test_image if case == "i2v" else None)
    assert ours.shape == ref.shape
    assert rel_l2(ours, ref) <= 1e-4


def test_cli_frames_match_pipeline(nano_ckpt, tmp_path):
    params = CASES["t2v"]
    out = tmp_path / "video.npy"
    assert main(cli_args(nano_ckpt, params, out)) == 0
    ours = np.load(out)
    ref = run_reference(reference_pipeline(nano_ckpt), PROMPT, params, output_type="np")
    ref_u8 = np.round(ref * 255).astype(np.uint8)
    assert ours.dtype == np.uint8 and ours.shape == ref_u8.shape == (9, 32, 64, 3)
    # fp32 noise ~1e-6 may flip a rounding at .5; nothing more
    assert np.abs(ours.astype(int) - ref_u8.astype(int)).max() <= 1


def test_same_token_ids_as_pipeline(nano_ckpt):
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.prompts import PromptEncoder

    pipe = reference_pipeline(nano_ckpt)
    enc = PromptEncoder(Checkpoint.open(nano_ckpt).load_tokenizer())
    for frames, sys_prompt, templates in [(1, True, True), (9, None, True), (9, False, False)]:
        ours = enc.encode("ünïcödé prompt.", "neg", frames, 480, 832, 24.0, sys_prompt, templates)
        ref = pipe.tokenize_prompt("ünïcödé prompt.", "neg", num_frames=frames, height=480, width=832, fps=24.0,
                                   use_system_prompt=sys_prompt, add_resolution_template=templates,
                                   add_duration_template=templates)  # fmt: skip
        assert ours == tuple(ref) or list(ours) == list(ref)
