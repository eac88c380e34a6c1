"""Shared fixtures: tiny random checkpoints (written by our own tool) and the diffusers oracle."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from cosmos3_core.tools.make_tiny import make_tiny

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {v: make_tiny(root / v, variant=v, seed=7) for v in ("nano", "edge")}


@pytest.fixture(scope="session")
def nano_ckpt(tiny_ckpts) -> Path:
    return tiny_ckpts["nano"]


@pytest.fixture(scope="session")
def test_image() -> np.ndarray:
    """A smooth RGB image of a size that needs resize + crop (40x56)."""
    yy, xx = np.mgrid[0:40, 0:56]
    img = np.stack([xx * 4, yy * 6, (xx + yy) * 2], axis=-1)
    return np.clip(img, 0, 255).astype(np.uint8)


def reference_pipeline(ckpt: Path):
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(ckpt, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_reference(pipe, prompt: str, params: dict, image=None, output_type: str = "latent"):
    """The diffusers pipeline with the same request (shift goes into its scheduler config)."""
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, flow_shift=params["shift"])
    templates = params.get("add_templates", True)
    return pipe(
        prompt=prompt,
        negative_prompt=params.get("negative_prompt"),
        image=image,
        num_frames=params["num_frames"],
        height=params["height"],
        width=params["width"],
        fps=params.get("fps", 24.0),
        num_inference_steps=params["steps"],
        guidance_scale=params["guidance_scale"],
        generator=torch.Generator().manual_seed(params["seed"]),
        output_type=output_type,
        use_system_prompt=params.get("use_system_prompt"),
        add_resolution_template=templates,
        add_duration_template=templates,
        enable_safety_check=False,
    ).video


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
