"""`python -m client` as a person runs it, against the served tiny model: Ctrl-C mid-stream cancels the request on
the server (counted cancelled, its pages freed) and the client exits at once with one line; a finished request
prints where its time went, in parts that add up, and the steps step caching skipped."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.served

ROOT = Path(__file__).resolve().parent.parent
CANCELLED = "cancelled (Ctrl-C): the server stops the request"


def client(server, tmp_path, *args: str) -> list[str]:
    return [sys.executable, "-m", "client", "generate", "--url", server.url, "--out", str(tmp_path / "v.mp4"), *args]


def wait_for(server, done, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not done(m := server.metrics()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return m


def test_ctrl_c_cancels_on_the_server_and_exits_at_once(server, tmp_path):
    before = server.metrics(settle=True)
    long = ["--steps", "60", "--num-frames", "33", "--height", "128", "--width", "128", "--seed", "9"]
    proc = subprocess.Popen(client(server, tmp_path, "--prompt", "a long one", *long), cwd=ROOT, stderr=subprocess.PIPE)
    seen, deadline = b"", time.monotonic() + 120
    while not re.search(rb"\d+/60", seen) and time.monotonic() < deadline:  # the bar's first drawing
        chunk = proc.stderr.read1(4096)
        assert chunk, f"the client ended before any progress: {seen.decode(errors='replace')}"
        seen += chunk
    proc.send_signal(signal.SIGINT)
    t_sigint = time.monotonic()
    rest = proc.stderr.read()
    rc = proc.wait(10)
    exit_s = time.monotonic() - t_sigint
    # the pages: freed as soon as the engine sees the cancellation (between two steps)
    m = wait_for(server, lambda m: m["cosmos3_kv_pages_used"] == 0 and m["cosmos3_live_requests"] == 0)
    freed_s = time.monotonic() - t_sigint
    text = (seen + rest).decode(errors="replace")
    assert rc == 130 and exit_s <= 1.0, f"exit {rc} after {exit_s:.2f}s: {text}"
    assert "Traceback" not in text and text.endswith("\n" + CANCELLED + "\n"), text  # the bar's line, then one line
    assert m["cosmos3_kv_pages_used"] == 0 and m["cosmos3_live_requests"] == 0, f"pages held {freed_s:.1f}s after"
    m = wait_for(server, lambda m: m["cosmos3_requests_total:cancelled"] > before["cosmos3_requests_total:cancelled"])
    ended = {k: m.get(k, 0) - before.get(k, 0) for k in m if k.startswith("cosmos3_requests_total:")}
    assert ended["cosmos3_requests_total:cancelled"] == 1 and sum(ended.values()) == 1, ended
    steps_run = m["cosmos3_request_steps_total"] - before["cosmos3_request_steps_total"]
    # the engine stops within a step of the cancellation: at most a step past what the client had seen, and one more
    # that the client had not yet read (measured: seen 1, ran 2, pages freed 0.3 s after the SIGINT)
    seen_step = int(re.findall(rb"(\d+)/60", seen)[-1])
    assert steps_run <= seen_step + 2, f"the client saw step {seen_step}, the engine ran {steps_run}"


def test_timings_add_up_and_cache_skipped_printed(server, tmp_path):
    args = ["--prompt", "a lighthouse", "--steps", "6", "--num-frames", "9", "--cache", '{"policy": "sea"}']
    r = subprocess.run(client(server, tmp_path, *args), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = dict(re.findall(r"^  (\S[\w =]*?)\s+(-?\d+\.\d\d)  ", r.stderr, re.M))
    parts = ["prefill", "to denoise", "queue", "denoise", "to decode", "decode"]
    assert set(parts) <= set(rows) and "not measured" not in rows, r.stderr
    server_s, transfer, client_s = (float(rows[k]) for k in ("= server", "transfer", "= client"))
    assert abs(sum(float(rows[k]) for k in parts) - server_s) <= 0.05, r.stderr  # rounded to 0.01 each
    assert abs(server_s + transfer - client_s) <= 0.011 and transfer >= 0, r.stderr
    assert re.search(r"^cache_skipped \(steps per branch\): cond \d+ \[", r.stderr, re.M), r.stderr
