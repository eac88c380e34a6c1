"""Offline CLI: bad arguments print one clear line and exit 2; outputs in each format."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from cosmos3_core.generate import main

SMALL = ["--height", "32", "--width", "32", "--num-frames", "5", "--steps", "2"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--height", "40"], "height: must be a multiple of 16"),
        (["--num-frames", "6"], "num_frames: must be 1 mod 4"),
        (["--steps", "0"], "steps: must be in [1,"),
        (["--guidance", "nan"], "guidance_scale: must be a finite number"),
        (["--image", "/nonexistent.png"], "image: cannot read"),
        (["--out", "x.gif"], "out: suffix must be one of"),
        (["--set", "precision"], "--set 'precision': expected KEY=YAML"),
        (["--set", "bogus=1"], "unknown keys ['bogus']"),
        (["--set", "graph_buckets=null"], "a null value cannot override a key"),
    ],
)
def test_bad_arguments_exit_2(nano_ckpt, tmp_path, capsys, extra, message):
    args = ["--checkpoint", str(nano_ckpt), "--prompt", "p", "--out", str(tmp_path / "o.npy"), *SMALL, *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_missing_checkpoint_exit_2_subprocess(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "cosmos3_core.generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "p",
         "--out", str(tmp_path / "o.mp4")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "checkpoint directory not found" in r.stderr


@pytest.mark.parametrize("suffix", [".mp4", ".png", ".npy"])
def test_outputs(nano_ckpt, tmp_path, suffix):
    out = tmp_path / f"o{suffix}"
    assert main(["--checkpoint", str(nano_ckpt), "--prompt", "p", "--out", str(out), *SMALL]) == 0
    assert out.stat().st_size > 0
    if suffix == ".mp4":
        import imageio.v3 as iio

        frames = iio.imread(out)
        assert frames.shape == (5, 32, 32, 3)
    if suffix == ".npy":
        assert np.load(out).shape == (5, 32, 32, 3)


def test_cli_and_server_default_to_the_same_deployment():
    """The same flags give the same video from `generate` and `serve`: both read configs/tiny.yaml unless told."""
    from cosmos3_core import generate
    from cosmos3_core.deployment import DEFAULT_CONFIG, Deployment
    from cosmos3_core.triton import serve

    cli = generate.build_parser().parse_args(["--prompt", "p", "--out", "x.npy"])
    server = serve.build_parser().parse_args([])
    assert cli.config == server.config == str(DEFAULT_CONFIG) and DEFAULT_CONFIG.is_file()
    defaults = Deployment.load(DEFAULT_CONFIG).defaults
    # the embedded default sets sizes and steps for a CPU, nothing that departs from the reference's sampling
    assert (defaults.fps, defaults.t2v.guidance_scale, defaults.t2v.shift) == (24.0, 6.0, None)


def test_the_server_takes_set_as_the_cli_and_the_plan_do(tmp_path, capsys):
    """`serve --set KEY=YAML` overrides a config key in what the parts load (the rendered deployment); a malformed
    one is one error line and exit 2."""
    import yaml

    from cosmos3_core.triton import serve

    assert serve.main(["--render-only", "--workdir", str(tmp_path / "a"), "--set", "max_queue=7"]) == 0
    assert yaml.safe_load((tmp_path / "a" / "deployment.yaml").read_text())["max_queue"] == 7
    capsys.readouterr()
    assert serve.main(["--render-only", "--workdir", str(tmp_path / "b"), "--set", "max_queue"]) == 2
    assert capsys.readouterr().err.strip() == "error: --set 'max_queue': expected KEY=YAML, e.g. precision=fp8"
