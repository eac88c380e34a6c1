"""Fuzz the served `cosmos3` ensemble with mutated requests (hypothesis): parameters JSON of any structure, types,
NaN/inf, huge and negative numbers, unknown keys, images of any rank/dtype/size, window parameters, robot-action
parameters and raw actions of any rank/dtype/size, prompts of any bytes, missing and unexpected inputs.

Every request must end: a rejection within `--max-reject-s` whose text names its field, or (when the mutation
happens to be valid) a stream that completes or is cut short by our cancel. Every `--probe-every` cases a small
valid request must be served, and at the end tritonserver and its Python stubs must still be alive.

  python -m bench.fuzz --config configs/fuzz.yaml --n 1000      # starts its own server
  python -m bench.fuzz --url 127.0.0.1:8001 --n 200             # an already running one (same limits as --config)
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from cosmos3_core.requests import PARAMETER_KEYS, Limits

INPUTS = ("prompt", "image", "condition_video", "raw_actions", "parameters")
KNOWN_FIELDS = frozenset((*INPUTS, *PARAMETER_KEYS))
FAULT_SEEDS = (666, 667)  # the test server injects failures for these (cosmos3_core/faults.py)
PROBE = (b"a valid probe", {"steps": 1, "num_frames": 1, "height": 32, "width": 32, "seed": 1})
DTYPES = ("uint8", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "bool")


@dataclass
class Case:
    """One request as it goes on the wire: input name → (Triton datatype, numpy array); absent = missing."""

    inputs: dict[str, tuple[str, np.ndarray]]
    sent_keys: frozenset[str] = frozenset()  # parameter keys in the JSON (an unknown one is a valid field name)

    def describe(self) -> str:
        parts = []
        for name, (dtype, arr) in self.inputs.items():
            if dtype == "BYTES" and arr.size == 1:
                parts.append(f"{name}={bytes(arr.reshape(-1)[0])[:160]!r}")
            else:
                parts.append(f"{name}={dtype}{list(arr.shape)}")
        return " ".join(parts)


@dataclass
class Outcome:
    kind: str  # accepted | rejected | crash | hang | unnamed | slow
    latency_s: float
    message: str = ""


COUNTS = ("crashes", "hangs", "unnamed", "slow_rejections", "accepted", "cancelled", "rejected", "probes_failed")


@dataclass
class Report:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    reject_latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    server_alive: bool = True
    stuck_at_exit: bool = False  # tritonserver still had requests in flight when stopped (only a server we started)

    @property
    def p99_reject_s(self) -> float:
        return float(np.percentile(self.reject_latencies, 99)) if self.reject_latencies else 0.0

    @property
    def ok(self) -> bool:
        c = self.counts
        bad = ("crashes", "hangs", "unnamed", "slow_rejections", "probes_failed")
        return self.server_alive and not self.stuck_at_exit and not any(c[k] for k in bad)

    def summary(self) -> str:
        c = self.counts
        return (
            f"cases {c['accepted'] + c['rejected'] + c['crashes'] + c['hangs'] + c['unnamed'] + c['slow_rejections']}: "
            f"crashes {c['crashes']}, hangs {c['hangs']}, errors without a field name {c['unnamed']}, "
            f"slow rejections {c['slow_rejections']}, accepted {c['accepted']} (cancelled by us {c['cancelled']}), "
            f"rejected {c['rejected']}, "
            f"p99 rejection latency {self.p99_reject_s * 1000:.1f} ms, probes failed {c['probes_failed']}, "
            f"server alive {self.server_alive}, requests stuck in flight at exit {self.stuck_at_exit}"
        )


# --- strategies -------------------------------------------------------------------------------------------------


def text_tensor(value: bytes) -> tuple[str, np.ndarray]:
    return "BYTES", np.array([value], dtype=np.object_)


def _json_leaf() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
    )


JSON_ANY = st.recursive(
    _json_leaf(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def near_valid(key: str, limits: Limits) -> st.SearchStrategy[Any]:
    """Values close to the accepted ranges (on, just off and across their edges)."""
    frames = limits.max_frames
    ints = {
        "height": st.integers(-1, 5).map(lambda k: 16 * k) | st.integers(-20, limits.max_height + 40),
        "width": st.integers(-1, 5).map(lambda k: 16 * k) | st.integers(-20, limits.max_width + 40),
        "num_frames": st.integers(0, 5).map(lambda k: 1 + 4 * k)
        | st.integers(-4, 1 + (frames - 1) * limits.max_windows + 8),
        "steps": st.integers(-2, limits.max_steps + 2),
        "seed": st.integers(-2, 2**64).filter(lambda s: s not in FAULT_SEEDS),
        "window_frames": st.integers(0, 5).map(lambda k: 1 + 4 * k) | st.integers(-4, frames + 8),
        "overlap_frames": st.integers(-1, 5).map(lambda k: 4 * k) | st.integers(-4, frames + 8),
        "context_frames": st.integers(0, 5).map(lambda k: 1 + 4 * k) | st.integers(-4, frames * 2),
        "max_windows": st.integers(-1, limits.max_windows + 2),
    }
    if key in ints:
        return ints[key]
    if key in ("fps", "guidance_scale", "shift"):
        return st.floats(-5, limits.max_guidance + 150, allow_nan=False) | st.sampled_from([0, 1, 1.0, 0.01, 120])
    if key == "window_mode":
        return st.sampled_from(["none", "chained", "kv", "", "KV", "chained ", 1, None])
    if key in ("use_system_prompt", "add_templates", "enable_sound"):
        return st.booleans() | st.sampled_from([0, 1, "true", None])
    if key == "condition_frame_indexes":
        index = st.integers(-2, frames) | st.sampled_from([0.0, 1.5, "0", None, True, [0]])
        return st.lists(index, max_size=4) | st.sampled_from([0, "0,1", None, {}])
    if key == "condition_video_keep":
        return st.sampled_from(["first", "last", "middle", "", "FIRST", 1, None])
    if key == "action":
        fields = {
            "mode": st.sampled_from(["policy", "forward_dynamics", "inverse_dynamics", "", "Policy", 1, None]),
            "chunk_size": st.integers(-2, limits.max_chunk_size + 2) | st.sampled_from([1.5, "4", None]),
            "domain": st.sampled_from(["pusht", "av", "bridge_orig_lerobot", "hand_pose", "libero", "nope", 7, None]),
            "resolution_tier": st.sampled_from([256, 480, 704, 720, 255, "480", 480.0, None]),
            "view_point": st.sampled_from(["ego_view", "wrist_view", "top", None, 3]),
            "chunk": st.just(4),  # an unknown key
        }
        return st.dictionaries(st.sampled_from(list(fields)), st.just(None), max_size=6).flatmap(
            lambda d: st.fixed_dictionaries({k: fields[k] for k in d})
        ) | st.sampled_from([[], "policy", 1, None])
    return st.text(max_size=40) | st.sampled_from(["", "blurry", "\x00", "x" * (limits.max_prompt_bytes + 1)])


@st.composite
def parameters(draw: st.DrawFn, limits: Limits) -> tuple[bytes, frozenset[str]]:
    """The `parameters` JSON: a small valid base with some keys set to near-valid or arbitrary values, or JSON
    text that is not an object, not JSON, or numbers Python's json cannot hold."""
    base: dict[str, Any] = {"steps": 1, "height": 32, "width": 32, "num_frames": 5, "seed": 3}
    mode = draw(st.sampled_from(["dict", "dict", "dict", "dict", "raw", "splice"]))
    if mode == "raw":
        raw = draw(st.one_of(
            st.binary(max_size=64),
            st.text(max_size=64).map(str.encode),
            JSON_ANY.map(lambda v: json.dumps(v).encode()),
            st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
            st.integers(1, 200_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
            st.sampled_from([b"", b"null", b"{}", b"[]", b"\xef\xbb\xbf{}", b"{\"steps\": 1,}", b"\x00"]),
        ))  # fmt: skip
        try:  # an unknown key is a field the error may name
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            obj = None
        return raw, frozenset(obj) if isinstance(obj, dict) else frozenset()
    keys = draw(st.lists(st.sampled_from([*PARAMETER_KEYS, "heigth", "", "a: b", "x" * 300]), max_size=3, unique=True))
    params = dict(base) if draw(st.integers(0, 4)) else {}
    for key in keys:
        params[key] = draw(JSON_ANY if draw(st.integers(0, 4)) == 0 else near_valid(key, limits))
    if params.get("seed") in FAULT_SEEDS:
        params["seed"] = 1
    if mode == "dict":
        return json.dumps(params, allow_nan=True).encode(), frozenset(params)
    # splice a literal json.dumps cannot write into one key: out-of-range numbers, lone surrogates, deep nesting
    key = draw(st.sampled_from(PARAMETER_KEYS))
    literal = draw(st.sampled_from([
        "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" + "0" * 400, "-1" + "0" * 400, "1" + "0" * 5000,
        '"\\ud800"', '"\\udfff x"', "[" * 5000 + "]" * 5000, "1.5", "-0", "1E2", "\"\\u0000\"",
    ]))  # fmt: skip
    params.pop(key, None)
    body = json.dumps(params)[:-1] + (", " if params else "") + json.dumps(key) + ": " + literal + "}"
    return body.encode(), frozenset((*params, key))


def image_array(limits: Limits) -> st.SearchStrategy[np.ndarray]:
    side = int(limits.max_image_pixels**0.5)
    valid = st.tuples(st.integers(1, 64), st.integers(1, 64)).map(lambda hw: np.full((*hw, 3), 128, np.uint8))
    extreme = st.sampled_from([(1, limits.max_image_pixels), (limits.max_image_pixels, 1), (side, side),
                               (side + 1, side + 1), (0, 0), (0, 5), (5, 0)])  # fmt: skip
    odd_shape = st.lists(st.integers(0, 6), min_size=0, max_size=5).map(tuple)
    odd = st.tuples(st.sampled_from(DTYPES), odd_shape).map(lambda d: np.zeros(d[1], dtype=d[0]))
    return st.one_of(valid, extreme.map(lambda hw: np.zeros((*hw, 3), np.uint8)), odd)


def clip_array() -> st.SearchStrategy[np.ndarray]:
    valid = st.tuples(st.integers(1, 12), st.integers(1, 48), st.integers(1, 48)).map(
        lambda thw: np.full((*thw, 3), 100, np.uint8)
    )
    odd_shape = st.lists(st.integers(0, 5), min_size=0, max_size=5).map(tuple)
    odd = st.tuples(st.sampled_from(DTYPES), odd_shape).map(lambda d: np.zeros(d[1], dtype=d[0]))
    return st.one_of(valid, valid, odd)


def raw_actions_array() -> st.SearchStrategy[np.ndarray]:
    valid = st.tuples(st.integers(1, 12), st.sampled_from([2, 9, 10, 57])).map(lambda td: np.ones(td, np.float32))
    special = st.sampled_from([np.full((3, 9), np.nan, np.float32), np.zeros((0, 9), np.float32)])
    odd_shape = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
    odd = st.tuples(st.sampled_from(DTYPES), odd_shape).map(lambda d: np.zeros(d[1], dtype=d[0]))
    return st.one_of(valid, valid, special, odd)


@st.composite
def cases(draw: st.DrawFn, limits: Limits) -> Case:
    inputs: dict[str, tuple[str, np.ndarray]] = {}
    prompt = draw(st.one_of(
        st.just(b"a red fox runs through snow"),
        st.just(b"a red fox runs through snow"),
        st.just(b"a red fox runs through snow"),
        st.binary(max_size=80),
        st.text(max_size=80).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.sampled_from([b"", b" \n\t", b"\x00", b"\xff\xfe", b"\xed\xa0\x80", b"ok\x00ok",
                         b"x" * limits.max_prompt_bytes, b"x" * (limits.max_prompt_bytes + 1),
                         b"word " * (limits.max_prompt_tokens + 1), b"y" * 1_000_000]),
    ))  # fmt: skip
    how = draw(st.sampled_from(["ok"] * 8 + ["missing", "shape", "dtype"]))
    if how == "ok":
        inputs["prompt"] = text_tensor(prompt)
    elif how == "shape":
        inputs["prompt"] = ("BYTES", np.array([prompt] * draw(st.sampled_from([0, 2])), dtype=np.object_))
    elif how == "dtype":
        inputs["prompt"] = ("INT32", np.zeros(1, np.int32))
    raw, keys = draw(parameters(limits))
    how = draw(st.sampled_from(["ok"] * 8 + ["missing", "shape"]))
    if how == "ok":
        inputs["parameters"] = text_tensor(raw)
    elif how == "shape":
        inputs["parameters"] = ("BYTES", np.array([raw, raw], dtype=np.object_).reshape(1, 2))
    if draw(st.integers(0, 3)) == 0:
        image = draw(image_array(limits))
        inputs["image"] = (_triton_dtype(image.dtype), image)
    if draw(st.integers(0, 3)) == 0:  # v2v: a clip of any length, size, rank and dtype
        clip = draw(clip_array())
        inputs["condition_video"] = (_triton_dtype(clip.dtype), clip)
    if draw(st.integers(0, 5)) == 0:  # forward dynamics' actions, any rank / dtype / size
        raw = draw(raw_actions_array())
        inputs["raw_actions"] = (_triton_dtype(raw.dtype), raw)
    if draw(st.integers(0, 30)) == 0:
        inputs["images"] = ("UINT8", np.zeros((2, 2, 3), np.uint8))  # an input the model does not have
    return Case(inputs, keys)


def explicit_cases() -> list[Case]:
    """Run first, every time: each once crashed the server or came back without a field name."""
    prompt = text_tensor(b"a red fox")
    raw_params = [
        b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b'{"seed": 1' + b"0" * 5000 + b"}",
        b'{"height": Infinity}', b'{"steps": NaN}', b'{"num_frames": -1e400}', b'{"fps": 1' + b"0" * 400 + b"}",
        b'{"negative_prompt": "\\ud800"}', b'{"": 1}', b'{"a: b": 1}',
    ]  # fmt: skip
    out = [Case({"prompt": prompt, "parameters": text_tensor(raw)}) for raw in raw_params]
    for image in (np.zeros((8, 8), np.uint8), np.zeros((8, 8, 3), np.float32), np.zeros((0, 0, 3), np.uint8)):
        out.append(Case({"prompt": prompt, "image": (_triton_dtype(image.dtype), image)}))
    out += [Case({"parameters": text_tensor(b"{}")}), Case({"prompt": ("INT32", np.zeros(1, np.int32))})]
    return out + [Case({"prompt": text_tensor(b"\xff\xfe")}), Case({"prompt": text_tensor(b"")})]


def _triton_dtype(dtype: np.dtype) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(dtype)


# --- one request on the wire ------------------------------------------------------------------------------------


def send(url: str, case: Case, timeout_s: float, cancel_after_progress: int = 8) -> tuple[str, float, str, int]:
    """→ (how it ended: error | done | cancelled | hang, seconds to the first response, error text, responses).
    A stream still running after `cancel_after_progress` progress events is cancelled (keeps accepted cases cheap)."""
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name, (dtype, arr) in case.inputs.items():
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    t0 = time.perf_counter()
    first: float | None = None
    count = progress = 0
    try:
        client.async_stream_infer("cosmos3", inputs, enable_empty_final_response=True)
        while True:
            try:
                result, error = responses.get(timeout=timeout_s)
            except queue.Empty:
                return "hang", time.perf_counter() - t0, f"no response within {timeout_s:.0f}s", count
            first = first if first is not None else time.perf_counter() - t0
            count += 1
            if error is not None:
                return "error", first, str(error), count
            raw = result.as_numpy("event")
            event = json.loads(raw.reshape(-1)[0]) if raw is not None and raw.size else {}
            progress += event.get("type") == "progress"
            if result.get_response().parameters["triton_final_response"].bool_param:
                return "done", first, "", count
            if progress >= cancel_after_progress:
                client.stop_stream(cancel_requests=True)
                return "cancelled", first, "", count
    finally:
        client.stop_stream()
        client.close()


def named_field(message: str, sent_keys: frozenset[str]) -> str | None:
    """The field an error names: `<field>: ...` (our validation) or `input 'x'` / `input(s) ['x']` (Triton's)."""
    text = message.split("in ensemble 'cosmos3', ", 1)[-1]
    text = re.sub(r"^\[request id: [^\]]*\] ", "", text)
    fields = KNOWN_FIELDS | sent_keys | {"images"}
    m = re.match(r"(\w+)(?:\.\w+)?: ", text)  # `action.mode: ...` names the `action` parameter
    if m and m.group(1) in fields:
        return m.group(1)
    for name in re.findall(r"input(?:\(s\))?:? \[?'(\w+)'", text):
        if name in fields:
            return name
    return None


def classify(case: Case, result: tuple[str, float, str, int], max_reject_s: float) -> Outcome:
    how, latency, message, count = result
    if how == "hang":
        return Outcome("hang", latency, message)
    if how in ("done", "cancelled"):
        return Outcome("accepted", latency, how)
    # an unhandled exception in a stub, a broken stream or a stub that died
    if re.search(r"internal error|not healthy|Socket closed|failed to connect|StatusCode.UNAVAILABLE", message):
        return Outcome("crash", latency, message)
    if count > 1:  # an error after the request was accepted (frames or progress came first)
        return Outcome("crash", latency, message)
    if named_field(message, case.sent_keys) is None:
        return Outcome("unnamed", latency, message)
    if latency > max_reject_s:
        return Outcome("slow", latency, message)
    return Outcome("rejected", latency, message)


def probe(url: str, timeout_s: float) -> str | None:
    """A small valid request → None if served, else why not."""
    case = Case({"prompt": text_tensor(PROBE[0]), "parameters": text_tensor(json.dumps(PROBE[1]).encode())})
    try:
        how, _, message, _ = send(url, case, timeout_s, cancel_after_progress=10**9)
    except Exception as e:  # noqa: BLE001
        how, message = "error", f"{type(e).__name__}: {e}"
    return None if how == "done" else f"probe: {how} {message}"


def run(
    url: str,
    n: int,
    limits: Limits,
    *,
    seed: int = 0,
    probe_every: int = 1,
    max_reject_s: float = 1.0,
    timeout_s: float = 60.0,
    alive: Callable[[], bool] = lambda: True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> Report:
    report = Report()
    seen = [0]
    names = {"crash": "crashes", "hang": "hangs", "unnamed": "unnamed", "slow": "slow_rejections"}

    @hypothesis_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(cases(limits))
    def one(case: Case) -> None:
        try:
            result = send(url, case, timeout_s)
        except Exception as e:  # noqa: BLE001 - the server went away mid-request: count it, keep the summary
            result = ("error", 0.0, f"internal error: client: {type(e).__name__}: {e}", 0)
        outcome = classify(case, result, max_reject_s)
        seen[0] += 1
        if outcome.kind in ("accepted", "rejected"):
            report.counts[outcome.kind] += 1
            report.counts["cancelled"] += outcome.message == "cancelled"
        else:
            report.counts[names[outcome.kind]] += 1
            report.failures.append(
                f"{outcome.kind} ({outcome.latency_s:.2f}s): {outcome.message[:300]}\n    {case.describe()}"
            )
            log(report.failures[-1])
        if outcome.kind == "rejected":
            report.reject_latencies.append(outcome.latency_s)
        if seen[0] % probe_every == 0 and (why := probe(url, timeout_s)) is not None:
            report.counts["probes_failed"] += 1
            report.failures.append(f"after {case.describe()}: {why}")
            log(report.failures[-1])
        if seen[0] % 100 == 0:
            log(f"{seen[0]} cases: {report.counts}")

    for case in explicit_cases():
        one = example(case)(one)
    one()
    if (why := probe(url, timeout_s)) is not None:
        report.counts["probes_failed"] += 1
        report.failures.append(f"final {why}")
    report.server_alive = alive()
    return report


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/fuzz.yaml", help="deployment to start (and whose limits to fuzz)")
    ap.add_argument("--url", default="", help="fuzz a running server instead of starting one")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--probe-every", type=int, default=1)
    ap.add_argument("--max-reject-s", type=float, default=1.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from cosmos3_core.deployment import Deployment
    from cosmos3_core.triton.launcher import server_env, stop_server, stub_pids, wait_until_ready
    from cosmos3_core.triton.serve import start

    deployment = Deployment.load(args.config)
    proc = None
    if args.url:
        url, alive = args.url, lambda: probe(args.url, 60) is None
    else:
        proc, ports, deployment = start(deployment, Path(tempfile.mkdtemp(prefix="cosmos3-fuzz-")), server_env())
        url = f"127.0.0.1:{ports[0]}"
    try:
        if proc is not None:
            wait_until_ready(ports[1], proc=proc, timeout_s=600)
            stubs = set(stub_pids(proc))
            alive = lambda: proc.poll() is None and set(stub_pids(proc)) == stubs  # noqa: E731
        t0 = time.perf_counter()
        report = run(url, args.n, deployment.limits, seed=args.seed, probe_every=args.probe_every,
                     max_reject_s=args.max_reject_s, alive=alive)  # fmt: skip
        wall = time.perf_counter() - t0
    finally:
        if proc is not None:
            stop_server(proc)
    if proc is not None:  # Triton logs this when a request never completed (graceful shutdown timed out)
        report.stuck_at_exit = "Exit timeout expired" in Path(proc.log_path).read_text(errors="replace")
    print(f"{report.summary()}; {wall:.0f}s")
    for line in report.failures[:20]:
        print("  " + line)
    if args.json:
        Path(args.json).write_text(json.dumps({"counts": report.counts, "p99_reject_s": report.p99_reject_s,
                                               "server_alive": report.server_alive, "failures": report.failures}))  # fmt: skip
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
