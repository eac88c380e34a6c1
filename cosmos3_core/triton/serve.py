"""Render `model_repository/` for a deployment and run tritonserver on it.

  python -m cosmos3_core.triton.serve [--config configs/tiny.yaml] [--checkpoint DIR] [--grpc-port 8001]
      [--http-port 8000] [--metrics-port 8002] [--address 127.0.0.1] [--workdir build/serve/<grpc port>]
      [--render-only]

Rendering writes `<workdir>/deployment.yaml` (the effective deployment, checkpoint resolved — the tiny one is
made here, once, before any stub starts) and `<workdir>/model_repository/` (each `config.pbtxt` filled in
from the deployment, each `model.py` copied). The server binds loopback unless `--address` says otherwise.
Each server has its own workdir (its cancel and drain marks live there), held by a lock while it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from string import Template

import yaml

from ..deployment import DEFAULT_CONFIG, Deployment
from ..model.provision import resolve_checkpoint
from .cancel import CancelMarks
from .launcher import (
    ServerConfig,
    free_port,
    launch_server,
    ports_in_use,
    stop_server,
    stub_pids,
    wait_until_ready,
)

REPO_TEMPLATE = Path(__file__).resolve().parents[2] / "model_repository"
MODELS = ("cosmos3", "cosmos3_prefill", "cosmos3_denoise", "cosmos3_vae_decode")


def render(deployment: Deployment, workdir: Path) -> tuple[Path, Deployment]:
    """→ (model repository, the effective deployment it serves)."""
    workdir = workdir.absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    deployment = dataclasses.replace(
        deployment,
        checkpoint=str(resolve_checkpoint(deployment.checkpoint).absolute()),
        # always this workdir's: a shared one would let one server's drain mark stop every other server
        cancel_dir=str(workdir / "cancelled"),
    )
    shutil.rmtree(deployment.cancel_dir, ignore_errors=True)  # no stale cancel or drain marks from a previous run
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


def start(
    deployment: Deployment, workdir: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list[int], Deployment]:
    """Render and launch on free loopback ports (benchmarks, soak, tests) → (process, [grpc, http, metrics],
    the effective deployment). Not yet ready: `wait_until_ready(ports[1], proc=proc)`."""
    repo, deployment = render(deployment, workdir)
    ports = [free_port() for _ in range(3)]
    cpu_only = not deployment.torch_device.startswith("cuda")
    proc = launch_server(
        ServerConfig(repo, *ports, cpu_only=cpu_only, log_path=Path(workdir) / "tritonserver.log"), env
    )
    return proc, ports, deployment


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cosmos3_core.triton.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="deployment YAML; default configs/tiny.yaml")
    ap.add_argument("--checkpoint", default=None, help="override the config's checkpoint")
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

    ports = [p or free_port() for p in (args.grpc_port, args.http_port, args.metrics_port)]
    if not args.render_only:
        busy = ports_in_use(dict(zip(("grpc", "http", "metrics"), ports)), args.address)
        if busy:
            print(f"error: cannot listen on {args.address}: {', '.join(busy)}", file=sys.stderr)
            return 1
    workdir = Path(args.workdir or f"build/serve/{ports[0]}")
    if lock_workdir(workdir) is None:
        holder = (workdir / ".lock").read_text().strip()
        print(f"error: {workdir.absolute()} is in use by another server (pid {holder}); pass another --workdir",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        deployment = Deployment.load(args.config, checkpoint=args.checkpoint)
    except (ValueError, OSError) as e:  # a config error names its field: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    repo, deployment = render(deployment, workdir)
    print(f"rendered {repo}", file=sys.stderr)
    if args.render_only:
        return 0
    host = args.address if args.address != "0.0.0.0" else "127.0.0.1"
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    while not stopping.is_set():
        cpu_only = not deployment.torch_device.startswith("cuda")
        proc = launch_server(ServerConfig(repo, *ports, args.address, cpu_only, extra=tuple(args.extra)))
        try:
            waited = wait_until_ready(ports[1], host=host, proc=proc)
        except (RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            stop_server(proc)
            return 1
        print(
            f"ready in {waited:.1f}s: grpc {args.address}:{ports[0]}  http :{ports[1]}  metrics :{ports[2]}",
            file=sys.stderr,
        )
        reason = supervise(proc, stopping)
        if reason is None:  # asked to stop: drain, then stop the server
            drain(deployment, ports[2], host)
            return stop_server(proc)
        print(f"{reason}; restarting tritonserver (its in-flight requests end with errors)", file=sys.stderr)
        stop_server(proc, timeout_s=5)
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


def drain(deployment: Deployment, metrics_port: int, host: str) -> None:
    """Stop admitting; wait until no request is live or waiting (the engine ends stragglers after its drain
    timeout). Then tritonserver can stop with nothing in flight."""
    import re
    import time
    import urllib.request

    marks = CancelMarks(deployment.cancel_dir)
    marks.drain()
    deadline = time.monotonic() + deployment.drain_timeout_s + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            text = urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=5).read().decode()
        except OSError:
            break
        busy = sum(float(v) for v in re.findall(r"^cosmos3_(?:live_requests|queue_depth)\{[^}]*\} (\S+)$", text, re.M))
        if busy == 0:
            time.sleep(1.0)  # let the last responses pass the decode step
            break
    marks.undrain()


def supervise(proc, stopping: threading.Event) -> str | None:
    """Wait until asked to stop (→ None) or the server or one of its Python stubs dies (→ why). A dead
    decoupled stub is not restarted by Triton 2.51 ('Stub process ... is not healthy' for every later
    request), so the whole server is restarted."""
    stubs = stub_pids(proc)
    while not stopping.wait(1.0):
        if proc.poll() is not None:
            return f"tritonserver exited with {proc.returncode}"
        alive = stub_pids(proc)
        dead = sorted(set(stubs) - set(alive))
        if dead:
            return f"Python stub(s) died: {', '.join(stubs[p] for p in dead)}"
    return None


if __name__ == "__main__":
    sys.exit(main())
