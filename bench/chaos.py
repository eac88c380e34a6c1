"""Chaos soak: concurrent mixed streams through the supervised server while its parts are SIGKILLed and clients cancel.

  python -m bench.chaos [--config configs/tiny.yaml] [--minutes 10] [--concurrency 8] [--kill-every 20]
      [--cancel 0.2] [--seed 0] [--json out/chaos.json] [--back-within S]
      [--targets admit,prefill,denoise,vae_decode[,tritonserver]] [--max-kills N] [--whole-pause S]

Starts `python -m cosmos3_core.triton.serve` on free ports. `concurrency` clients loop over mixed requests
(single-shot video, AR chained, AR kv, with sound when the checkpoint has it), each cancelled at a random event with
probability `cancel` (raw tritonclient: `stop_stream(cancel_requests=True)`); every ~`kill-every` s (once the server
is ready) a random target is SIGKILLed: a part's stub (admit, prefill, denoise, vae_decode), or with `tritonserver`
among the targets tritonserver itself, which the supervisor restarts whole (its stubs are paused `whole-pause` s
first, FREEZE_S by default, so that the dying server's last counts can be read; 0: a plain SIGKILL, as a crash).
Then it checks

- every stream ended: completed, cancelled by its client, or an error whose text is one of docs/operations.md's
  (a part died or restarts, over capacity, the server unreachable); none without an answer;
- none hung: a stream ended by a part's death got its error within 5 s of that kill (or of its own send, if later);
  prefill's queued requests are answered by Triton itself, one a second: within 20 s;
- every part came back every time: readiness 200 and a request served after each kill (within `back-within` s), and
  `cosmos3_restarts_total{part}` counts each kill;
- every whole restart of tritonserver (forced, or one the supervisor did itself: a tritonserver that crashed) was
  followed: each stream in flight when it died ended within 5 s of its death, a request sent after it was served
  again (within `back-within` s), and `cosmos3_restarts_total{part="tritonserver"}` counts each;
- afterwards the K/V pool is all free and nothing is live or queued;
- the counters add up: every request sent (streams and probes, less those that never reached the server) is counted
  once, in `cosmos3_requests_total` (over the soak: its delta) or, for the requests Triton itself answered because
  the stub they reached was dead, in tritonserver's `nv_inference_request_failure{reason="BACKEND"}` of
  cosmos3_admit, cosmos3_prefill and cosmos3_denoise;
- after the server stops: no process of it and no shared-memory region of it left.

A whole restart starts tritonserver's counters again from 0. A watcher follows tritonserver's process (pid and start
time: one per life of it) every WATCH_S and reads the counters every READ_EVERY looks, each read kept only when the
same tritonserver ran before and after it; the soak's totals are the sum over the lives of each life's last read
(less the first life's counts at the start). What a life counted after its last read is gone with it: only requests
that ended around its death can be among them (from COUNT_LAG_S before that read until COUNT_LAG_S after it was seen
gone, or with its stubs paused from the pause until the read; a client's cancel from CANCEL_LAG_S earlier, as the
server counts it at the stream's next step), so the identity's difference must lie between 0 and their number
(`unsure`). A killed door likewise loses the refusals it counted in its last moments (it hands them to Triton every
0.05 s, `door.PUBLISH_S`): a refusal a client got within DOOR_WINDOW_S of an admit kill is `unsure` too, and so is a
stream that ended around a vae_decode kill (DECODE_WINDOW_S: its last step in the dying stub, answered by Triton and
counted by none). With none of these the difference must be 0.

With a GPU config (`--config configs/edge.yaml --checkpoint DIR`, caches warm) `--kill-every` large and `--minutes`
small measure each part's time to be served again (the `back_s` of each kill).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench import prom
from bench.faults_part import Supervised
from client.stream import ServerError, generate
from cosmos3_core import errors

PARTS = ("admit", "prefill", "denoise", "vae_decode")
WHOLE = "tritonserver"  # the kill target that is tritonserver itself: the supervisor restarts it whole
TARGETS = (*PARTS, WHOLE)
HUNG_S = 5.0  # a stream ended by a part's death (or tritonserver's) must have its error within this long of the kill
# prefill is not decoupled: Triton itself answers the requests queued at its dead stub, one a second (its health poll
# per execute; docs/operations.md, not covered): the k-th queued one after about k s; bounded so that a hang still fails
TRITON_ANSWERS_S = 20.0
WATCH_S = 0.2  # how often the watcher looks at tritonserver's process (another one: a whole restart)
READ_EVERY = 2  # ... and reads the counters every this many looks
# A forced whole restart pauses every stub (SIGSTOP) this long before tritonserver's SIGKILL: the answers and counts
# they had handed over reach the clients and the metrics meanwhile, and the counters read then are the life's last.
# Under Triton's 1 s wait for a stub's answer, after which it asks whether the stub is alive.
FREEZE_S = 0.5
# the latest a request's count lands after its client has its answer (the door hands its counts over every 0.05 s)
COUNT_LAG_S = 0.5
# ... but a client that cancels leaves at once, and the server counts the cancel when the stream's next step reaches
# vae_decode (its next denoising step, or its start if it waits in the engine's queue): allowed this long, at the
# soak's end as around a whole restart
CANCEL_LAG_S = 5.0
# a refusal counted by a door killed within its last publish (door.PUBLISH_S, 0.05 s) dies with it; its client got the
# answer within milliseconds either side of the kill
DOOR_WINDOW_S = 0.15
DOOR_REFUSALS = (errors.OVER_CAPACITY, errors.DRAINING, *(errors.part_restarting(p) for p in PARTS))
# a stream whose last step was in a dying vae_decode's `execute` (or queued for it) is answered by Triton and counted by
# no stub, and one it answered just before it died may die with its count: a stream that ended from DECODE_WINDOW_S[0]
# before a vae_decode kill to DECODE_WINDOW_S[1] after it (Triton's answer comes within its ~1 s health check)
DECODE_WINDOW_S = (0.15, 2.0)
UNREACHED = "error: cannot reach the server"


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
                 back_within: float, targets: tuple[str, ...] = PARTS, max_kills: int | None = None,
                 whole_pause_s: float = FREEZE_S):  # fmt: skip
        self.server, self.concurrency, self.kill_every = server, concurrency, kill_every
        self.cancel, self.back_within = cancel, back_within
        self.targets, self.max_kills, self.whole_pause_s = tuple(targets), max_kills, whole_pause_s
        self.rng = random.Random(seed)
        self.kinds = ["single", "chained", "kv", "sound"]
        self.streams: list[dict] = []
        self.probes: list[dict] = []  # requests sent besides the clients' streams (the back? and sound? probes)
        self.kills: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ended = False  # set: the killer kills no more (the soak's end waits for what it cut short)
        self.watched = threading.Event()  # set: the watcher stops
        # one per life of tritonserver: its process, when it was seen, its last counters read, its death
        self.lives: list[dict] = [self.new_life(server.tritonserver(), time.monotonic())]
        first = self.read_life()
        if first is None:
            raise RuntimeError("the server's counters cannot be read")
        self.store(first)
        self.before = first["counts"]  # the server's counters as the soak starts
        self.t_start = time.monotonic()

    # ---- the clients ----
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

    def settled_gauges(self, within_s: float = 3.0) -> tuple[dict[str, float], dict[str, list]]:
        """The pool's and queues' gauges once they read 0, or as they read after `within_s` (the engine publishes
        them every 0.2 s and at each request's end) → (each summed over its instances, each one's samples)."""
        names = ("cosmos3_kv_pages_used", "cosmos3_live_requests", "cosmos3_queue_depth")
        deadline = time.monotonic() + within_s
        while True:
            text = self.server.metrics_text()
            gauges = {g: prom.total(text, g) for g in names}
            if not any(gauges.values()) or time.monotonic() > deadline:
                return gauges, {g: prom.samples(text, g) for g in names}
            time.sleep(0.25)

    def probe(self, prompt: str, params: dict) -> str:
        """One request of the soak's own, recorded like a stream → how it ended."""
        p = {"t0": time.monotonic()}
        try:
            generate(self.server.url, prompt, params, timeout_s=60 if prompt == "back?" else 120)
            p["end"] = "completed"
        except ServerError as e:
            p["end"] = f"error: {e}"
        p["t1"] = time.monotonic()
        with self.lock:
            self.probes.append(p)
        return p["end"]

    # ---- the kills ----
    def killer(self, start: float) -> None:
        next_kill = start + self.kill_every
        while not self.stop.wait(0.2) and not self.ended:
            if self.max_kills is not None and len(self.kills) >= self.max_kills:
                return
            if time.monotonic() < next_kill or self.server.ready()[0] != 200:
                continue
            target = self.rng.choice(self.targets)
            if target == WHOLE:
                t = self.kill_tritonserver()
                if t is None:
                    continue
                kill = {"part": WHOLE, "t": t}
            else:
                try:
                    pid = self.server.stub(target)
                except RuntimeError:
                    continue  # between a stub's death and its new one
                kill = {"part": target, "t": time.monotonic()}
                subprocess.run(["kill", "-KILL", str(pid)], check=False)
            with self.lock:
                self.kills.append(kill)
            kill["back_s"] = self.wait_back(kill["t"])
            next_kill = time.monotonic() + self.kill_every * self.rng.uniform(0.5, 1.5)

    def kill_tritonserver(self) -> float | None:
        """SIGKILL tritonserver itself (its stubs paused `whole_pause_s` first, and its counters read then) → when."""
        self.look()  # its life known before it ends
        life = self.server.tritonserver()
        if life is None:
            return None
        stubs = self.server.stubs() if self.whole_pause_s > 0 else []
        paused, killed = time.monotonic() if stubs else None, None
        try:
            for pid in stubs:
                _signal(pid, signal.SIGSTOP)
            if stubs:
                time.sleep(self.whole_pause_s)
                self.store(self.read_life())
            _signal(life[0], signal.SIGKILL)
            killed = time.monotonic()
        finally:
            if killed is None:
                for pid in stubs:
                    _signal(pid, signal.SIGCONT)
        with self.lock:
            mine = self.life_of(life)
            if mine is None:  # it started after the look above
                self.lives.append(mine := self.new_life(life, killed))
            mine["paused_at"], mine["killed_at"] = paused, killed
        return killed

    def wait_back(self, t_kill: float) -> float | None:
        """Seconds from the kill until readiness is 200 and one small request was served; None past back_within."""
        while time.monotonic() - t_kill < self.back_within and not self.stop.is_set():
            if self.server.ready()[0] == 200:
                if self.probe("back?", {"steps": 1, "num_frames": 1, "height": 32, "width": 32}) == "completed":
                    return round(time.monotonic() - t_kill, 2)
            time.sleep(0.2)
        return None

    # ---- tritonserver's lives and their counters ----
    @staticmethod
    def new_life(ident: tuple[int, int] | None, t: float) -> dict:
        return {"id": ident, "seen_at": t, "first_seen": t, "gone_at": None, "counts": None, "read_at": None,
                "paused_at": None, "killed_at": None}  # fmt: skip

    def life_of(self, ident: tuple[int, int]) -> dict | None:
        return next((life for life in reversed(self.lives) if life["id"] == ident), None)

    def read_life(self) -> dict | None:
        """The counters now, with the tritonserver they are of; None unless the same one ran before and after the
        read and the read has tritonserver's own metrics (the front answers its own alone while there is none)."""
        ident, t = self.server.tritonserver(), time.monotonic()
        try:
            text = self.server.metrics_text()
        except (OSError, http.client.HTTPException):
            return None
        if ident is None or self.server.tritonserver() != ident or not re.search(r"^nv_", text, re.M):
            return None
        return {"id": ident, "at": t, "counts": counters_of(text)}

    def store(self, read: dict | None) -> None:
        """A read becomes its life's last counters, unless a later one is already there."""
        if read is None:
            return
        with self.lock:
            life = self.life_of(read["id"])
            if life is not None and (life["read_at"] is None or read["at"] > life["read_at"]):
                life["counts"], life["read_at"] = read["counts"], read["at"]

    def look(self) -> None:
        """Another tritonserver than the last one seen: a whole restart (the old one seen gone now)."""
        ident, t = self.server.tritonserver(), time.monotonic()
        with self.lock:
            life = self.lives[-1]
            if ident == life["id"]:
                life["seen_at"], life["gone_at"] = t, None
                return
            if life["gone_at"] is None:
                life["gone_at"] = t
            if ident is not None:
                self.lives.append(self.new_life(ident, t))

    def watch(self) -> None:
        looks = 0
        while not self.watched.wait(WATCH_S):
            self.look()
            looks += 1
            if looks % READ_EVERY == 0:
                self.store(self.read_life())

    def whole_restarts(self) -> list[dict]:
        """Each life but the last ended in a whole restart: when it died, whether the soak killed it, when it was seen
        gone, when its counters were last read, and the window of ends whose counts it may have taken with it."""
        out = []
        for old, new in zip(self.lives, self.lives[1:]):
            forced = old["killed_at"] is not None
            died = old["killed_at"] if forced else old["seen_at"]  # not forced: it died after it was last seen
            read = old["read_at"] if old["read_at"] is not None else old["first_seen"]
            if old["paused_at"] is not None and old["read_at"] is not None and old["read_at"] >= old["paused_at"]:
                unsure = (old["paused_at"] - COUNT_LAG_S, old["read_at"])  # paused: nothing counted after the read
            else:
                unsure = (read - COUNT_LAG_S, (old["gone_at"] or new["first_seen"]) + COUNT_LAG_S)
            out.append({"forced": forced, "died": died, "gone": old["gone_at"] or new["first_seen"], "read": read,
                        "unsure": unsure})  # fmt: skip
        return out

    def served_after(self, t: float) -> float | None:
        """When the first request sent after `t` completed (a stream or a probe), if one did."""
        done = [r["t1"] for r in (*self.streams, *self.probes) if r["t0"] >= t and r["end"] == "completed"]
        return min(done, default=None)

    # ---- the soak ----
    def run(self, minutes: float) -> dict:
        t0 = self.t_start = time.monotonic()
        watcher = threading.Thread(target=self.watch, daemon=True)
        watcher.start()
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
        self.ended = True
        self.stop.clear()  # what the run's end cut short: the last reload, a whole restart not yet served again
        if self.kills and self.kills[-1].get("back_s") is None:
            self.kills[-1]["back_s"] = self.wait_back(self.kills[-1]["t"])
        deadline = time.monotonic() + self.back_within
        while self.lives[-1]["gone_at"] is not None and time.monotonic() < deadline:  # the new one not seen yet
            time.sleep(WATCH_S)
        for w in self.whole_restarts():
            if self.served_after(w["gone"]) is None:
                self.wait_back(w["died"])
        try:
            return self.report(hung_clients, time.monotonic() - t0)
        finally:
            self.watched.set()
            watcher.join(10)

    def probe_sound(self) -> bool | None:
        end = self.probe("sound?", make_params(random.Random(0), "sound"))
        return True if end == "completed" else (False if "enable_sound" in end else None)

    def died_by(self, s: dict) -> dict | None:
        """The kill whose part's death ended this stream (the latest kill of that part before its end)."""
        part = next((p for p in PARTS if s["end"] == f"error: {errors.part_died(p)}"), None)
        kills = [k for k in self.kills if k["part"] == part and k["t"] <= s["t1"]]
        return kills[-1] if kills else None

    def totals(self) -> tuple[dict, dict]:
        """(`cosmos3_requests_total` by outcome, Triton's own BACKEND failures per model) over the soak: each life's
        last read, summed (less the first life's counts at the start)."""
        counted, by_triton = dict.fromkeys(OUTCOMES, 0.0), dict.fromkeys(TRITON_ANSWERS, 0.0)
        with self.lock:
            for i, life in enumerate(self.lives):
                if life["counts"] is None:  # a life never read (it died starting): it counted nothing
                    continue
                base = self.before if i == 0 else {"outcomes": {}, "by_triton": {}}
                for o in OUTCOMES:
                    counted[o] += life["counts"]["outcomes"][o] - base["outcomes"].get(o, 0.0)
                for m in TRITON_ANSWERS:
                    by_triton[m] += life["counts"]["by_triton"][m] - base["by_triton"].get(m, 0.0)
        return counted, by_triton

    def life_summary(self, i: int) -> dict:
        """What one tritonserver counted over the soak (at its last read): requests ended, and those Triton itself
        failed."""
        life, base = self.lives[i], self.before if i == 0 else {"outcomes": {}, "by_triton": {}}
        c = life["counts"]
        if c is None:
            return {"counted": None, "answered_by_triton": None, "last_read_s": None}
        return {"counted": sum(v - base["outcomes"].get(o, 0.0) for o, v in c["outcomes"].items()),
                "answered_by_triton": sum(v - base["by_triton"].get(m, 0.0) for m, v in c["by_triton"].items()),
                "last_read_s": round(life["read_at"] - self.t_start, 2)}  # fmt: skip

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
        whole, hung_whole = [], []
        requests = [*self.streams, *self.probes]
        for w in self.whole_restarts():
            in_flight = [s for s in self.streams if s["t0"] < w["died"] < s["t1"]]
            slowest = max((round(s["t1"] - w["died"], 2) for s in in_flight), default=None)
            if slowest is not None and slowest > HUNG_S:
                hung_whole.append({"died_at_s": round(w["died"] - self.t_start, 2), "slowest_end_s": slowest})
            lo, hi = w["unsure"]
            served = self.served_after(w["gone"])
            whole.append({
                "forced": w["forced"],
                "died_at_s": round(w["died"] - self.t_start, 2),  # not forced: when it was last seen running
                # its counters' last read: a tritonserver that hung before it died answered nothing since
                "last_read_s": round(w["read"] - self.t_start, 2),
                "in_flight": len(in_flight),
                "in_flight_ends": _ends(in_flight),
                "slowest_in_flight_end_s": slowest,
                "served_again_s": round(served - w["died"], 2) if served is not None else None,
                "unsure_window_s": [round(lo - self.t_start, 2), round(hi - self.t_start, 2)],
                "unsure": sum(lo - CANCEL_LAG_S * (r["end"] == "cancelled") <= r["t1"] <= hi
                              and not r["end"].startswith(UNREACHED) for r in requests),
            })  # fmt: skip
        unreached = sum(r["end"].startswith(UNREACHED) for r in requests)
        sent = len(requests) - unreached
        door_kills = [k["t"] for k in self.kills if k["part"] == "admit"]
        door_unsure = sum(r["end"].removeprefix("error: ") in DOOR_REFUSALS
                          and any(abs(r["t1"] - t) <= DOOR_WINDOW_S for t in door_kills) for r in requests)  # fmt: skip
        decode_kills = [k["t"] for k in self.kills if k["part"] == "vae_decode"]
        decode_unsure = sum(any(-DECODE_WINDOW_S[0] <= r["t1"] - t <= DECODE_WINDOW_S[1] for t in decode_kills)
                            for r in requests)  # fmt: skip
        unsure = sum(w["unsure"] for w in whole) + door_unsure + decode_unsure
        for _ in range(int(CANCEL_LAG_S / 0.5)):  # a client that cancelled left at once: counted a moment later
            time.sleep(0.5)
            self.store(self.read_life())
            counted, by_triton = self.totals()
            identity = {"sent": sent, "counted": sum(counted.values()), "answered_by_triton": sum(by_triton.values()),
                        "by_triton": by_triton, "unreached": unreached, "lives": len(self.lives),
                        "unsure": unsure, "refused_around_a_door_kill": door_unsure,
                        "ended_around_a_decode_kill": decode_unsure}  # fmt: skip
            identity["difference"] = sent - identity["counted"] - identity["answered_by_triton"]
            if identity["difference"] == 0:
                break
        gauges, series = self.settled_gauges()
        restarts = self.server.restarts()
        kills_of = {p: sum(k["part"] == p for k in self.kills) for p in TARGETS}
        back = [k["back_s"] for k in self.kills]
        restarts_seen = self.whole_restarts()
        for k in self.kills:  # a part whose reload ended in a whole restart: served again by the new tritonserver
            until = k["t"] + (k["back_s"] or took)
            k["whole_restart"] = k["part"] != WHOLE and any(k["t"] < w["died"] <= until for w in restarts_seen)
        through = {p: sum(k["whole_restart"] and k["part"] == p for k in self.kills) for p in PARTS}
        report = {
            "minutes": round(took / 60, 2),
            "streams": len(self.streams),
            "probes": len(self.probes),
            "ends": ends,
            "kills": kills_of,
            "back_s": {p: [k["back_s"] for k in self.kills if k["part"] == p] for p in TARGETS},
            "reloads_ended_in_a_whole_restart": through,
            "restarts_total": restarts,
            "whole_restarts": whole,
            "lives": [self.life_summary(i) for i in range(len(self.lives))],
            "unclear_errors": unclear[:10],
            "ended_after_its_part_died_s": worst,  # the slowest per part
            "hung": hung + hung_whole + [{"clients_without_an_answer": hung_clients}] * bool(hung_clients),
            "gauges_after": gauges,
            **({"gauge_series_after": series} if any(gauges.values()) else {}),  # which instance holds what
            "counted": counted,
            "identity": identity,
        }
        report["checks"] = {
            "every stream ended": hung_clients == 0,
            "every error clear": not unclear,
            "none hung after its part's death": not hung,
            "none hung after a whole restart": not hung_whole,
            # a part killed just before tritonserver died may not have been seen dead: the whole restart healed it
            "every part came back every time": all(b is not None for b in back)
            and all(n - through.get(p, 0) <= restarts.get(p, 0) <= n for p, n in kills_of.items() if n and p in PARTS),
            "every whole restart followed and served again": restarts.get(WHOLE, 0) == len(whole)
            and all(w["served_again_s"] is not None for w in whole),
            "pool all free, nothing live or queued": not any(gauges.values()),
            # what a dead tritonserver counted after its last read, or a killed door in its last publish, is lost: at
            # most the `unsure` requests
            "the counters add up": 0 <= identity["difference"] <= unsure,
        }
        return report


OUTCOMES = ("completed", "cancelled", "failed", "rejected", "bad_input", "refused")
# the steps whose requests Triton answers itself when the stub they reached is dead (its `nv_inference_request_failure`
# with reason BACKEND: our stubs' own error responses count as successes there); vae_decode's are steps of streams
# that denoise answers and counts
TRITON_ANSWERS = ("cosmos3_admit", "cosmos3_prefill", "cosmos3_denoise")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _ends(requests: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in requests:
        key = "unreached" if r["end"].startswith(UNREACHED) else r["end"].split(":")[0]
        out[key] = out.get(key, 0) + 1
    return out


def counters_of(text: str) -> dict:
    """`cosmos3_requests_total` by outcome, and the requests Triton itself failed per model (a dead stub's), in a
    metrics text."""

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(pattern, text, re.M))

    return {
        "outcomes": {o: total(rf'^cosmos3_requests_total\{{[^}}]*outcome="{o}"[^}}]*\}} (\S+)$') for o in OUTCOMES},
        "by_triton": {m: total(rf'^nv_inference_request_failure\{{(?=[^}}]*model="{m}")(?=[^}}]*reason="BACKEND")'
                               rf'[^}}]*\}} (\S+)$') for m in TRITON_ANSWERS},
    }  # fmt: skip


def counters(server: Supervised) -> dict:
    """`counters_of` the server's metrics now."""
    return counters_of(server.metrics_text())


def leftovers(server: Supervised) -> dict:
    """After the server stopped: its processes and shared-memory regions still there (not this one's, nor those that
    started it: `timeout ... python -m bench.chaos --workdir DIR` names the workdir too)."""
    ours, pid = set(), os.getpid()
    while pid > 1 and pid not in ours:
        ours.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    procs = subprocess.run(["pgrep", "-f", str(server.workdir)], capture_output=True, text=True).stdout.split()
    procs = [p for p in procs if int(p) not in ours]
    shm = [p.name for p in Path("/dev/shm").glob(f"cosmos3_pb_{server.proc.pid}_*")]
    return {"processes": procs, "shm": shm}


def run(config: str, workdir: Path, minutes: float, concurrency: int = 8, kill_every: float = 20.0,
        cancel: float = 0.2, seed: int = 0, back_within: float = 120.0, checkpoint: str | None = None,
        targets: tuple[str, ...] = PARTS, max_kills: int | None = None, whole_pause_s: float = FREEZE_S) -> dict:  # fmt: skip
    """The soak → its report (`report["ok"]`: every check held)."""
    extra = ["--checkpoint", checkpoint] if checkpoint else []
    server = Supervised(config, workdir, extra_args=extra)
    try:
        started = server.wait_ready(1200)
        chaos = Chaos(server, concurrency, kill_every, cancel, seed, back_within, targets, max_kills, whole_pause_s)
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
    ap.add_argument("--targets", default=",".join(PARTS),
                    help=f"what may be killed, comma-separated, of {','.join(TARGETS)} ({WHOLE}: a whole restart)")  # fmt: skip
    ap.add_argument("--max-kills", type=int, default=None, help="stop killing after this many")
    ap.add_argument("--whole-pause", type=float, default=FREEZE_S,
                    help=f"{WHOLE}: pause its stubs this long before its kill (0: a plain SIGKILL, as a crash)")  # fmt: skip
    ap.add_argument("--workdir", default="build/chaos")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    targets = tuple(t for t in args.targets.split(",") if t)
    if not targets or set(targets) - set(TARGETS):
        ap.error(f"--targets: each of {', '.join(TARGETS)}")
    report = run(args.config, Path(args.workdir), args.minutes, args.concurrency, args.kill_every, args.cancel,
                 args.seed, args.back_within, args.checkpoint, targets, args.max_kills, args.whole_pause)  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
