"""The Cosmos guardrail's video check as the decode stage runs it (`safety.CosmosVideoBatched`: frames in batches,
one RetinaFace forward a batch, a short batch padded) against the package's own `CosmosSafetyChecker.check_video_safety`
(one frame a forward): on the CPU the same frames out, frame for frame (frames with faces and without, in one batch;
on a GPU the batched kernels' TF32 sums may differ, bench/guardrail_cost.py measures that); a block by the package's
content models is a block of ours too.

It needs `cosmos_guardrail` to import, so a torchvision that matches torch: `make guardrail-served`'s venv
(`.venv-guardrail/bin/python -m pytest tests/test_safety_cosmos.py`) or the GPU image; skipped elsewhere, the CPU CI
included (docs/safety.md). The package loads its checkpoints from a random-weight snapshot
(cosmos3_core/tools/guardrail_snapshot.py) whose RetinaFace heads find faces by the pixels (`faces="content"`).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import numpy as np
    from cosmos3_core.safety import CosmosVideoBatched, Guardrail, Refused

    video = Guardrail.load("cosmos", "cpu", "video")
    ours = video.checker
    assert isinstance(ours, CosmosVideoBatched), type(ours)
    package = ours.package
    assert package.video_guardrail.postprocessors[0].batch_size == 1  # the package: one frame a forward
    rng = np.random.default_rng(1)
    t, y, x = np.meshgrid(np.arange(7), np.arange(72), np.arange(120), indexing="ij", sparse=True)
    field = np.stack(np.broadcast_arrays(*[np.sin((x + 5 * t) / (9 + 4 * c)) + np.cos(y / (7 + 3 * c)) for c in range(3)]), -1) * 60 + 128
    frames = np.clip(field + rng.normal(0, 20, field.shape), 0, 255).astype(np.uint8)
    frames[[2, 5]] = 128  # plain grey: no face (no score above 0.7); a batch of 3 holds both kinds
    expected = package.check_video_safety(frames.copy())
    changed = (expected != frames).any(-1).reshape(len(frames), -1).mean(1)
    assert changed[[2, 5]].max() == 0 and np.delete(changed, [2, 5]).min() > 0.05, changed
    # which faces depends on the pixels as the net sees them: the same frames in RGB order find others
    assert not np.array_equal(package.check_video_safety(frames[..., ::-1].copy()), expected[..., ::-1])
    # one forward a batch, of `batch` rows: 3 (3, 3 and a tail of 1 padded to 3; faces in some frames of a batch or in
    # all), 16 (the server's: 7 padded to 16), 7 (no padding), 1 (the package's layout). Equal here on the CPU; on a GPU
    # the batched kernels' TF32 sums put scores up to ~2e-3 from the package's (bench/guardrail_cost.py)
    rows = []
    package.video_guardrail.postprocessors[0].net.register_forward_pre_hook(lambda _, args: rows.append(len(args[0])))
    for batch in (3, 16, 7, 1):
        ours.batch = batch
        rows.clear()
        got = video.check_frames(frames.copy())
        assert rows == [batch] * -(-len(frames) // batch), (batch, rows)
        assert got.dtype == np.uint8 and np.array_equal(got, expected), (batch, (got != expected).sum())

    class Blocks:  # a content model of the package's video guardrail (0.3.2 ships its SigLIP one switched off)
        def is_safe(self, frames):
            return False, "unsafe frames detected"

    package.video_guardrail.safety_models.append(Blocks())
    assert package.check_video_safety(frames.copy()) is None and ours.check_video_safety(frames.copy()) is None
    try:
        video.check_frames(frames.copy(), 26)
        raise AssertionError("not blocked")
    except Refused as e:
        assert str(e).startswith("video: blocked by the Cosmos Guardrail (video guardrail) at frames 26..32"), e
    print("ok")
""")


def test_batched_video_check_is_the_packages_frame_for_frame(tmp_path):
    try:
        import cosmos_guardrail  # noqa: F401
    except ImportError as e:
        pytest.skip(f"cosmos_guardrail does not import here ({e}); see docs/safety.md")
    from cosmos3_core.tools.guardrail_snapshot import write_guardrail_cache

    cache = write_guardrail_cache(tmp_path / "cache", qwen="tiny", faces="content")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=Path.cwd(), capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip().startswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]


TEXT_SCRIPT = textwrap.dedent("""
    import sys
    from cosmos3_core.safety import CosmosText, Guardrail

    text = Guardrail.load("cosmos", "cpu", "text")
    ours = text.checker
    assert isinstance(ours, CosmosText), type(ours)
    guard = ours.package.text_guardrail.safety_models[1]  # the blocklist, then Qwen3Guard
    steps = []
    guard.model.register_forward_hook(lambda *_: steps.append(1))  # a forward per generated token
    decisions = []
    for prompt in ("a robot arm stacks cubes on a table", "a grenade on the table"):  # the second: the blocklist's
        steps.clear()
        package = ours.package.check_text_safety(prompt)
        package_steps = len(steps)
        steps.clear()
        assert ours.check_text_safety(prompt) == package, prompt
        decisions.append((package, package_steps, len(steps)))
    print("ok", decisions)
""")


@pytest.mark.parametrize(("answer", "verdict_tokens", "label_at", "allowed", "steps"), [
    ("safe", 0, None, True, (128, 1)),  # the label at every token: the package generates 128, ours stops at the first
    ("unsafe", 0, None, False, (128, 1)),
    ("unsafe", 10, None, False, (11, 10)),  # the label last of 10, then the end token: only that one saved
    ("safe", 10, 3, True, (11, 3)),  # a real verdict's shape: the label out at token 3 of 10 and the end token
])  # fmt: skip
def test_text_check_is_the_packages_and_stops_at_the_label(tmp_path, answer, verdict_tokens, label_at, allowed, steps):
    """`CosmosText` decides as the package's `check_text_safety` (a Qwen3Guard answer, the blocklist), generating
    Qwen3Guard's tokens only up to its label."""
    try:
        import cosmos_guardrail  # noqa: F401
    except ImportError as e:
        pytest.skip(f"cosmos_guardrail does not import here ({e}); see docs/safety.md")
    from cosmos3_core.tools.guardrail_snapshot import write_guardrail_cache

    cache = write_guardrail_cache(tmp_path / "cache", qwen="tiny", answer=answer, faces="none",
                                  verdict_tokens=verdict_tokens, label_at=label_at)  # fmt: skip
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    run = subprocess.run([sys.executable, "-c", TEXT_SCRIPT], env=env, cwd=Path.cwd(), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]
    guarded, blocklisted = ast.literal_eval(run.stdout.removeprefix("ok").strip())  # (allowed, package's, ours)
    assert guarded == (allowed, *steps)
    assert blocklisted == (False, 0, 0)  # the blocklist refuses before Qwen3Guard runs
