"""Rank 0's handle on a group of worker processes: start, commands, failure, restart, close.

Design: the process that serves (the Triton denoise or decode instance, or the offline CLI) is rank 0. It
starts `ranks - 1` worker processes (`python -m cosmos3_core.parallel.worker`, one per further GPU: rank r uses
`cuda:r`), rendezvous through a TCPStore it hosts on a free loopback port, and drives them with commands
(`comm.send_command`): the workers run no scheduler and no sink, only what a command says (write pages, run a
step's rows, decode a chunk); every decision stays on rank 0. `session()` holds the group for one command and the
collectives that follow it, so the engine thread and a decode thread never interleave theirs.

Failure: a worker that dies makes the collective in flight fail (gloo: its sockets close; NCCL: a watchdog sees
the dead process and aborts the communicators). `session()` then tears the group down (the other workers are
ended, the process group destroyed), records why, and raises `WorkerLost`; the next session starts a fresh group
(`generation` counts them). Whatever a worker held (its pool pages, decoder caches) is gone with it: callers
fail the requests that depended on it (see `denoise.ParallelStep`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .comm import Comm, send_command
from .config import NO_MULTICAST, ParallelConfig


class WorkerLost(RuntimeError):
    pass


@dataclass(frozen=True)
class WorkerSpec:
    """What each worker loads; JSON on its command line."""

    checkpoint: str
    device: str  # "cpu" or "cuda" (rank r then uses cuda:r)
    dtype: str  # a torch dtype name: float32, bfloat16, ...
    parallel: ParallelConfig
    roles: tuple[str, ...] = ("denoise",)  # denoise: the GEN tower and a pool shard; decode: the VAE decoder
    pool_pages: int = 256
    page_size: int = 16
    attention: str = "auto"
    compile: bool = False
    cuda_graphs: bool = True
    max_captures: int = 16  # the deployment's: CUDA graphs each rank's step holds at once
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the workers (tests: faults)
    # the deployment's precision and FP8 step-policy overrides (deployment.py): workers serve the GEN tower in the
    # same precision as rank 0, and each row says its step's W8A16/W8A8 choice (`Row.a16`)
    precision: str = "checkpoint"
    fp8_policy: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "parallel": asdict(self.parallel)})

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        raw = json.loads(text)
        return cls(**{**raw, "parallel": ParallelConfig(**raw["parallel"]), "roles": tuple(raw["roles"])})

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"


def worker_python() -> str:
    """The interpreter for the workers. Ours when we run on one (`sys.executable` sits in `sys.prefix/bin`); in a
    Triton stub `sys.executable` is not a Python, and the stub's packages come from the `python3` first on PATH
    (the venv's: see triton.md), so that one."""
    exe = Path(sys.executable) if sys.executable else None
    if exe is not None and exe.parent == Path(sys.prefix) / "bin":
        return str(exe)
    return shutil.which("python3") or sys.executable


def _end(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Group:
    """Rank 0 of a group of `spec.parallel.ranks` processes. `timeout_s` bounds each collective (a last resort:
    death is noticed at once)."""

    def __init__(self, spec: WorkerSpec, timeout_s: float = 1800.0):
        if spec.parallel.ranks < 2:
            raise ValueError("parallel: a group needs at least 2 ranks (cfg × ulysses or vae > 1)")
        if spec.device.startswith("cuda") and torch.cuda.device_count() < spec.parallel.ranks:
            raise ValueError(
                f"parallel: needs {spec.parallel.ranks} GPUs (one per rank), {torch.cuda.device_count()} visible"
            )
        self.spec, self.timeout_s = spec, timeout_s
        self.device = "cuda:0" if spec.device.startswith("cuda") else "cpu"
        self.comm = Comm(0, spec.parallel)
        self.generation = 0  # groups started so far
        self.lost: str | None = None  # why the last group ended, when it failed
        self.procs: list[subprocess.Popen] = []
        self.running = False
        self._lock = threading.RLock()
        self._busy = False
        self._closed = False
        self._finalizer = weakref.finalize(self, _end, self.procs)  # workers never outlive rank 0's handle
        # the watchdog holds a weak reference: a dropped handle still ends its workers (the finalizer)
        self._watchdog = threading.Thread(
            target=Group._watch, args=(weakref.ref(self),), name="cosmos3-parallel-watchdog", daemon=True
        )
        self._watchdog.start()
        self.start()

    # ---- lifecycle ----
    def start(self) -> None:
        with self._lock:
            if self.running:
                return
            if dist.is_initialized():  # torch.distributed has one default group per process
                raise RuntimeError("parallel: this process already drives a group (one group per process)")
            for k, v in NO_MULTICAST.items():  # rank 0's own NCCL reads them too (at communicator creation)
                os.environ.setdefault(k, v)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            ranks = self.spec.parallel.ranks
            store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, timeout=timeout, wait_for_workers=False)
            env = {**os.environ, **self.spec.env, **NO_MULTICAST}
            self.procs[:] = [
                subprocess.Popen(
                    [
                        worker_python(),
                        "-m",
                        "cosmos3_core.parallel.worker",
                        str(r),
                        str(store.port),
                        self.spec.to_json(),
                    ],
                    env=env,
                )
                for r in range(1, ranks)
            ]
            try:
                dist.init_process_group(self.spec.backend, store=store, rank=0, world_size=ranks, timeout=timeout)
                self.comm.build()
                self._busy = True
                dist.barrier()  # the workers have loaded their parts
            except Exception as e:
                self._teardown()
                raise WorkerLost(f"parallel group failed to start: {self._why(e)}") from e
            finally:
                self._busy = False
            self.running = True
            self.generation += 1

    def close(self) -> None:
        with self._lock:
            if self.running:
                with contextlib.suppress(Exception):
                    send_command({"op": "stop"}, [], self.device)
            self._teardown()
            self._closed = True

    def _teardown(self) -> None:
        _end(self.procs)
        self.procs.clear()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.running = False

    # ---- commands ----
    @contextlib.contextmanager
    def session(self, op: str, meta: dict[str, Any], tensors: list[torch.Tensor]) -> Iterator[Comm]:
        """Send a command and hold the group for the collectives that follow it (the body). A failure anywhere in
        it ends the group and raises WorkerLost; the next session restarts it."""
        with self._lock:
            if self._closed:
                raise WorkerLost("parallel group is closed")
            self.start()
            self._busy = True
            try:
                send_command({"op": op, **meta}, tensors, self.device)
                yield self.comm
            except Exception as e:
                self.lost = (
                    f"parallel worker lost during {op!r} ({self._why(e)}); the requests it was serving failed; "
                    "the group restarts for the next request"
                )
                self._teardown()
                raise WorkerLost(self.lost) from e
            finally:
                self._busy = False

    def _why(self, e: BaseException) -> str:
        dead = [(r + 1, p.pid, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
        if dead:
            return ", ".join(f"rank {r} (pid {pid}) exited with code {code}" for r, pid, code in dead)
        return f"{type(e).__name__}: {str(e)[:300]}"

    @staticmethod
    def _watch(ref: weakref.ref) -> None:
        """NCCL does not notice a dead peer by itself (gloo's sockets do): abort the communicators so the
        collective in flight raises."""
        while (group := ref()) is not None and not group._closed:
            nccl_stuck = group._busy and group.spec.backend == "nccl"
            if nccl_stuck and any(p.poll() is not None for p in list(group.procs)):
                with contextlib.suppress(Exception):
                    dist.distributed_c10d._abort_process_group()
            del group
            time.sleep(0.5)
