"""Servers started from one checkout (`make serve` on several ports) do not act on each other, tritonserver never
outlives its supervisor, and a port that is already held is one clear error at start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.stream import generate, wait_ready
from cosmos3_core.triton.launcher import free_ports

pytestmark = pytest.mark.served

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"num_frames": 1, "height": 32, "width": 32, "steps": 2, "seed": 1}


def serve_cmd(config: Path, ports: list[int], *extra: str) -> list[str]:
    """As `make serve` runs it: no --workdir."""
    return [sys.executable, "-m", "cosmos3_core.triton.serve", "--config", str(config), "--grpc-port", str(ports[0]),
            "--http-port", str(ports[1]), "--metrics-port", str(ports[2]), *extra]  # fmt: skip


class Supervisor:
    def __init__(self, config: Path, cwd: Path):
        self.ports = free_ports(3)
        self.url = f"127.0.0.1:{self.ports[0]}"
        self.log = cwd / f"serve-{self.ports[0]}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(serve_cmd(config, self.ports), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip

    def workdir(self) -> Path:
        line = next(ln for ln in self.log.read_text().splitlines() if ln.startswith("rendered "))
        return Path(line.split(" ", 1)[1]).parent

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, parent pid), or None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()
    return text[text.index("(") + 1 : text.rindex(")")], rest[0], int(rest[1])


def alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[1] != "Z"


def children(pid: int, name: str) -> list[int]:
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [p for p in pids if (s := proc_stat(p)) and s[0] == name and s[1] != "Z" and s[2] == pid]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def pair(served_deployment, tmp_path_factory):
    """Two servers started like `make serve GRPC_PORT=…` twice from the same directory."""
    cwd = tmp_path_factory.mktemp("checkout")
    servers = [Supervisor(served_deployment[0], cwd) for _ in range(2)]
    try:
        for s in servers:
            wait_ready(s.url, 300)
        yield servers
    finally:
        for s in servers:
            s.stop()


def test_stopping_one_server_leaves_the_other_serving(pair):
    a, b = pair
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(60) == 0
    assert generate(b.url, "still serving", SMALL, timeout_s=60).events[-1]["type"] == "done"
    assert a.workdir() != b.workdir()


def test_a_workdir_in_use_is_refused(pair, served_deployment):
    _, b = pair
    t0 = time.monotonic()
    ports = free_ports(3)
    cmd = serve_cmd(served_deployment[0], ports, "--workdir", str(b.workdir()))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "in use" in r.stderr and str(b.workdir()) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 20
    assert (b.workdir() / "model_repository").is_dir()  # the running server's repository is untouched
    assert generate(b.url, "still serving", SMALL, timeout_s=60).events[-1]["type"] == "done"


def test_sigkill_of_the_supervisor_takes_tritonserver_down(pair):
    _, b = pair
    (triton,) = children(b.proc.pid, "tritonserver")
    stubs = children(triton, "triton_python_b")  # /proc's name is cut at 15 characters
    # one stub per Python model of the rendered repository (the ensemble `cosmos3` has none): admit, prefill,
    # denoise, vae_decode
    models = [c.parent.name for c in (b.workdir() / "model_repository").glob("*/config.pbtxt")
              if '"python"' in c.read_text()]  # fmt: skip
    assert len(models) == 4 and len(stubs) == len(models), (models, stubs)
    regions = f"cosmos3_pb_{b.proc.pid}_{b.ports[0]}_*"  # launcher.server_command's prefix: 64 MiB of RAM each
    assert len(list(Path("/dev/shm").glob(regions))) == len(models)
    # the supervisor's front owns the public HTTP and metrics ports; tritonserver's own are private (loopback)
    argv = Path(f"/proc/{triton}/cmdline").read_bytes().decode().split("\0")
    private = [int(a.split("=", 1)[1]) for a in argv if a.startswith(("--http-port=", "--metrics-port="))]
    ports = [*b.ports, *private]
    assert len(private) == 2 and not set(private) & set(b.ports), argv
    b.proc.kill()
    b.proc.wait()
    deadline = time.monotonic() + 10
    # a process's sockets can close a moment after it is gone (on a loaded machine), and the reaper unlinks the regions
    # only after the group it killed is gone: the ports and the regions get the same deadline
    while (
        any(alive(p) for p in (triton, *stubs))
        or not all(port_free(p) for p in ports)
        or any(Path("/dev/shm").glob(regions))
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(triton), "tritonserver outlived its supervisor"
    assert not any(alive(p) for p in stubs), "Python stubs outlived their server"
    assert all(port_free(p) for p in ports), f"ports {ports} still bound 10 s after the server died"
    assert not list(Path("/dev/shm").glob(regions)), "shm regions still there 10 s after the server died"


def test_held_port_is_one_clear_error(served_deployment, tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        try:
            r = subprocess.run(serve_cmd(served_deployment[0], [(other := free_ports(2, exclude=[port]))[0], port, other[1]]), cwd=tmp_path,
                               capture_output=True, text=True, timeout=30)  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not refuse the held port at start")
    assert r.returncode != 0 and time.monotonic() - t0 < 20
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and str(port) in errors[0] and "in use" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_make_stop_with_grpc_port_stops_only_that_server(tmp_path):
    """`make stop GRPC_PORT=…` matches only the supervisor of that port (stand-ins with a supervisor's command
    line: a real `make stop` would also stop servers that other tests run)."""
    ports = free_ports(2)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "-m", "cosmos3_core.triton.serve", "--grpc-port"]
    # SIGINT back to its default in the stand-ins: a run started in the background (`cmd &`) ignores SIGINT, and a
    # Python started with SIGINT ignored keeps ignoring it (the real server installs its own handler)
    sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    stand_ins = [subprocess.Popen([*sleeper, str(p), "--http-port", "0"], preexec_fn=sigint) for p in ports]
    try:
        time.sleep(0.5)
        env = {k: v for k, v in os.environ.items() if k != "MAKEFLAGS"}
        subprocess.run(["make", "-s", "stop", f"GRPC_PORT={ports[0]}"], cwd=ROOT, env=env, check=True, timeout=30)
        assert stand_ins[0].wait(5) != 0
        time.sleep(1.0)  # a signal sent to it too would have ended it by now
        assert stand_ins[1].poll() is None
    finally:
        for p in stand_ins:
            p.kill()
            p.wait()


def test_a_config_error_is_one_clear_error(tmp_path):
    """A deployment config the server cannot load: one `error:` line naming the key, no traceback, no server."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: {t2v: {steps: 8, bogus: 1}}\n")
    r = subprocess.run(serve_cmd(bad, free_ports(3)), cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert r.returncode == 2 and len(errors) == 1 and "defaults.t2v: unknown keys ['bogus']" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_cpu_servers_log_has_no_cuda_probe_errors(pair):
    """tritonserver (a GPU build) logs two CUDA probes as errors on a host without a CUDA driver, whatever the
    deployment's device (`launcher.CUDA_PROBE_ERRORS`); a CPU deployment's log on the terminal drops them, only them."""
    text = pair[1].log.read_text()
    assert "successfully loaded 'cosmos3'" in text  # tritonserver's own log comes through
    assert "CudaDriverHelper" not in text and "unable to create stream" not in text, text[-3000:]


def test_free_ports_are_distinct_and_avoid_the_ports_already_chosen(monkeypatch):
    """Each of a server's ports is its own (tritonserver once got one port for HTTP and metrics), and its private
    ports are none of the public ones chosen before them but not yet listened on."""
    public = free_ports(3)
    private = free_ports(40, exclude=public)
    assert len(set(public)) == 3 and len(set(private)) == 40 and not set(public) & set(private)
    # the kernel handing out an excluded port again (rare for real, so scripted here): it is skipped, and every
    # socket is closed once the ports are chosen
    from cosmos3_core.triton import launcher

    handed, opened = iter([5001, 5000, 5001, 5002]), []

    class Scripted:
        def __init__(self, *args):
            self.port, self.closed = None, False
            opened.append(self)

        def bind(self, address):
            self.port = next(handed)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            self.closed = True

    monkeypatch.setattr(launcher.socket, "socket", Scripted)
    assert launcher.free_ports(2, exclude={5001}) == [5000, 5002]
    assert len(opened) == 4 and all(s.closed for s in opened)
