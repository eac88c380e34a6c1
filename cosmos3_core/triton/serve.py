"""Render `model_repository/` for a deployment and run tritonserver on it.

  python -m cosmos3_core.triton.serve [--config configs/tiny.yaml] [--checkpoint DIR] [--grpc-port 8001]
      [--http-port 8000] [--metrics-port 8002] [--address 127.0.0.1] [--workdir build/serve/<grpc port>]
      [--render-only]

Rendering writes `<workdir>/deployment.yaml` (the effective deployment, checkpoint resolved — the tiny one is
made here, once, before any stub starts) and `<workdir>/model_repository/` (each `config.pbtxt` filled in
from the deployment, each `model.py` copied). The server binds loopback unless `--address` says otherwise.
Each server has its own workdir (its state folder lives there: state.py), held by a lock while it runs.

Supervision (docs/operations.md): this process owns the HTTP and metrics ports (`front.Front`; tritonserver's
listen on private loopback ports behind it) and watches tritonserver's Python stubs every 0.1 s. A dead stub's part
is marked down at once (readiness 503 with the part's text; `ServerState.mark_down` for the stubs still alive, which
answer its requests in flight and refuse new ones) and reloaded alone through Triton's model control, up to
RELOAD_ATTEMPTS times, then tritonserver is restarted whole, as it is when it exits, and when it runs but has not
answered for UNANSWERED_S (`Watchdog`: killed first). SIGINT/SIGTERM drain at any moment (a reload in progress
included): readiness 503 from the first moment, requests in flight finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template

import yaml

from .. import errors, memory
from ..deployment import DEFAULT_CONFIG, Deployment, parse_sets
from ..model.checkpoint import Checkpoint
from ..model.provision import resolve_checkpoint
from .front import Front
from .launcher import (
    ServerConfig,
    free_ports,
    launch_server,
    load_model,
    pid_alive,
    ports_in_use,
    stop_server,
    stub_pids,
    wait_until_ready,
    worker_pids,
)
from .state import ServerState

REPO_TEMPLATE = Path(__file__).resolve().parents[2] / "model_repository"
MODELS = ("cosmos3", "cosmos3_admit", "cosmos3_prefill", "cosmos3_denoise", "cosmos3_vae_decode")


def render(deployment: Deployment, workdir: Path) -> tuple[Path, Deployment]:
    """→ (model repository, the effective deployment it serves)."""
    workdir = workdir.absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    deployment = dataclasses.replace(
        deployment,
        checkpoint=str(resolve_checkpoint(deployment.checkpoint).absolute()),
        # always this workdir's: a shared one would let one server's drain stop every other server
        state_dir=str(workdir / "state"),
    )
    ServerState(deployment.state_dir).reset()  # nothing of a previous run's
    dep_path = workdir / "deployment.yaml"
    dep_path.write_text(yaml.safe_dump(dataclasses.asdict(deployment), sort_keys=False))
    gpu = deployment.torch_device.startswith("cuda")
    values = {
        "deployment": str(dep_path),
        "kv_type": {"float32": "TYPE_FP32", "bfloat16": "TYPE_BF16", "float16": "TYPE_FP16"}[
            str(deployment.torch_dtype).split(".")[1]
        ],
        "instance_kind": "KIND_GPU" if gpu else "KIND_CPU",
        "instance_gpus": "gpus: [ 0 ]" if gpu else "",  # one GPU per server: all instances on the first visible
        "force_cpu_inputs": "no" if gpu else "yes",
        **{f"{k}_instances": str(v) for k, v in deployment.instances.items()},
    }
    repo = workdir / "model_repository"
    if repo.exists():
        shutil.rmtree(repo)
    for model in MODELS:
        src, dst = REPO_TEMPLATE / model, repo / model
        (dst / "1").mkdir(parents=True)
        (dst / "config.pbtxt").write_text(Template((src / "config.pbtxt").read_text()).substitute(values))
        if (src / "1" / "model.py").is_file():
            shutil.copy2(src / "1" / "model.py", dst / "1" / "model.py")
    return repo, deployment


def cuda_pool_bytes(deployment: Deployment) -> int:
    """Triton's CUDA pool for the deployment (`memory.cuda_pool_bytes`: 0 on the CPU). Triton's default, 64 MiB,
    holds no Nano K/V (70 MB at a 473-token prompt): such a tensor then crossed through host shared memory, slower,
    and the served Nano packs came back black (H200, 2026-12-02). Raises what `Checkpoint.open` raises for a
    checkpoint it cannot read."""
    if not deployment.torch_device.startswith("cuda"):
        return 0
    return memory.cuda_pool_bytes(deployment, Checkpoint.open(resolve_checkpoint(deployment.checkpoint)).config)


def start(
    deployment: Deployment, workdir: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list[int], Deployment]:
    """Render and launch on free loopback ports (benchmarks, soak, tests) → (process, [grpc, http, metrics],
    the effective deployment). Not yet ready: `wait_until_ready(ports[1], proc=proc)`."""
    repo, deployment = render(deployment, workdir)
    ports = free_ports(3)
    cpu_only = not deployment.torch_device.startswith("cuda")
    config = ServerConfig(repo, *ports, cpu_only=cpu_only, log_path=Path(workdir) / "tritonserver.log",
                          cuda_pool_bytes=cuda_pool_bytes(deployment))  # fmt: skip
    proc = launch_server(config, env)
    return proc, ports, deployment


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cosmos3_core.triton.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="deployment YAML; default configs/tiny.yaml")
    ap.add_argument("--checkpoint", default=None, help="override the config's checkpoint")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                    help="override a top-level config key, e.g. precision=fp8 (as `make plan` takes it)")  # fmt: skip
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--address", default="127.0.0.1", help="bind address (default loopback only)")
    ap.add_argument("--workdir", default=None, help="default build/serve/<grpc port>: one per server")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("extra", nargs="*", help="extra tritonserver flags after --")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    given = (args.grpc_port, args.http_port, args.metrics_port)
    auto = iter(free_ports(3, exclude={p for p in given if p}))
    ports = [p or next(auto) for p in given]
    if not args.render_only:
        busy = ports_in_use(dict(zip(("grpc", "http", "metrics"), ports)), args.address)
        if busy:
            print(f"error: cannot listen on {args.address}: {', '.join(busy)}: stop what listens there (a server of "
                  f"ours: make stop GRPC_PORT={ports[0]}), or choose other ports (make serve GRPC_PORT=9001 "
                  "HTTP_PORT=9000 METRICS_PORT=9002)", file=sys.stderr)  # fmt: skip
            return 1
    workdir = Path(args.workdir or f"build/serve/{ports[0]}")
    if lock_workdir(workdir) is None:
        holder = (workdir / ".lock").read_text().strip()
        print(f"error: {workdir.absolute()} is in use by another server (pid {holder}); pass another --workdir",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        overrides = {**parse_sets(args.set), **({"checkpoint": args.checkpoint} if args.checkpoint else {})}
        deployment = Deployment.load(args.config, **overrides)
    except (ValueError, OSError) as e:  # a config error names its field: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # a checkpoint that cannot be opened: one line, not a traceback
        repo, deployment = render(deployment, workdir)
        pool = cuda_pool_bytes(deployment)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"rendered {repo}", file=sys.stderr)
    if args.render_only:
        return 0
    private = free_ports(2, exclude=ports)  # tritonserver's HTTP and metrics, on loopback behind the front
    # not ready from its first answer: a probe between here and tritonserver's start must not read 200
    front = Front(args.address, ports[1], ports[2], *private, state=ServerState(deployment.state_dir),
                  starting=errors.STARTING)  # fmt: skip
    stopping = threading.Event()

    def stop(*_) -> None:  # readiness answers 503 from this moment; a reload in progress stops at its next check
        front.drain(errors.DRAINING)
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        return _serve(args, repo, deployment, pool, ports, private, front, stopping)
    finally:
        front.close()


def _serve(args, repo: Path, deployment: Deployment, pool: int, ports: list[int], private: list[int], front: Front,
           stopping: threading.Event) -> int:  # fmt: skip
    """Run tritonserver (`pool`: its CUDA pool, `cuda_pool_bytes`) until asked to stop, healing what dies (module
    docstring) → the exit code."""
    state = ServerState(deployment.state_dir)
    cpu_only = not deployment.torch_device.startswith("cuda")
    front.set_down("server", errors.STARTING)
    healed: set[str] = set()

    def heal_parts(parts: list[str]) -> None:
        healed.update(parts)
        # cfg, proc: the running tritonserver's (below)
        heal(parts, Reloader(proc, repo, private[0], cfg.admin_token), front, state, stopping)

    while not stopping.is_set():
        cfg = ServerConfig(repo, ports[0], *private, args.address, cpu_only, extra=tuple(args.extra),
                           private_address="127.0.0.1", cuda_pool_bytes=pool)  # fmt: skip
        proc = launch_server(cfg)
        try:
            waited = wait_until_ready(private[0], proc=proc, timeout_s=900)  # a cold Nano compiles for minutes
        except (RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            stop_server(proc)
            return 1
        front.clear("server")
        print(
            f"ready in {waited:.1f}s: grpc {args.address}:{ports[0]}  http :{ports[1]}  metrics :{ports[2]}",
            file=sys.stderr,
        )
        healed.clear()  # parts healed in this tritonserver's life
        watchdog = Watchdog(proc, private[0], (_connect_address(args.address), ports[0]))
        try:
            reason = supervise(proc, stopping, heal_parts, state)
        finally:
            watchdog.stop()
        if reason is not None and watchdog.fired is not None:  # what it killed then failed: its reason is the cause
            reason = watchdog.fired
        if reason is None:  # asked to stop (readiness said so at once): drain, then stop the server
            drain(state, deployment.drain_timeout_s + 10)  # the engine's drain timeout, then its stragglers' errors
            if not healed & {"denoise", "vae_decode"}:
                return stop_server(proc)
            # tritonserver still holds the requests of a dead decoupled instance (nothing can end them: see
            # docs/operations.md) and would wait out its exit timeout for them; the drain is done, so stop it now
            code = stop_server(proc, timeout_s=5)
            print(f"stopped tritonserver (exit code {code}): it held requests of a dead instance", file=sys.stderr)
            return 0
        front.set_down("server", errors.SERVER_RESTARTING)
        front.count_restart("tritonserver")
        print(f"{reason}; restarting tritonserver (its in-flight requests end with errors)", file=sys.stderr)
        stop_server(proc, timeout_s=5)
        state.reset()  # the new server starts afresh: no part down, no stream, no ticket of the old one
    return 0


def lock_workdir(workdir: Path) -> int | None:
    """Lock `<workdir>/.lock` until this process ends (→ the lock's fd), or None while another holds it:
    rendering wipes the repository and the marks of whoever else serves from it."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(workdir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


# how long a drain waits for admission tickets (requests between the door and the engine): prefill refuses each
# request with the drain's text from the drain's start, so a live ticket goes within one prefill; a ticket left by a
# request that ended between two steps (a client's cancel) would otherwise hold every drain to its timeout
DRAIN_TICKETS_S = 10.0


def drain(state: ServerState, timeout_s: float) -> None:
    """Stop admitting; wait until no request is past the door (`ServerState.idle`: one in prefill is refused with the
    drain's text; the engine ends stragglers after its drain timeout; a request whose pieces still decode is held
    until its last frames are out). Then tritonserver can stop with nothing in flight: a request still in prefill
    when Triton stops is refused in Triton's own words, or never answered. The drain mark stays up through that stop
    (the next start clears the state), so nothing is admitted meanwhile."""
    state.drain()
    start = time.monotonic()
    while time.monotonic() - start < timeout_s and not state.idle(time.monotonic() - start < DRAIN_TICKETS_S):
        time.sleep(0.2)
    time.sleep(0.2)  # each held request's last step (vae_decode's answer to its `end`)


def supervise(
    proc: subprocess.Popen, stopping: threading.Event, heal: Callable[[list[str]], None], state: ServerState
) -> str | None:
    """Wait until asked to stop (→ None) or tritonserver exits or a part cannot be reloaded (→ why). A Python stub
    that dies is not restarted by Triton 2.51 (every later request of its model fails 'Stub process ... is not
    healthy'), and a parallel worker that dies leaves its stub without its group until the next request: either
    way `heal` the part. Polled every 0.1 s, so that readiness turns 503 well within a second; new workers (a group
    that restarted) are looked for every second."""
    stubs = stub_pids(proc)
    expected = set(stubs.values())  # instance names: one that dies while another part reloads is found missing
    workers = worker_pids(stubs)
    ticks = 0
    while not stopping.wait(0.1):
        if proc.poll() is not None:
            return f"tritonserver exited with {proc.returncode}"
        ticks += 1
        if ticks % 10 == 0:
            workers = worker_pids(stubs)
        dead = {name for pid, name in stubs.items() if not pid_alive(pid)}
        dead |= {f"{stubs[stub]} (a parallel worker)" for pid, stub in workers.items() if not pid_alive(pid)}
        while dead and not stopping.is_set():
            parts = sorted({errors.part_of(name.split()[0]) or name for name in dead})
            print(f"died: {', '.join(sorted(dead))}; reloading {', '.join(parts)}", file=sys.stderr)
            for name in dead:  # a dead engine holds nothing the drain should wait for
                if errors.part_of(name.split()[0]) == "denoise":
                    state.set_busy(name.split()[0], False)
                    state.clear_tickets("engine")  # its requests are never answered (its reload clears them too)
            try:
                heal(parts)
            except Exception as e:  # noqa: BLE001 - whatever failed, a whole restart heals it
                return f"reloading {', '.join(parts)} failed: {e}"
            stubs = stub_pids(proc)
            workers = worker_pids(stubs)
            dead = expected - set(stubs.values())
    return None


# tritonserver not answering this long, and not yet seen exited by the supervisor, is killed with its stubs, then
# restarted whole. Seen in the chaos soak on the CPU, twice: a SIGABRT in Triton 2.51's libtriton_python.so (an
# uncaught boost::interprocess::lock_exception, 0.5 s after a killed admit's reload unloaded the ensemble's old
# version), whose handler calls exit() while the other threads run; tritonserver stopped answering (clients' gRPC
# refused, its metrics gone) while the next part's reload was in flight, and the supervisor, waiting for the load's
# answer, restarted nothing: the stub that load had started holds the request's connection (forked meanwhile, it
# inherited it). `Reloader.reload` now watches the process while it waits; this covers a tritonserver that runs but
# answers nothing (hung: the handler's exit() can deadlock), and any other wait.
UNANSWERED_S = 15.0


class Watchdog:
    """Asks a running tritonserver `proc` every second whether it answers (its private HTTP's `/v2/health/live` is
    200 and its gRPC port takes a connection); once it has not for UNANSWERED_S while the supervisor has not seen it
    exit (it runs, hung, or it exited and the supervisor waits on a request its stubs hold), SIGKILLs its process
    group (tritonserver and its stubs): the supervisor then sees it exited (or its reload fail) and restarts it whole.
    `fired`: why, once it did. Runs while `supervise` does (`stop()` after)."""

    def __init__(self, proc: subprocess.Popen, http_port: int, grpc: tuple[str, int]):
        self.proc, self.http_port, self.grpc = proc, http_port, grpc
        self.fired: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cosmos3-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(15)

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/live", timeout=5) as r:
                if r.status != 200:
                    return False
            socket.create_connection(self.grpc, timeout=5).close()
            return True
        except OSError:
            return False

    def _run(self) -> None:
        last = time.monotonic()
        while not self._done.wait(1.0):
            if self.answers():
                last = time.monotonic()
                continue
            unanswered = time.monotonic() - last
            # one the supervisor has reaped is its own to restart (its process group may be gone, its id reused)
            if unanswered >= UNANSWERED_S and not self._done.is_set() and self.proc.returncode is None:
                how = "while it ran (hung)" if pid_alive(self.proc.pid) else "and exited unseen (a request held)"
                self.fired = f"tritonserver did not answer for {unanswered:.0f} s {how}: killed with its stubs"
                print(self.fired, file=sys.stderr)
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return


def _connect_address(address: str) -> str:
    """Where to reach a port bound at `address` from this host."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(address, address)


RELOAD_ATTEMPTS = 3  # reloads of a part in a row that fail before tritonserver is restarted whole
# An ensemble request is bound to the model instances of its arrival: one that arrived just before the reload swapped
# the new instance in still has the dead one, and may reach the door a moment after the reload: refused meanwhile.
MARK_UP_GRACE_S = 0.5


@dataclass(frozen=True)
class Reloader:
    """Reloads one model of a running tritonserver `proc` (its repository `repo`, private HTTP port, admin token)."""

    proc: subprocess.Popen
    repo: Path
    http_port: int
    admin_token: str

    def stubs(self, part: str) -> set[int]:
        return {pid for pid, name in stub_pids(self.proc).items() if errors.part_of(name) == part}

    def reload(self, part: str, timeout_s: float = 30.0) -> float:
        """A real reload → seconds it took; raises RuntimeError unless a new stub of `part` runs and Triton says the
        model is ready. Triton skips an explicit load of a model whose files look unchanged (it kept the instance
        whose stub died, and answered the load at once): newer files make it start new instances. tritonserver
        exiting meanwhile fails it at once: the load's answer never comes then, nor does its connection close (the
        stub the load started inherited it)."""
        model, old = errors.model_of(part), self.stubs(part)
        now = time.time()
        for path in (self.repo / model / "1" / "model.py", self.repo / model / "1"):
            os.utime(path, (now, now))
        t0 = time.monotonic()
        failed: list[Exception] = []

        def load() -> None:
            try:
                load_model(self.http_port, model, self.admin_token)
            except RuntimeError as e:
                failed.append(e)

        loading = threading.Thread(target=load, name="cosmos3-reload", daemon=True)
        loading.start()
        while loading.is_alive():
            loading.join(0.1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode} while {model} loaded")
        if failed:
            raise failed[0]
        while not (self.stubs(part) - old and _ready(self.http_port, model)):
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{model} was loaded but no new stub of it answers")
            time.sleep(0.1)
        return time.monotonic() - t0


def _ready(http_port: int, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/{model}/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def heal(parts: list[str], reloader: Reloader, front: Front, state: ServerState, stopping: threading.Event) -> None:
    """Mark `parts` down (readiness; the stubs still alive answer for them), reload each until a new stub answers,
    mark them up again. Raises RuntimeError after RELOAD_ATTEMPTS failed reloads of a part, or at once when
    tritonserver exited; returns at once, the part still down, when the server is asked to stop."""
    for part in parts:
        state.mark_down(part)
        front.count_restart(part)
    for part in parts:
        for attempt in range(1, RELOAD_ATTEMPTS + 1):
            if stopping.is_set():
                return
            try:
                took = reloader.reload(part)
                break
            except RuntimeError as e:
                if reloader.proc.poll() is not None:  # no reload can help: the whole restart does
                    raise
                print(f"{errors.model_of(part)}: reload {attempt} of {RELOAD_ATTEMPTS} failed: {e}", file=sys.stderr)
        else:
            raise RuntimeError(f"{errors.model_of(part)} did not come back in {RELOAD_ATTEMPTS} reloads")
        print(f"{errors.model_of(part)} reloaded in {took:.1f}s", file=sys.stderr)
        stopping.wait(MARK_UP_GRACE_S)
        state.mark_up(part)


if __name__ == "__main__":
    sys.exit(main())
