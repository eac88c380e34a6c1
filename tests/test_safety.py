"""The deployment's guardrail (cosmos3_core/safety.py), as diffusers' Cosmos3OmniPipeline runs it: the prompt before
any work, every piece of frames before it leaves; the opt-out policy; the load error; the refusal metric.

The behaviour tests run a stand-in (tests/safety_standin.py) through `safety_checker: module:callable`, in process
and through the session's server (conftest's served deployment names it). The real `cosmos_guardrail` package runs
on random weights of its real architectures (cosmos3_core/tools/guardrail_snapshot.py) where it imports: it needs a
torchvision that matches torch, which PyPI has only for CUDA torch on x86-64 (the GPU image), not the CPU CI's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from client.stream import ServerError, generate
from cosmos3_core.deployment import Deployment
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.requests import Defaults, Limits, RequestError
from cosmos3_core.safety import Guardrail, Refused, Unavailable
from cosmos3_core.stages import DecodeStage, PrefillStage
from tests.safety_standin import BLOCK_HEIGHT, BLOCK_WIDTH, BLUR_WIDTH, REFUSED_WORD, StandIn, blur

SMALL = {"height": 32, "num_frames": 9, "steps": 2, "seed": 3}
CHAINED = {"window_mode": "chained", "num_frames": 33, "window_frames": 17, "overlap_frames": 8, "steps": 2, "seed": 4}
KV = {"window_mode": "kv", "num_frames": 25, "window_frames": 9, "context_frames": 13, "steps": 2, "seed": 5}


def test_a_refused_prompt_ends_in_prefill_before_any_work(offline):
    """The error names the guardrail, never the prompt; nothing reaches the engine; the negative prompt is not
    checked (the pipeline's)."""
    prompt = f"a crate of {REFUSED_WORD} on a dock"
    p = offline.prefill.validate(prompt, SMALL, None)
    with pytest.raises(Refused) as e:
        offline.generate(prompt, SMALL)
    assert e.value.field == "prompt" and "text guardrail" in str(e.value) and "safety checker" in str(e.value)
    assert REFUSED_WORD not in str(e.value) and "dock" not in str(e.value)
    assert offline.engine.pool.pages_used == 0 and not offline.engine.has_work()
    with pytest.raises(Refused):
        offline.prefill.run(p, None)
    clean = offline.prefill.validate("a dock", {**SMALL, "negative_prompt": REFUSED_WORD}, None)
    assert offline.prefill.run(clean, None).text_k  # the negative prompt passes


def test_frames_come_back_as_the_checker_returns_them(offline):
    latents = offline.generate("a kite", {**SMALL, "width": BLUR_WIDTH}).latents
    checked = offline.decode.run(latents)
    raw = offline.decode.run(latents, safety_check=False)  # the request's enable_safety_check false
    assert np.array_equal(checked, blur(raw)) and not np.array_equal(checked, raw)


def test_opting_out_needs_the_deployment_to_allow_it(nano_ckpt):
    guard = Guardrail(StandIn(), "stand-in")
    ckpt = Checkpoint.open(nano_ckpt)
    strict = PrefillStage(
        ckpt, "cpu", torch.float32, Defaults(32, 48, 9), Limits(), safety=guard, safety_optional=False
    )
    with pytest.raises(RequestError, match=r"^enable_safety_check: this deployment always runs the stand-in") as e:
        strict.validate("a dock", {"enable_safety_check": False}, None)
    assert e.value.field == "enable_safety_check"
    with pytest.raises(RequestError, match=r"^enable_safety_check: must be true or false"):
        strict.validate("a dock", {"enable_safety_check": "no"}, None)
    assert strict.validate("a dock", {"enable_safety_check": True}, None).enable_safety_check
    loose = PrefillStage(ckpt, "cpu", torch.float32, Defaults(32, 48, 9), Limits(), safety=guard, safety_optional=True)
    p = loose.validate(f"a {REFUSED_WORD} dock", {"enable_safety_check": False}, None)
    assert loose.run(p, None).text_k  # opted out: the text guardrail does not run either


def test_a_blocked_piece_refuses_every_later_piece_of_its_stream(offline):
    """The decode stage's own state, so a piece launched before the engine heard of the block is not sent."""
    decode: DecodeStage = offline.decode
    piece = np.zeros((13, BLOCK_HEIGHT, BLOCK_WIDTH, 3), np.uint8)  # a stream's first piece: 1 + 4k frames passes
    assert decode.checked(piece, True, "s1", 0, last=False) is not None
    with pytest.raises(Refused, match=r"^video: blocked by the safety checker .* at frames 13..16"):
        decode.checked(piece[:4], True, "s1", 13, last=False)
    with pytest.raises(Refused, match="at frames 13..16"):  # 5 frames would pass the checker: never asked
        decode.checked(piece[:5], True, "s1", 17, last=False)
    with pytest.raises(Refused):  # the last piece too, and then the stream is forgotten
        decode.checked(piece[:5], True, "s1", 22, last=True)
    assert "s1" not in decode.blocked
    with pytest.raises(Refused):  # a whole video (the CLI's) is blocked alike
        decode.checked(piece[:4])
    assert decode.checked(piece[:4], safety_check=False) is not None


def test_cosmos_without_the_package_fails_at_load_with_one_line(monkeypatch, nano_ckpt, tmp_path, capsys):
    from cosmos3_core.generate import main

    monkeypatch.setitem(sys.modules, "cosmos_guardrail", None)  # not installed (or it does not import)
    config = tmp_path / "d.yaml"
    config.write_text(yaml.safe_dump({"checkpoint": str(nano_ckpt), "device": "cpu", "safety_checker": "cosmos"}))
    d = Deployment.load(config)
    for load in (
        lambda: PrefillStage.from_deployment(Checkpoint.open(nano_ckpt), d, "cpu"),
        lambda: DecodeStage.from_deployment(Checkpoint.open(nano_ckpt), d, "cpu"),
    ):
        with pytest.raises(Unavailable) as e:
            load()
        assert "\n" not in str(e.value) and "cosmos_guardrail" in str(e.value) and "pip install" in str(e.value)
    assert main(["--config", str(config), "--prompt", "a dock", "--out", str(tmp_path / "x.npy")]) == 2
    assert capsys.readouterr().err.startswith("error: safety_checker cosmos needs the cosmos_guardrail package")
    with pytest.raises(Unavailable, match=r"^safety_checker no_such_module:make: cannot import it"):
        Guardrail.load("no_such_module:make", "cpu", "text")
    config.write_text("safety_checker: cosmo\n")
    with pytest.raises(ValueError, match="safety_checker: cosmos, none or module:callable; got 'cosmo'"):
        Deployment.load(config)


@pytest.mark.served
def test_served_refusal_is_a_named_error_counted_as_refused(server):
    from tests.test_served import wait_metric

    before = server.metrics(settle=True).get("cosmos3_requests_total:refused", 0)
    with pytest.raises(ServerError) as e:
        generate(server.url, f"a {REFUSED_WORD} parcel", SMALL)
    text = str(e.value)
    assert text.startswith("prompt: refused by the safety checker") and "internal" not in text, text
    assert REFUSED_WORD not in text
    m = wait_metric(server, "cosmos3_requests_total:refused", before + 1)
    assert m.get("cosmos3_requests_total:refused") == before + 1 and m["cosmos3_kv_pages_used"] == 0
    assert generate(server.url, "a parcel", SMALL).video.shape == (9, 32, 64, 3)


@pytest.mark.served
def test_served_stream_blocked_mid_stream_sends_nothing_after(server):
    from tests.test_served import wait_metric

    pieces: list[tuple[str, int]] = []
    with pytest.raises(ServerError) as e:
        generate(server.url, "a harbour", {**CHAINED, "height": BLOCK_HEIGHT, "width": BLOCK_WIDTH},
                 on_event=lambda ev, f: f is not None and pieces.append((ev["type"], f.shape[0])))  # fmt: skip
    assert str(e.value).startswith("video: blocked by the safety checker") and "frames 13..16" in str(e.value)
    assert pieces == [("chunk", 13)]  # the first piece (1 + 4k frames) only: nothing after the blocked one
    m = wait_metric(server, "cosmos3_live_requests", 0, 30)
    assert m["cosmos3_live_requests"] == 0 and m["cosmos3_kv_pages_used"] == 0


@pytest.mark.served
def test_served_ar_pieces_arrive_as_the_checker_returns_them(server, offline):
    """Every piece of a chained and a kv stream (2 windows each) as the checker returned it; an opted-out request's
    pieces as decoded."""
    for params in ({**CHAINED, "num_frames": 25}, {**KV, "num_frames": 17}):
        params = {**params, "width": BLUR_WIDTH}
        r = generate(server.url, "a forest path", params)
        raw = offline.frames("a forest path", {**params, "enable_safety_check": False})
        assert len(r.frames) >= 2 and np.array_equal(r.video, blur(raw)), params["window_mode"]
    opted_out = generate(server.url, "a forest path", {**params, "enable_safety_check": False})
    assert np.array_equal(opted_out.video, raw)


def test_the_cosmos_guardrail_package_on_random_weights(tmp_path):
    """`safety_checker: cosmos` with the real package: its Blocklist, Qwen3Guard and RetinaFaceFilter built by
    `CosmosSafetyChecker()` from a local snapshot (tiny Qwen3Guard), in a process whose hub cache is that snapshot."""
    try:
        import cosmos_guardrail  # noqa: F401
    except ImportError as e:
        pytest.skip(f"cosmos_guardrail does not import here ({e}); see docs/safety.md")
    from cosmos3_core.tools.guardrail_snapshot import write_guardrail_cache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    script = textwrap.dedent(f"""
        import numpy as np
        from cosmos3_core.safety import Guardrail, Refused, Unavailable
        if ANSWER == "missing":  # an empty cache, offline: the load fails with one line naming the checkpoints
            try:
                Guardrail.load("cosmos", "{device}", "text")
                raise AssertionError("loaded")
            except Unavailable as e:
                assert "cannot load the guardrail's checkpoints" in str(e) and "\\n" not in str(e), str(e)
            print("ok")
            raise SystemExit
        text = Guardrail.load("cosmos", "{device}", "text")
        guard = text.checker.package.text_guardrail.safety_models[1]  # CosmosText wraps the package
        if ANSWER == "safe":
            assert guard.extract_label_and_categories("a robot arm stacks cubes") == (True, ""), "Qwen3Guard"
            text.check_prompt("a robot arm stacks cubes on a table")
            for prompt in ("a grenade on a table", "two grenades on a table", "a crate of contraband"):
                try:
                    text.check_prompt(prompt)
                    raise AssertionError(prompt + " passed")
                except Refused as e:
                    assert str(e).startswith("prompt: refused by the Cosmos Guardrail") and "table" not in str(e)
            video = Guardrail.load("cosmos", "{device}", "video")
            frames = np.random.default_rng(0).integers(0, 256, (5, 64, 96, 3), dtype=np.uint8)
            out = video.check_frames(frames.copy())  # every prior a face (the snapshot's RetinaFace): pixelated
            assert out.dtype == np.uint8 and out.shape == frames.shape and not np.array_equal(out, frames)
        else:  # Qwen3Guard answers Unsafe: a clean prompt the blocklist passes is refused
            try:
                text.check_prompt("a robot arm stacks cubes on a table")
                raise AssertionError("passed")
            except Refused:
                pass
        print("ok")
    """)  # fmt: skip
    for answer in ("safe", "unsafe", "missing"):
        cache = tmp_path / answer
        cache.mkdir()
        if answer != "missing":
            write_guardrail_cache(cache, qwen="tiny", answer=answer)
        env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
        run = subprocess.run([sys.executable, "-c", f"ANSWER = {answer!r}\n" + script], env=env, cwd=Path.cwd(),
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
