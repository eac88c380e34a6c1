"""`make stop` (no GRPC_PORT, no ALL) stops this checkout's servers only: those holding the lock of one of its work
dirs, `build/serve/<port>/.lock`, as `python -m cosmos3_core.triton.serve` does (`serve.lock_workdir`: the lock
held while it runs, its pid inside). Two checkouts are two copies of the Makefile, each with a server that holds its
work dir's lock through the real `lock_workdir` (a stand-in for the tritonserver behind it, which `make stop` never
signals itself): `make stop` in one leaves the other serving, and a lock nobody holds (a stopped server's) is not
acted on, whatever pid it names."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# holds the work dir's lock as the server does, says so, then waits for a signal
HOLDER = (
    "import signal, sys; from pathlib import Path; from cosmos3_core.triton.serve import lock_workdir; "
    "assert lock_workdir(Path(sys.argv[1])) is not None; print('locked', flush=True); signal.pause()"
)


def make_stop(checkout: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "GRPC_PORT", "ALL")}
    subprocess.run(["make", "-s", "stop"], cwd=checkout, env=env, check=True, timeout=30, capture_output=True)


def test_make_stop_stops_only_this_checkouts_servers(tmp_path):
    checkouts = [tmp_path / "a", tmp_path / "b"]
    for c in checkouts:
        c.mkdir()
        shutil.copy(ROOT / "Makefile", c / "Makefile")
    # SIGINT back to its default: a run started in the background (`cmd &`) ignores SIGINT, and so would the holders
    sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    servers = [
        subprocess.Popen([sys.executable, "-c", HOLDER, str(c / "build/serve/8001")], cwd=ROOT, preexec_fn=sigint,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for c in checkouts
    ]  # fmt: skip
    try:
        assert [s.stdout.readline().strip() for s in servers] == ["locked", "locked"]
        stale = checkouts[0] / "build/serve/8002/.lock"  # a stopped server's lock, naming b's live server
        stale.parent.mkdir(parents=True)
        stale.write_text(f"{servers[1].pid}\n")

        make_stop(checkouts[0])
        assert servers[0].wait(10) != 0  # a's server got SIGINT
        try:
            servers[1].wait(1.0)  # a signal sent to it too would have ended it by now
            raise AssertionError("make stop in checkout a stopped checkout b's server")
        except subprocess.TimeoutExpired:
            pass

        make_stop(checkouts[1])
        assert servers[1].wait(10) != 0
    finally:
        for s in servers:
            s.kill()
            s.wait()
