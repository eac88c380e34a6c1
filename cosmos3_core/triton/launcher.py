"""Launch a real ``tritonserver`` (Triton 2.51 from the ``nvidia-pytriton`` wheel, or the NGC
container's ``/opt/tritonserver``) for a Python-backend model repository.

Pure stdlib; only ``importlib`` of ``pytriton`` to locate the wheel's files.

Recipe (verified on CPU, Python 3.11.7 pyenv venv, numpy 1.26.4, torch 2.13, diffusers 0.42.1):

    proc = launch_server(ServerConfig(model_repository, grpc_port, http_port, metrics_port,
                                      log_path=Path(workdir) / "tritonserver.log"))
    wait_until_ready(http_port, proc=proc)
    ...
    stop_server(proc)

Traps this module handles:
* the Python stub must be the one for the *running* interpreter's major.minor and must live in
  ``<backend_dir>/python/`` next to ``libtriton_python.so`` and ``triton_python_backend_utils.py``;
* the stub only sees packages of the ``python3`` first on ``PATH`` (not ``PYTHONPATH``): the venv's
  ``bin`` goes first;
* ``LD_LIBRARY_PATH`` must start with this interpreter's ``LIBDIR`` (else the stub links the
  system's ``libpython3.X.so.1.0`` against another build's stdlib: ``_ssl`` import errors), then the
  wheel's ``nvidia_pytriton.libs``;
* numpy 2 in the stub's environment silently zeroes CPU outputs of this backend: ``preflight()``
  refuses it;
* each server gets its own shm region prefix (2.51 appends a UUID per region anyway) so that
  ``stop_server`` can unlink the regions a non-clean exit leaves in /dev/shm.

Behaviour measured with a decoupled Python step inside an ensemble (Triton 2.51, gRPC streaming):
* errors: send ``InferenceResponse(error=TritonError(msg))`` WITH ``flags=FINAL`` in one ``send``.
  The client gets ``InferenceServerException`` whose message is ``"in ensemble '<ens>', <msg>"``
  (text preserved, ``status()`` is None on streams). An error response sent without FINAL followed by
  a separate FINAL also reaches the client, but leaves the ensemble request in flight forever
  (graceful shutdown then waits the whole --exit-timeout-secs and exits 1).
* a client stream cancel (``stop_stream(cancel_requests=True)``) is NOT seen by ``is_cancelled()``
  of a composing model that is already executing; it is seen when the decoupled model is called
  directly. Cancellation inside an ensemble only stops further steps.
* if the step sends its last data with ``flags=FINAL`` the ensemble's last data response is the
  final one (no empty final even with enable_empty_final_response=True): read outputs of every
  response, including the final one.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from ..caches import use_kernel_caches
from ..parallel.config import NO_MULTICAST

OPT_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
OPT_BACKENDS = Path("/opt/tritonserver/backends")

# Python backend shared memory (one region per stub instance, in /dev/shm). Triton's defaults are
# 1 MiB + 1 MiB growth steps, which makes every video-sized tensor grow the region many times.
# Measured: the default size is COMMITTED at stub start (du /dev/shm = 64 MiB per instance), so the
# cost is instances x shm_default_bytes of RAM; in Docker raise --shm-size accordingly. A 29.5 MB
# uint8 video chunk streamed fine with 64 MiB + 64 MiB growth.
DEFAULT_SHM_BYTES = 64 * 1024 * 1024
DEFAULT_SHM_GROWTH_BYTES = 64 * 1024 * 1024
# A stub that loads torch + diffusers needs more than the default 30 s to come up on a slow disk.
DEFAULT_STUB_TIMEOUT_S = 120

ADMIN_HEADER = "cosmos3-admin"  # the header the model-repository API requires (`ServerConfig.admin_token`)
_PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB_NAME = "triton_python_backend_stub"


# --------------------------------------------------------------------------------------------------
# Locating the server
# --------------------------------------------------------------------------------------------------
def _pytriton_dir() -> Path | None:
    """Directory of the installed ``pytriton`` package, without importing it (it imports numpy…)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _wheel_dist_dir() -> Path:
    root = _pytriton_dir()
    if root is None:
        raise FileNotFoundError(
            "no /opt/tritonserver and the 'pytriton' package (pip install nvidia-pytriton) is not importable"
        )
    return root / "tritonserver"


def _wheel_libs_dir() -> Path:
    root = _pytriton_dir()
    assert root is not None
    libs = root.parent / "nvidia_pytriton.libs"  # wheel install
    if not libs.is_dir():
        libs = root / "tritonserver" / "external_libs"  # editable install of pytriton
    return libs


def find_tritonserver() -> Path:
    """``$TRITONSERVER_BIN`` if set, else ``/opt/tritonserver/bin/tritonserver`` if present, else the
    binary bundled in the ``nvidia-pytriton`` wheel."""
    override = os.environ.get("TRITONSERVER_BIN")
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"TRITONSERVER_BIN={override} does not exist")
        return path
    if OPT_TRITONSERVER.is_file():
        return OPT_TRITONSERVER
    path = _wheel_dist_dir() / "bin" / "tritonserver"
    if not path.is_file():
        raise FileNotFoundError(f"tritonserver not found at {path}")
    return path


def is_wheel_server(tritonserver: Path | None = None) -> bool:
    tritonserver = tritonserver or find_tritonserver()
    return Path(tritonserver).resolve() != OPT_TRITONSERVER.resolve()


def stub_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def prepare_backend_dir(dest: Path, *, tritonserver: Path | None = None, symlink: bool = False) -> Path:
    """Return a ``--backend-directory`` for ``tritonserver``.

    For ``/opt/tritonserver`` that is ``/opt/tritonserver/backends`` (its stub is built for the
    container's own Python). For the wheel, build ``dest/python/`` holding ``libtriton_python.so``,
    ``triton_python_backend_utils.py`` and the stub for this interpreter's major.minor. Files are
    copied (~2.8 MB; survives the venv moving) unless ``symlink=True``. Idempotent.
    """
    tritonserver = tritonserver or find_tritonserver()
    if not is_wheel_server(tritonserver):
        return OPT_BACKENDS
    dist = _wheel_dist_dir()
    src_backend = dist / "backends" / "python"
    src_stub = dist / "python_backend_stubs" / stub_version() / _STUB_NAME
    if not src_stub.is_file():
        available = sorted(p.name for p in (dist / "python_backend_stubs").iterdir())
        raise FileNotFoundError(f"no Python backend stub for Python {stub_version()} (wheel has {available})")
    dest = Path(dest).absolute()
    py_dir = dest / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    pairs = [(src_backend / name, py_dir / name) for name in _PYTHON_BACKEND_FILES]
    pairs.append((src_stub, py_dir / _STUB_NAME))
    for src, dst in pairs:
        if symlink:
            if dst.is_symlink() and dst.resolve() == src.resolve():
                continue
            if dst.exists() or dst.is_symlink():
                dst.unlink()
            dst.symlink_to(src)
        else:
            if dst.is_symlink():
                dst.unlink()
            if (
                dst.is_file()
                and dst.stat().st_size == src.stat().st_size
                and dst.stat().st_mtime >= src.stat().st_mtime
            ):
                continue
            shutil.copy2(src, dst)
    os.chmod(py_dir / _STUB_NAME, 0o755)
    return dest


def cache_dir(tritonserver: Path | None = None) -> Path | None:
    """The wheel's ``caches`` dir (response-cache plugins); ``None`` for /opt (its default works)."""
    tritonserver = tritonserver or find_tritonserver()
    if not is_wheel_server(tritonserver):
        return None
    path = _wheel_dist_dir() / "caches"
    return path if path.is_dir() else None


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------
def _python_libdir() -> str:
    return sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib")


def _prepend(value: str, existing: str | None) -> str:
    parts = [value] + [p for p in (existing or "").split(os.pathsep) if p and p != value]
    return os.pathsep.join(parts)


def server_env(base: Mapping[str, str] | None = None, *, tritonserver: Path | None = None) -> dict[str, str]:
    """Environment for ``tritonserver`` and the Python stubs it spawns.

    * ``PATH``: ``dirname(sys.executable)`` first (the venv's ``bin``; the stub takes its packages
      from the ``python3`` it finds there, ``PYTHONPATH`` is ignored by it);
    * ``LD_LIBRARY_PATH``: this interpreter's ``LIBDIR`` first, then (wheel case) the wheel's
      ``nvidia_pytriton.libs``, then whatever was there;
    * the kernel caches (``caches.use_kernel_caches``: those not named already, under ``$COSMOS3_CACHE``), so that
      the stubs of every server launched with it (all of ours: ``launch_server`` builds it when given none) load
      what ``make warm`` or an earlier server compiled (when only
      ``serve`` set them, the benchmarks' servers compiled into torch's default folder, and ``make warm`` seemed
      to save nothing).
    """
    env = dict(os.environ if base is None else base)
    tritonserver = tritonserver or find_tritonserver()
    env["PATH"] = _prepend(str(Path(sys.executable).parent), env.get("PATH") or os.defpath)
    ld = env.get("LD_LIBRARY_PATH")
    if is_wheel_server(tritonserver):
        ld = _prepend(str(_wheel_libs_dir()), ld)
    ld = _prepend(_python_libdir(), ld)
    env["LD_LIBRARY_PATH"] = ld
    env.pop("PYTHONPATH", None)  # not seen by the stub anyway; keep the server env unambiguous
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(NO_MULTICAST)  # the denoise/decode instances may start a group of GPU workers (parallel/group.py)
    use_kernel_caches(env)
    return env


def preflight(env: Mapping[str, str] | None = None) -> list[str]:
    """Check the stub's environment before starting (cheap; runs ``python3`` from ``env['PATH']``).

    Raises ``RuntimeError`` on fatal problems, returns a list of warnings otherwise.
    """
    env = dict(env or server_env())
    warnings: list[str] = []
    libdir = Path(_python_libdir())
    soname = sysconfig.get_config_var("INSTSONAME") or f"libpython{stub_version()}.so.1.0"
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not (libdir / soname).exists():
        warnings.append(
            f"{sys.executable} has no shared {soname} in {libdir}: the stub will link the system's libpython "
            "(rebuild Python with --enable-shared, e.g. PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install)"
        )
    python3 = shutil.which("python3", path=env["PATH"])
    if python3 is None:
        raise RuntimeError("no python3 on the server PATH: the Python stub will not find any packages")
    probe = (
        "import json,sys;import numpy;print(json.dumps({'v':'%d.%d'%sys.version_info[:2],'numpy':numpy.__version__}))"
    )
    out = subprocess.run([python3, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"{python3} cannot import numpy: {out.stderr.strip()[-500:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    if info["v"] != stub_version():
        raise RuntimeError(f"python3 on PATH is {info['v']} but the stub is built for {stub_version()}")
    if int(info["numpy"].split(".")[0]) >= 2:
        raise RuntimeError(
            f"numpy {info['numpy']} in the stub's environment: Triton 2.51's Python backend zeroes CPU outputs "
            "with numpy 2; install numpy<2 there"
        )
    return warnings


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerConfig:
    """One tritonserver launch: its repository, where it listens, where it logs."""

    model_repository: Path
    grpc_port: int
    http_port: int
    metrics_port: int
    address: str = "127.0.0.1"
    cpu_only: bool = False  # no pinned pool, no GPU metrics: silences a CPU host's warnings
    # Triton's CUDA memory pool on GPU 0 (0: its default, 64 MiB). A Python model's GPU tensor that does not fit
    # crosses through host shared memory instead (`serve.cuda_pool_bytes` sizes it for a deployment)
    cuda_pool_bytes: int = 0
    log_path: Path | None = None  # stdout + stderr; None: inherited
    extra: tuple[str, ...] = ()  # more tritonserver flags, appended last (later flags win)
    exit_timeout_s: int = 30
    # where HTTP and metrics bind when not at `address`: serve's front owns the public ports (loopback behind it)
    private_address: str | None = None
    # the model-repository API (load, unload) answers only requests with the header `ADMIN_HEADER: <this>`: with
    # explicit model control it would otherwise let any client unload the models
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))


def server_command(cfg: ServerConfig, tritonserver: Path, backend_dir: Path) -> list[str]:
    """Argument vector for ``tritonserver``. With ``cpu_only`` its GPU build still logs two CUDA probes as errors,
    which no flag skips (``CUDA_PROBE_ERRORS``; ``launch_server`` drops them from a terminal's log)."""
    # The backend names its regions <prefix><n>; two servers with the same prefix on one host collide.
    shm_region_prefix = f"cosmos3_pb_{os.getpid()}_{cfg.grpc_port}_"
    a, private = cfg.address, cfg.private_address or cfg.address
    cmd = [
        str(tritonserver),
        f"--model-repository={Path(cfg.model_repository).absolute()}",
        f"--backend-directory={Path(backend_dir).absolute()}",
        f"--backend-config=python,shm-default-byte-size={DEFAULT_SHM_BYTES}",
        f"--backend-config=python,shm-growth-byte-size={DEFAULT_SHM_GROWTH_BYTES}",
        f"--backend-config=python,shm-region-prefix-name={shm_region_prefix}",
        f"--backend-config=python,stub-timeout-seconds={DEFAULT_STUB_TIMEOUT_S}",
        *("--allow-grpc=true", f"--grpc-address={a}", f"--grpc-port={int(cfg.grpc_port)}"),
        *("--allow-http=true", f"--http-address={private}", f"--http-port={int(cfg.http_port)}"),
        *("--allow-metrics=true", f"--metrics-address={private}", f"--metrics-port={int(cfg.metrics_port)}"),
        f"--exit-timeout-secs={int(cfg.exit_timeout_s)}",
        "--strict-readiness=true",
        "--exit-on-error=true",
        # explicit: the supervisor reloads one part whose stub died (`load_model`) instead of restarting the server
        "--model-control-mode=explicit",
        "--load-model=*",
        f"--http-restricted-api=model-repository:{ADMIN_HEADER}={cfg.admin_token}",
        f"--grpc-restricted-protocol=model-repository:{ADMIN_HEADER}={cfg.admin_token}",
        "--metrics-config=histogram_latencies=true",
        # every config.pbtxt is complete: without this, each Python model's every load (a reload too) first starts
        # a stub of its own only to ask model.py for a config it does not complete
        "--disable-auto-complete-config",
    ]
    if cfg.cpu_only:
        cmd += ["--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false"]
    elif cfg.cuda_pool_bytes:
        cmd.append(f"--cuda-memory-pool-byte-size=0:{int(cfg.cuda_pool_bytes)}")
    cache = cache_dir(tritonserver)
    if cache is not None:
        cmd.append(f"--cache-directory={cache}")
    return cmd + [str(x) for x in cfg.extra]


# --------------------------------------------------------------------------------------------------
# Process control
# --------------------------------------------------------------------------------------------------
def free_ports(count: int, host: str = "127.0.0.1", exclude: Iterable[int] = ()) -> list[int]:
    """`count` distinct ports free right now (racy by nature: fine for tests and single launches), none of `exclude`
    (ports chosen but not yet listened on). Each is held until all are chosen: a port just released can be handed
    out again (two picks one after the other once gave tritonserver the same port for HTTP and metrics)."""
    held: list[socket.socket] = []
    taken = frozenset(exclude)
    try:
        ports: list[int] = []
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            if (port := s.getsockname()[1]) not in taken:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def ports_in_use(ports: Mapping[str, int], address: str = "127.0.0.1") -> list[str]:
    """``"<name> port <n> (<why>)"`` for each port that cannot be listened on at ``address`` now: held by
    anything (another server, a stale tritonserver) or named twice. Checked before tritonserver starts, which
    would only fail to bind after loading every model."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    held: list[socket.socket] = []
    busy: list[str] = []
    try:
        for name, port in ports.items():
            s = socket.socket(family, socket.SOCK_STREAM)
            held.append(s)
            # a just-stopped server's connections in TIME_WAIT do not stop tritonserver (it sets SO_REUSEADDR)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
                s.listen()  # listening, so that the same port named twice fails its second bind
            except OSError as e:
                why = "already in use" if e.errno == errno.EADDRINUSE else e.strerror
                busy.append(f"{name} port {port} ({why})")
    finally:
        for s in held:
            s.close()
    return busy


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when its parent dies, even by SIGKILL: a server
    outliving its supervisor would keep the ports and, on a GPU, its memory. SIGKILL rather than a graceful
    signal, since with in-flight requests Triton's shutdown waits ``--exit-timeout-secs`` (``_reaper`` ends
    the stubs and unlinks the shm regions)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os._exit(1)

    return preexec


# Run by a process of its own: it outlives the server's launcher by design.
_REAPER = """import os, signal, sys
from pathlib import Path
sys.stdin.buffer.read()
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except ProcessLookupError:
    pass
for prefix in sys.argv[2:]:
    for region in Path("/dev/shm").glob(prefix + "*"):
        region.unlink(missing_ok=True)
"""


def _reaper(pgid: int, shm_prefix: str | None) -> subprocess.Popen:
    """A process that SIGKILLs the server's process group and unlinks its shm regions once its stdin closes:
    when ``stop_server`` is done, or when the launching process dies, however it dies. The stubs of a killed
    tritonserver can hang forever (2.51's stub deadlocks on parent death while a custom-metrics message is
    pending) and they hold the model, on a GPU its memory: the parent-death signal reaches tritonserver only."""
    prefixes = [shm_prefix] if shm_prefix and "/" not in shm_prefix else []
    return subprocess.Popen([sys.executable, "-I", "-c", _REAPER, str(pgid), *prefixes], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


# What the tritonserver build we run (a GPU build) logs as errors on a host without a CUDA driver, whatever the
# deployment's device, and no flag avoids: its CUDA block manager at start (server.cc: "CudaDriverHelper has not been
# initialized.", the driver's allocation granularity asked for unconditionally) and each ensemble's scheduler
# (ensemble_scheduler.cc: "unable to create stream for cosmos3: CUDA driver version is insufficient for CUDA runtime
# version", a cudaStreamCreate in its constructor). Nothing uses either on a CPU deployment.
CUDA_PROBE_ERRORS = re.compile(
    r'"CudaDriverHelper has not been initialized\."|"unable to create stream for [^:"]*: '
    r"(CUDA driver version is insufficient|no CUDA-capable device)"
)


def relay_log(pipe: IO[bytes], out: TextIO, drop: re.Pattern[str]) -> None:
    """Copy tritonserver's log, line by line, from `pipe` (bytes) to `out` (text) until the pipe closes, less the
    lines `drop` matches."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            if not drop.search(line):
                out.write(line)
                out.flush()


def launch_server(cfg: ServerConfig, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``tritonserver`` in its own process group (so the stubs die with it). Does not wait for readiness:
    call ``wait_until_ready``.

    The server is SIGKILLed by the kernel when the *thread* that called this ends (Linux ``PR_SET_PDEATHSIG``
    follows the forking thread, not the process): call it from a thread that outlives the server, e.g. the
    main thread, as ``python -m cosmos3_core.triton.serve`` does."""
    tritonserver = find_tritonserver()
    backend_dir = prepare_backend_dir(
        Path(cfg.model_repository).absolute().parent / ".triton_backends", tritonserver=tritonserver
    )
    env = dict(env or server_env(tritonserver=tritonserver))
    for w in preflight(env):
        print(f"[serve_launcher] warning: {w}", file=sys.stderr)
    cmd = server_command(cfg, tritonserver, backend_dir)
    log_path = cfg.log_path
    stdout = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        stdout = open(log_path, "ab", buffering=0)
    relay = cfg.cpu_only and stdout is None  # a CPU deployment's log on the terminal: less the CUDA probes
    try:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout else (subprocess.PIPE if relay else None),  # its log: on stderr
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
    finally:
        if stdout is not None:
            stdout.close()
    if relay:
        threading.Thread(target=relay_log, args=(proc.stderr, sys.stderr, CUDA_PROBE_ERRORS), daemon=True).start()
    proc.command = cmd  # type: ignore[attr-defined]
    proc.log_path = log_path  # type: ignore[attr-defined]
    prefix = next((a.split("shm-region-prefix-name=", 1)[1] for a in cmd if "shm-region-prefix-name=" in a), None)
    proc.shm_prefix = prefix  # type: ignore[attr-defined]
    proc.reaper = _reaper(proc.pid, prefix)  # type: ignore[attr-defined]
    return proc


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def wait_until_ready(
    http_port: int,
    *,
    host: str = "127.0.0.1",
    timeout_s: float = 300.0,
    proc: subprocess.Popen | None = None,
    models: Iterable[str] = (),
    poll_s: float = 0.25,
) -> float:
    """Poll ``/v2/health/ready`` (and ``/v2/models/<m>/ready`` for ``models``); return seconds waited.
    Raises ``RuntimeError`` if ``proc`` exits first (with the log tail), ``TimeoutError`` on timeout."""
    t0 = time.monotonic()
    base = f"http://{host}:{http_port}"
    urls = [f"{base}/v2/health/ready"] + [f"{base}/v2/models/{m}/ready" for m in models]
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with {proc.returncode} before ready{_log_tail(proc)}")
        if all(_http_ok(u) for u in urls):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f}s{_log_tail(proc)}")
        time.sleep(poll_s)


def load_model(
    http_port: int, model: str, admin_token: str, *, host: str = "127.0.0.1", timeout_s: float = 600.0
) -> float:
    """(Re)load `model` through Triton's repository API (explicit model control; `admin_token`: the server's
    `ServerConfig.admin_token`) → seconds it took. A reload starts new instances (new stubs) while the old ones keep
    serving, then swaps; requests in flight keep the old ones. Raises RuntimeError with Triton's reason when the
    load fails."""
    t0 = time.monotonic()
    url = f"http://{host}:{http_port}/v2/repository/models/{model}/load"
    request = urllib.request.Request(url, data=b"", method="POST", headers={ADMIN_HEADER: admin_token})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            pass
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"loading {model} failed: {e.read().decode(errors='replace')[:2000]}") from e
    except OSError as e:
        raise RuntimeError(f"loading {model} failed: {e}") from e
    return time.monotonic() - t0


def pid_alive(pid: int) -> bool:
    """The process runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _log_tail(proc: subprocess.Popen | None, n: int = 4000) -> str:
    path = getattr(proc, "log_path", None)
    if not path:
        return ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    # why models failed to load is logged once per model, far above the tail: lead with those lines
    why = [ln[:600] for ln in text.splitlines() if "Failed to initialize Python stub" in ln or "failed to load" in ln]
    return "\n--- model load errors ---\n" + "\n".join(dict.fromkeys(why)) + "\n--- log tail ---\n" + text[-n:]


def stop_server(proc: subprocess.Popen, timeout_s: float = 45.0, unloaded_grace_s: float = 2.0) -> int:
    """SIGINT (Triton's graceful shutdown: waits up to --exit-timeout-secs for in-flight requests, then unloads
    every model), then SIGKILL of the process group (server + stubs) if it hangs. Returns the exit code; 0 too when
    it was killed `unloaded_grace_s` after its last Python stub exited: every step of every request had ended and
    each model was unloaded, yet Triton 2.51 waits out its exit timeout for a request it refused itself. (A request
    whose input has the wrong shape or data type for the ensemble `cosmos3` is answered with the error at once, but
    its gRPC stream frontend keeps a reference to the ensemble, which then never counts as unloaded.)

    Triton removes the stubs' /dev/shm regions only on a clean exit; when the exit timeout expires
    (e.g. an ensemble request that never completed) or on SIGKILL they stay behind, 64 MiB each, so
    the regions named with this server's unique prefix are unlinked here."""
    unloaded = False
    if proc.poll() is None:
        had_stubs = bool(stub_pids(proc))  # none yet (still starting): only the timeout applies
        proc.send_signal(signal.SIGINT)
        deadline, stubs_gone = time.monotonic() + timeout_s, None
        while proc.poll() is None and time.monotonic() < deadline:
            if had_stubs and stubs_gone is None and not stub_pids(proc):
                stubs_gone = time.monotonic()
            if stubs_gone is not None and time.monotonic() - stubs_gone > unloaded_grace_s:
                unloaded = True
                break
            time.sleep(0.1)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    else:
        # stubs normally exit with the server; reap stragglers of this group only
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    prefix = getattr(proc, "shm_prefix", None)
    if prefix and "/" not in prefix:
        for region in Path("/dev/shm").glob(f"{prefix}*"):
            try:
                region.unlink()
            except OSError:
                pass
    reaper = getattr(proc, "reaper", None)
    if reaper is not None:
        reaper.stdin.close()
        reaper.wait(10)
    return 0 if unloaded else proc.returncode


def stub_pids(proc: subprocess.Popen) -> dict[int, str]:
    """The server's live Python stubs: pid → model instance name (found by the server's unique shm prefix)."""
    prefix = getattr(proc, "shm_prefix", None)
    out: dict[int, str] = {}
    if not prefix:
        return out
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(_STUB_NAME.encode() in a for a in argv) and any(prefix.encode() in a for a in argv):
            out[int(entry.name)] = next((a.decode() for a in argv if re.fullmatch(rb"\w+_\d+_\d+", a)), "stub")
    return out


def worker_pids(stubs: Iterable[int]) -> dict[int, int]:
    """The live parallel workers (parallel/group.py) that these stubs started: worker pid → its stub's pid."""
    parents, out = set(stubs), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if (
                state != "Z"
                and int(ppid) in parents
                and b"cosmos3_core.parallel.worker" in (entry / "cmdline").read_bytes()
            ):
                out[int(entry.name)] = int(ppid)
        except (OSError, ValueError):
            continue
    return out


__all__ = [
    "worker_pids",
    "stub_pids",
    "pid_alive",
    "load_model",
    "find_tritonserver",
    "is_wheel_server",
    "prepare_backend_dir",
    "cache_dir",
    "server_env",
    "preflight",
    "ServerConfig",
    "server_command",
    "free_ports",
    "ports_in_use",
    "launch_server",
    "wait_until_ready",
    "stop_server",
]
