"""A dead part, measured: start the supervised server (`python -m cosmos3_core.triton.serve`, the tiny default unless
--config says otherwise), and for each part send a request, SIGKILL that part's Python stub while the request is
being denoised, and report

- readiness: how long until the front's `/v2/health/ready` answers 503, and its text;
- the request in flight: its error text (as the client prints it) and how long after the kill it came, or that it
  finished (prefill's death: the request is past it);
- service back: how long after the kill readiness answered 200 again (`ready_again_s`), and when a new request
  was served (`served_again_s`: readiness polled, then one 2-step request, whose own time is `probe_s`). The probe
  does not wait for the request in flight: after a prefill kill that one still runs, and the two share denoise's
  forwards, so `probe_s` there includes some of its steps;
- `cosmos3_restarts_total{part}` after it.

Then (--drain) one request in flight and SIGINT: how long until readiness answers 503, and how the request ended.

  python -m bench.faults_part --part denoise|vae_decode|prefill|admit|all [--config configs/tiny.yaml]
      [--checkpoint DIR] [--set KEY=YAML ...] [--drain]
      [--steps 50] [--json out/faults_part.json]

On a GPU (the acceptance "a dead part is served again within 10 s, each part"), Edge with warm caches:
  python -m bench.faults_part --config configs/edge.yaml --checkpoint /models/Cosmos3-Edge --part all --steps 20 \
      --json out/faults_part_edge.json
(random weights at Edge's shapes, no guardrail: `--checkpoint random:edge --set safety_checker=none`)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from client.stream import ServerError, generate
from cosmos3_core.errors import model_of
from cosmos3_core.triton.launcher import free_ports

from . import prom

PARTS = ("denoise", "vae_decode", "prefill", "admit")
# the stubs' startup lines (prefill.py, denoise.py, decode.py) and the supervisor's (serve.py): where a reload's time goes
STARTUP = r"ready in|built in|warmup of \d+ shapes|reloaded in"


class Supervised:
    """`python -m cosmos3_core.triton.serve` on free loopback ports, in a session of its own (its log in workdir)."""

    def __init__(self, config: str, workdir: Path, env: dict[str, str] | None = None, extra_args: list[str] = ()):
        self.grpc, self.http, self.metrics = free_ports(3)
        self.url, self.workdir = f"127.0.0.1:{self.grpc}", workdir.absolute()
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = open(workdir / "serve.log", "wb")  # noqa: SIM115 - closed by stop()
        cmd = [sys.executable, "-m", "cosmos3_core.triton.serve", "--config", config, "--workdir", str(self.workdir),
               "--grpc-port", str(self.grpc), "--http-port", str(self.http), "--metrics-port", str(self.metrics), *extra_args]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def ready(self) -> tuple[int, str]:
        """(status of `/v2/health/ready`, its body); 0 when nothing answers."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while self.ready()[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: see {self.workdir / 'serve.log'}")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: see {self.workdir / 'serve.log'}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def stub(self, part: str) -> int:
        pids = self.stubs(model_of(part))
        if len(pids) != 1:
            raise RuntimeError(f"expected one {model_of(part)} stub, found {pids}")
        return pids[0]

    def stubs(self, model: str = "") -> list[int]:
        """The Python stubs of this server (of `model` only, if given)."""
        pattern = f"triton_python_backend_stub {self.workdir}/model_repository/{model}{'/' if model else ''}"
        return [int(p) for p in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()]

    def tritonserver(self) -> tuple[int, int] | None:
        """The running tritonserver of this supervisor as (pid, start time in clock ticks since boot): one value per
        life of it, a whole restart gives another. None while there is none (dead, not yet reaped, or starting)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                comm, rest = (entry / "stat").read_text().rsplit(")", 1)
                fields = rest.split()  # state, ppid, ... starttime is the 20th after the name
                if comm.split("(", 1)[1] == "tritonserver" and int(fields[1]) == self.proc.pid and fields[0] != "Z":
                    return int(entry.name), int(fields[19])
            except (OSError, IndexError, ValueError):
                continue
        return None

    def log_size(self) -> int:
        """Where the server's log (the supervisor's, tritonserver's and its stubs' lines) ends now."""
        return (self.workdir / "serve.log").stat().st_size

    def startup_lines(self, since: int) -> list[str]:
        """The stubs' startup timings and the supervisor's reload time logged after byte `since` of the server's log
        (what a reload spent where)."""
        with open(self.workdir / "serve.log", "rb") as fh:
            fh.seek(since)
            text = fh.read().decode(errors="replace")
        return [line.split("] ", 1)[-1] for line in text.splitlines() if re.search(STARTUP, line)]

    def metrics_text(self) -> str:
        return prom.scrape(self.metrics)

    def gauge(self, name: str) -> float:
        """A cosmos3_* sample summed over its instances."""
        return prom.total(self.metrics_text(), name)

    def restarts(self) -> dict[str, float]:
        return {labels["part"]: v for labels, v in prom.samples(self.metrics_text(), "cosmos3_restarts_total")}

    def stop(self, timeout_s: float = 120) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


class InFlight:
    """One request in a thread: `started` is set at its first progress event; then `result` or `error` and `t_end`."""

    def __init__(self, url: str, params: dict, seed: int, prompt: str | None = None):
        self.started = threading.Event()
        self.result = self.error = None
        self.t_end: float | None = None
        prompt = prompt or f"a red fox, take {seed}"
        self.thread = threading.Thread(target=self._run, args=(url, prompt, params, seed), daemon=True)
        self.thread.start()

    def _run(self, url: str, prompt: str, params: dict, seed: int) -> None:
        try:
            self.result = generate(url, prompt, {**params, "seed": seed},
                                   on_event=lambda e, f: self.started.set(), timeout_s=300)  # fmt: skip
        except ServerError as e:
            self.error = str(e)
        self.t_end = time.monotonic()
        self.started.set()


def kill_part(
    server: Supervised, part: str, steps: int, seed: int, back_timeout_s: float, queued_prompt: str | None = None
) -> dict:
    """SIGKILL `part`'s stub while a request is being denoised; what the operator and the client saw. With
    `queued_prompt`: two requests of it, the second waiting in the engine's queue for K/V pages at the kill (the
    prompt must be long enough that two overrun the pool, short enough that one fits)."""
    before = server.restarts().get(part, 0.0)
    req = InFlight(server.url, {"steps": steps}, seed, queued_prompt)
    if not req.started.wait(120) or req.t_end is not None:
        raise RuntimeError(f"the request did not start denoising: {req.error}")
    waiting = None
    if queued_prompt is not None:
        waiting = InFlight(server.url, {"steps": steps}, seed + 1, queued_prompt)
        deadline = time.monotonic() + 60
        while server.gauge("cosmos3_queue_depth") < 1:
            if time.monotonic() > deadline or waiting.t_end is not None:
                raise RuntimeError(f"the second request did not wait in the engine's queue: {waiting.error}")
            time.sleep(0.05)
    pid = server.stub(part)
    log_at = server.log_size()
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    back: list[float] = []  # when readiness answered 200 again, polled from the kill on (not after the request ends)

    def watch() -> None:
        seen_down = False
        while time.monotonic() - t_kill < back_timeout_s:
            up = server.ready()[0] == 200
            if seen_down and up:
                back.append(time.monotonic() - t_kill)
                return
            seen_down = seen_down or not up
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    status, body = server.ready()
    while status == 200 and time.monotonic() - t_kill < 30:
        time.sleep(0.02)
        status, body = server.ready()
    t_unready = time.monotonic() - t_kill
    out = {
        "part": part,
        "readiness_false_s": round(t_unready, 2),
        "readiness": f"{status} {json.loads(body).get('error', '') if body.startswith('{') else body}".strip(),
    }
    while True:  # service back: readiness, then one small request served (beside the one in flight, if it still is)
        elapsed = time.monotonic() - t_kill
        if elapsed > back_timeout_s:
            out["served_again_s"] = None
            break
        if server.ready()[0] == 200:
            try:
                t_probe = time.monotonic()
                generate(server.url, "after the fault", {"steps": 2, "seed": seed + 1}, timeout_s=120)
                out["served_again_s"] = round(time.monotonic() - t_kill, 2)
                out["probe_s"] = round(time.monotonic() - t_probe, 2)  # the 2-step request's own time
                break
            except ServerError as e:
                out.setdefault("refused_meanwhile", str(e))
        time.sleep(0.1)
    watcher.join(5)
    req.thread.join(300)
    out["in_flight"] = f"error: {req.error}" if req.error is not None else "finished"
    out["in_flight_end_s"] = round(req.t_end - t_kill, 2) if req.t_end is not None else None
    if waiting is not None:
        waiting.thread.join(30)
        out["queued"] = "no answer within 30 s" if waiting.t_end is None else (
            f"error: {waiting.error}" if waiting.error is not None else "finished")  # fmt: skip
        out["queued_end_s"] = round(waiting.t_end - t_kill, 2) if waiting.t_end is not None else None
    out["ready_again_s"] = round(back[0], 2) if back else None
    out["restarts_total"] = server.restarts().get(part, 0.0) - before
    out["startup"] = server.startup_lines(log_at)
    return out


def drain(server: Supervised, steps: int, seed: int) -> dict:
    """SIGINT with a request in flight: readiness from the first moment, and the request's end."""
    req = InFlight(server.url, {"steps": steps}, seed)
    req.started.wait(120)
    t_sig = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    status, _ = server.ready()
    while status == 200 and time.monotonic() - t_sig < 30:
        time.sleep(0.02)
        status, _ = server.ready()
    t_unready = time.monotonic() - t_sig
    req.thread.join(300)
    ok = req.result is not None and req.result.events[-1]["type"] == "done"
    return {"part": "drain (SIGINT)", "readiness_false_s": round(t_unready, 2), "readiness": str(status),
            "in_flight": "finished" if ok else f"error: {req.error}",
            "in_flight_end_s": round(req.t_end - t_sig, 2) if req.t_end else None,
            "exit_code": server.proc.wait(180)}  # fmt: skip


def markdown(rows: list[dict]) -> str:
    head = ("| killed | readiness 503 after | readiness says | request in flight | its end after kill | ready again after "
            "| served again after (its 2-step request) | restarts_total |")  # fmt: skip
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        back = (f"{r['served_again_s']} s ({r.get('probe_s', '-')} s)" if r.get("served_again_s")
                else f"exit code {r.get('exit_code', '-')}")  # fmt: skip
        ready = f"{r['ready_again_s']} s" if r.get("ready_again_s") else "-"
        cells = [r["part"], f"{r['readiness_false_s']} s", r["readiness"], r["in_flight"],
                 f"{r['in_flight_end_s']} s", ready, back, r.get("restarts_total", "-")]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.faults_part", description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="all", choices=(*PARTS, "all"))
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--checkpoint", default=None, help="override the config's checkpoint")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML", help="override a top-level config key")
    ap.add_argument("--steps", type=int, default=50, help="of the request in flight (long enough to kill mid-way)")
    ap.add_argument("--drain", action="store_true", help="end with a drain (SIGINT) with a request in flight")
    ap.add_argument("--back-timeout", type=float, default=300.0, help="give up waiting for service after this")
    ap.add_argument("--workdir", default="build/faults_part")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    extra = (["--checkpoint", args.checkpoint] if args.checkpoint else []) + [f"--set={item}" for item in args.set]
    server = Supervised(args.config, Path(args.workdir), extra_args=extra)
    rows: list[dict] = []
    try:
        print(f"server ready in {server.wait_ready(900):.1f}s", file=sys.stderr)
        for i, part in enumerate(PARTS if args.part == "all" else (args.part,)):
            rows.append(kill_part(server, part, args.steps, 100 + 10 * i, args.back_timeout))
            print(json.dumps(rows[-1]), file=sys.stderr)
        if args.drain:
            rows.append(drain(server, args.steps, 200))
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        server.stop()
    print(markdown(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
