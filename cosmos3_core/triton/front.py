"""The supervisor's HTTP front: `python -m cosmos3_core.triton.serve` owns the public HTTP and metrics ports and
tritonserver listens on private loopback ports behind them, so that readiness answers while tritonserver cannot
(a part reloading, the server restarting or draining) and the supervisor's own counters reach the metrics.

- `GET /v2/health/ready`: 503 with `{"error": <text>}` while anything is down (the text is errors.py's, the one a
  request would get), else 200: the supervisor knows (tritonserver was ready, and with explicit model control only
  the supervisor loads or unloads), so a probe never waits on tritonserver.
- `GET /v2/models/<m>/ready`: the same 503 while anything is down, else tritonserver's answer (not ready: 503).
- `GET /v2/health/live`: 200 while the supervisor runs (it heals what dies: a restart is no reason to kill it).
- `GET /metrics` (metrics port): tritonserver's metrics, then `cosmos3_restarts_total{part}` (prefill, denoise,
  vae_decode: one part reloaded; tritonserver: the whole server restarted).
- anything else: forwarded to tritonserver as it is, the response streamed back (SSE of generate_stream too).
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..errors import part_restarting
from .state import ServerState

_READY = re.compile(r"/v2/health/ready|/v2/models/[^/]+(?:/versions/[^/]+)?/ready")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection", "host"}


class Front:
    """Why the server is not ready and the restart counts, served on `http_port` and `metrics_port` at `address` in
    front of tritonserver's `backend_http` / `backend_metrics`. A part down is read from the server's `state` (the
    supervisor marks it there for the stubs too); the whole server's causes (starting, restarting) are set here
    (`set_down(key, text)` / `clear(key)`)."""

    def __init__(self, address: str, http_port: int, metrics_port: int, backend_http: int, backend_metrics: int,
                 state: ServerState | None = None, starting: str | None = None):  # fmt: skip
        """`starting`: not ready from the first answer, with this text (under the key "server"), until cleared."""
        self.state = state
        # insertion order: the first cause is the one readiness names
        self._down: dict[str, str] = {"server": starting} if starting else {}
        self.restarts: Counter[str] = Counter()
        self.draining: str | None = None  # set by a signal handler: a plain assignment, no lock
        self._lock = threading.Lock()
        self._servers = [
            _Server((address, http_port), _handler(self, backend_http, metrics=False)),
            _Server((address, metrics_port), _handler(self, backend_metrics, metrics=True)),
        ]
        for server in self._servers:
            threading.Thread(target=server.serve_forever, name="cosmos3-front", daemon=True).start()

    def set_down(self, key: str, text: str) -> None:
        with self._lock:
            self._down.setdefault(key, text)

    def clear(self, key: str) -> None:
        with self._lock:
            self._down.pop(key, None)

    def drain(self, text: str) -> None:
        """From a signal handler (which may interrupt this thread inside `_lock`): from now on not ready, for good."""
        self.draining = text

    def why_down(self) -> str | None:
        if self.draining is not None:
            return self.draining
        with self._lock:
            why = next(iter(self._down.values()), None)
        if why is None and self.state is not None:
            why = next((part_restarting(p) for p in self.state.down_parts()), None)
        return why

    def count_restart(self, part: str) -> None:
        with self._lock:
            self.restarts[part] += 1

    def metrics_text(self) -> str:
        with self._lock:
            counts = dict(self.restarts)
        lines = ["# HELP cosmos3_restarts_total Parts reloaded (and tritonserver restarted) after their process died",
                 "# TYPE cosmos3_restarts_total counter"]  # fmt: skip
        lines += [f'cosmos3_restarts_total{{part="{p}"}} {n}' for p, n in sorted(counts.items())]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _handler(front: Front, backend: int, metrics: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # noqa: ANN002 - quiet: probes poll often
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if metrics and path == "/metrics":
                return self._metrics()
            if path == "/v2/health/live":
                return self._reply(200, b"")
            if _READY.fullmatch(path):
                return self._ready()
            return self._forward()

        do_POST = do_PUT = do_DELETE = do_HEAD = do_GET

        def _ready(self) -> None:
            why = front.why_down()
            if why is None and self.path.startswith("/v2/health/"):
                return self._reply(200, b"")
            if why is None:
                try:
                    status, body = _fetch(backend, self.path, timeout=2)
                except OSError:
                    status, body = 503, b""
                if status == 200:
                    return self._reply(200, b"")
                why = (body.decode(errors="replace") or "tritonserver is not ready") if status != 503 else None
            self._reply(
                503, json.dumps({"error": why or "tritonserver cannot be reached"}).encode(), "application/json"
            )

        def _metrics(self) -> None:
            try:
                status, body = _fetch(backend, self.path, timeout=5)
            except OSError:
                status, body = 200, b""  # tritonserver restarting: the supervisor's counters still answer
            self._reply(status, body + front.metrics_text().encode(), "text/plain; charset=utf-8; version=0.0.4")

        def _reply(self, status: int, body: bytes, content_type: str | None = None) -> None:
            self.send_response(status)
            if content_type:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            conn = http.client.HTTPConnection("127.0.0.1", backend)
            try:
                conn.request(self.command, self.path, body, headers)
                resp = conn.getresponse()
            except OSError:
                conn.close()
                text = front.why_down() or "tritonserver cannot be reached"
                return self._reply(503, json.dumps({"error": text}).encode(), "application/json")
            try:
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                if resp.getheader("Content-Length") is None:  # streamed (SSE): the body ends when the socket does
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                while chunk := resp.read1(65536) if self.command != "HEAD" else b"":
                    self.wfile.write(chunk)
                    self.wfile.flush()
            finally:
                conn.close()

    return Handler


def _fetch(port: int, path: str, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()
