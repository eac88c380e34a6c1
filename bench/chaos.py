"""Chaos soak: concurrent mixed streams through the supervised server while its parts are SIGKILLed and clients cancel.

  python -m bench.chaos [--config configs/tiny.yaml] [--minutes 10] [--concurrency 8] [--kill-every 20]
      [--cancel 0.2] [--seed 0] [--json out/chaos.json] [--back-within S]

Starts `python -m cosmos3_core.triton.serve` on free ports. `concurrency` clients loop over mixed requests
(single-shot video, AR chained, AR kv, with sound when the checkpoint has it), each cancelled at a random event with
probability `cancel` (raw tritonclient: `stop_stream(cancel_requests=True)`); every ~`kill-every` s (once the server
is ready) a random part's stub (admit, prefill, denoise, vae_decode) is SIGKILLed. Then it checks

- every stream ended: completed, cancelled by its client, or an error whose text is one of docs/operations.md's
  (a part died or restarts, over capacity, the server unreachable); none without an answer;
- none hung: a stream ended by a part's death got its error within 5 s of that kill (or of its own send, if later);
  prefill's queued requests are answered by Triton itself, one a second: within 20 s;
- every part came back every time: readiness 200 and a request served after each kill (within `back-within` s), and
  `cosmos3_restarts_total{part}` counts each kill;
- afterwards the K/V pool is all free and nothing is live or queued;
- the counters add up: every request sent (streams and probes, less those that never reached the server) is counted
  once, in `cosmos3_requests_total` (over the soak: its delta) or, for the requests Triton itself answered because
  the stub they reached was dead, in tritonserver's `nv_inference_request_failure{reason="BACKEND"}` of
  cosmos3_admit, cosmos3_prefill and cosmos3_denoise;
- after the server stops: no process of it and no shared-memory region of it left.

With a GPU config (`--config configs/edge.yaml --checkpoint DIR`, caches warm) `--kill-every` large and `--minutes`
small measure each part's time to be served again (the `back_s` of each kill).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.faults_part import Supervised
from client.stream import ServerError, generate
from cosmos3_core import errors

PARTS = ("admit", "prefill", "denoise", "vae_decode")
HUNG_S = 5.0  # a stream ended by a part's death must have its error within this long of the kill
# prefill is not decoupled: Triton itself answers the requests queued at its dead stub, one a second (its health poll
# per execute; docs/operations.md, not covered): the k-th queued one after about k s; bounded so that a hang still fails
TRITON_ANSWERS_S = 20.0


def make_params(rng: random.Random, kind: str) -> dict:
    p = {"seed": rng.randrange(1 << 30), "steps": rng.randint(2, 6), "height": 32, "width": 64}
    if kind == "single":
        p["num_frames"] = rng.choice([9, 17])
    elif kind == "chained":
        p.update(window_mode="chained", num_frames=25, window_frames=13, overlap_frames=8)
    elif kind == "kv":
        p.update(window_mode="kv", num_frames=25, window_frames=9, context_frames=9)
    else:  # sound
        p.update(num_frames=9, enable_sound=True)
    return p


def known_error(text: str) -> bool:
    """One of the texts of docs/operations.md's table a client may get while parts die."""
    fixed = (errors.OVER_CAPACITY, errors.DRAINING, errors.SERVER_RESTARTING)
    return (text in fixed or any(text in (errors.part_died(p), errors.part_restarting(p)) for p in PARTS)
            or text.startswith("cannot reach the server"))  # fmt: skip


class Chaos:
    def __init__(self, server: Supervised, concurrency: int, kill_every: float, cancel: float, seed: int,
                 back_within: float):  # fmt: skip
        self.server, self.concurrency, self.kill_every = server, concurrency, kill_every
        self.cancel, self.back_within = cancel, back_within
        self.rng = random.Random(seed)
        self.kinds = ["single", "chained", "kv", "sound"]
        self.streams: list[dict] = []
        self.kills: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.probes = 0  # requests sent besides the clients' streams (the back? and sound? probes)
        self.before = counters(server)  # the server's counters as the soak starts

    def client(self, i: int) -> None:
        rng = random.Random(self.rng.randrange(1 << 30))
        while not self.stop.is_set():
            kind = rng.choice(self.kinds)
            cancel_at = rng.randint(1, 12) if rng.random() < self.cancel else None
            seen = [0]

            def cancel_after(event: dict, at=cancel_at, seen=seen) -> bool:
                seen[0] += 1
                return at is not None and seen[0] >= at

            s = {"client": i, "kind": kind, "t0": time.monotonic()}
            try:
                r = generate(self.server.url, f"chaos {i} {kind}", make_params(rng, kind), cancel_after=cancel_after,
                             timeout_s=120)  # fmt: skip
                s["end"] = "completed" if r.events and r.events[-1]["type"] == "done" else "cancelled"
            except ServerError as e:
                s["end"] = f"error: {e}"
                if kind == "sound" and "enable_sound" in str(e):  # a checkpoint without sound: not a failure
                    s["end"] = "no sound"
                    if "sound" in self.kinds:
                        self.kinds.remove("sound")
            s["t1"] = time.monotonic()
            with self.lock:
                self.streams.append(s)
            if s["end"].startswith("error") and not self.stop.is_set():
                time.sleep(0.5)  # a refusal while a part reloads: retry a moment later, as a client would

    def killer(self, start: float) -> None:
        next_kill = start + self.kill_every
        while not self.stop.wait(0.2):
            if time.monotonic() < next_kill or self.server.ready()[0] != 200:
                continue
            part = self.rng.choice(PARTS)
            try:
                pid = self.server.stub(part)
            except RuntimeError:
                continue  # between a stub's death and its new one
            kill = {"part": part, "t": time.monotonic()}
            subprocess.run(["kill", "-KILL", str(pid)], check=False)
            with self.lock:
                self.kills.append(kill)
            kill["back_s"] = self.wait_back(kill["t"])
            next_kill = time.monotonic() + self.kill_every * self.rng.uniform(0.5, 1.5)

    def wait_back(self, t_kill: float) -> float | None:
        """Seconds from the kill until readiness is 200 and one small request was served; None past back_within."""
        while time.monotonic() - t_kill < self.back_within and not self.stop.is_set():
            if self.server.ready()[0] == 200:
                with self.lock:
                    self.probes += 1
                try:
                    generate(self.server.url, "back?", {"steps": 1, "num_frames": 1, "height": 32, "width": 32},
                             timeout_s=60)  # fmt: skip
                    return round(time.monotonic() - t_kill, 2)
                except ServerError:
                    pass
            time.sleep(0.2)
        return None

    def run(self, minutes: float) -> dict:
        t0 = time.monotonic()
        if self.probe_sound() is False:
            self.kinds.remove("sound")
        clients = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.concurrency)]
        killer = threading.Thread(target=self.killer, args=(t0,), daemon=True)
        for t in [*clients, killer]:
            t.start()
        self.stop.wait(minutes * 60)
        self.stop.set()
        killer.join(self.back_within + 60)
        for t in clients:
            t.join(180)
        hung_clients = sum(t.is_alive() for t in clients)
        if self.kills and self.kills[-1].get("back_s") is None:  # the run ended during the last reload
            self.stop.clear()
            self.kills[-1]["back_s"] = self.wait_back(self.kills[-1]["t"])
        return self.report(hung_clients, time.monotonic() - t0)

    def probe_sound(self) -> bool | None:
        self.probes += 1
        try:
            generate(self.server.url, "sound?", make_params(random.Random(0), "sound"), timeout_s=120)
            return True
        except ServerError as e:
            return False if "enable_sound" in str(e) else None

    def died_by(self, s: dict) -> dict | None:
        """The kill whose part's death ended this stream (the latest kill of that part before its end)."""
        part = next((p for p in PARTS if s["end"] == f"error: {errors.part_died(p)}"), None)
        kills = [k for k in self.kills if k["part"] == part and k["t"] <= s["t1"]]
        return kills[-1] if kills else None

    def report(self, hung_clients: int, took: float) -> dict:
        ends: dict[str, int] = {}
        unclear, hung, worst = [], [], {}
        for s in self.streams:
            key = s["end"] if not s["end"].startswith("error") else "error"
            ends[key] = ends.get(key, 0) + 1
            if s["end"].startswith("error: ") and not known_error(s["end"][7:]):
                unclear.append(s["end"])
            if (k := self.died_by(s)) is not None:
                bound = TRITON_ANSWERS_S if k["part"] == "prefill" else HUNG_S
                # a stream sent after the kill (it reached the dead instance while the part reloaded): from its send
                after = round(s["t1"] - max(k["t"], s["t0"]), 2)
                worst[k["part"]] = max(worst.get(k["part"], 0.0), after)
                if after > bound:
                    hung.append({"part": k["part"], "ended_after_kill_s": after})
        gauges = {g: self.server.gauge(g) for g in ("cosmos3_kv_pages_used", "cosmos3_live_requests",
                                                    "cosmos3_queue_depth")}  # fmt: skip
        unreached = sum(s["end"].startswith("error: cannot reach the server") for s in self.streams)
        sent = len(self.streams) + self.probes - unreached
        for _ in range(10):  # a client that cancelled left at once: the server counts it a moment later
            time.sleep(0.5)
            now = counters(self.server)
            counted = {o: now["outcomes"][o] - self.before["outcomes"][o] for o in OUTCOMES}
            by_triton = {m: now["by_triton"][m] - self.before["by_triton"][m] for m in TRITON_ANSWERS}
            identity = {"sent": sent, "counted": sum(counted.values()), "answered_by_triton": sum(by_triton.values()),
                        "by_triton": by_triton, "unreached": unreached}  # fmt: skip
            identity["difference"] = sent - identity["counted"] - identity["answered_by_triton"]
            if identity["difference"] == 0:
                break
        restarts = self.server.restarts()
        kills_of = {p: sum(k["part"] == p for k in self.kills) for p in PARTS}
        back = [k["back_s"] for k in self.kills]
        report = {
            "minutes": round(took / 60, 2),
            "streams": len(self.streams),
            "ends": ends,
            "kills": kills_of,
            "back_s": {p: [k["back_s"] for k in self.kills if k["part"] == p] for p in PARTS},
            "restarts_total": restarts,
            "unclear_errors": unclear[:10],
            "ended_after_its_part_died_s": worst,  # the slowest per part
            "hung": hung + [{"clients_without_an_answer": hung_clients}] * bool(hung_clients),
            "gauges_after": gauges,
            "counted": counted,
            "identity": identity,
        }
        report["checks"] = {
            "every stream ended": hung_clients == 0,
            "every error clear": not unclear,
            "none hung after its part's death": not hung,
            "every part came back every time": all(b is not None for b in back)
            and all(restarts.get(p, 0) == n for p, n in kills_of.items() if n),
            "pool all free, nothing live or queued": not any(gauges.values()),
            "the counters add up": identity["difference"] == 0,
        }
        return report


OUTCOMES = ("completed", "cancelled", "failed", "rejected", "bad_input", "refused")
# the steps whose requests Triton answers itself when the stub they reached is dead (its `nv_inference_request_failure`
# with reason BACKEND: our stubs' own error responses count as successes there); vae_decode's are steps of streams
# that denoise answers and counts
TRITON_ANSWERS = ("cosmos3_admit", "cosmos3_prefill", "cosmos3_denoise")


def counters(server: Supervised) -> dict:
    """`cosmos3_requests_total` by outcome, and the requests Triton itself failed per model (a dead stub's)."""
    text = server.metrics_text()

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(pattern, text, re.M))

    return {
        "outcomes": {o: total(rf'^cosmos3_requests_total\{{[^}}]*outcome="{o}"[^}}]*\}} (\S+)$') for o in OUTCOMES},
        "by_triton": {m: total(rf'^nv_inference_request_failure\{{(?=[^}}]*model="{m}")(?=[^}}]*reason="BACKEND")'
                               rf'[^}}]*\}} (\S+)$') for m in TRITON_ANSWERS},
    }  # fmt: skip


def leftovers(server: Supervised) -> dict:
    """After the server stopped: its processes and shared-memory regions still there (not this one's)."""
    procs = subprocess.run(["pgrep", "-f", str(server.workdir)], capture_output=True, text=True).stdout.split()
    procs = [p for p in procs if int(p) != os.getpid()]
    shm = [p.name for p in Path("/dev/shm").glob(f"cosmos3_pb_{server.proc.pid}_*")]
    return {"processes": procs, "shm": shm}


def run(config: str, workdir: Path, minutes: float, concurrency: int = 8, kill_every: float = 20.0,
        cancel: float = 0.2, seed: int = 0, back_within: float = 120.0, checkpoint: str | None = None) -> dict:  # fmt: skip
    """The soak → its report (`report["ok"]`: every check held)."""
    extra = ["--checkpoint", checkpoint] if checkpoint else []
    server = Supervised(config, workdir, extra_args=extra)
    try:
        started = server.wait_ready(1200)
        chaos = Chaos(server, concurrency, kill_every, cancel, seed, back_within)
        report = {"ready_s": round(started, 1), **chaos.run(minutes)}
    finally:
        code = server.stop()
    report["exit_code"] = code
    report["left"] = leftovers(server)
    report["checks"]["no process or shm left"] = not report["left"]["processes"] and not report["left"]["shm"]
    report["ok"] = all(report["checks"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (±50 %%), once ready")
    ap.add_argument("--cancel", type=float, default=0.2, help="share of requests the client cancels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--back-within", type=float, default=120.0, help="a part not served again by then fails the run")
    ap.add_argument("--workdir", default="build/chaos")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = run(args.config, Path(args.workdir), args.minutes, args.concurrency, args.kill_every, args.cancel,
                 args.seed, args.back_within, args.checkpoint)  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
