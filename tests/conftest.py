"""Shared fixtures: tiny random checkpoints (written by our own tool), the diffusers oracle, a denoise stub's module
beside a stand-in for Triton's utils."""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from cosmos3_core.tools.make_tiny import make_tiny

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {v: make_tiny(root / v, variant=v, seed=7) for v in ("nano", "edge")}


@pytest.fixture(scope="session")
def nano_ckpt(tiny_ckpts) -> Path:
    return tiny_ckpts["nano"]


@pytest.fixture(scope="session")
def action_ckpt(tmp_path_factory) -> Path:
    """Nano with sound and an action head (action_dim 16, 32 domains; modality embeddings redrawn non-zero)."""
    return make_tiny(tmp_path_factory.mktemp("ckpt_action") / "nano", variant="nano", seed=7, sound=True, action=True)


@pytest.fixture(scope="session")
def test_image() -> np.ndarray:
    """A smooth RGB image of a size that needs resize + crop (40x56)."""
    yy, xx = np.mgrid[0:40, 0:56]
    img = np.stack([xx * 4, yy * 6, (xx + yy) * 2], axis=-1)
    return np.clip(img, 0, 255).astype(np.uint8)


def reference_pipeline(ckpt: Path):
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(ckpt, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_reference(pipe, prompt: str, params: dict, image=None, output_type: str = "latent", **extra):
    """The diffusers pipeline with the same request (shift goes into its scheduler config); `extra`: more of its
    arguments (a v2v clip, mixed precision, ...)."""
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, flow_shift=params["shift"])
    templates = params.get("add_templates", True)
    return pipe(
        prompt=prompt,
        negative_prompt=params.get("negative_prompt"),
        image=image,
        num_frames=params["num_frames"],
        height=params["height"],
        width=params["width"],
        fps=params.get("fps", 24.0),
        num_inference_steps=params["steps"],
        guidance_scale=params["guidance_scale"],
        generator=torch.Generator().manual_seed(params["seed"]),
        output_type=output_type,
        use_system_prompt=params.get("use_system_prompt"),
        add_resolution_template=templates,
        add_duration_template=templates,
        enable_safety_check=False,
        **extra,
    ).video


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def capture_plan(plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = 0):
    """An attention plan's call (already updated) captured in a CUDA graph over copies of q, k, v, after one eager
    call (module loads), then replayed once → (graph, [q, k, v] input buffers, output buffer)."""
    bufs = [x.clone() for x in (q, k, v)]
    plan(*bufs, layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan(*bufs, layer)
    graph.replay()
    torch.cuda.synchronize()
    return graph, bufs, out


SERVED_CONFIG = {
    "device": "cpu",
    "dtype": "float32",
    "pool_pages": 64,
    "page_size": 16,
    "max_queue": 8,
    "defaults": {
        "height": 32,
        "width": 64,
        "num_frames": 9,
        "fps": 16,
        "t2i": {"steps": 4, "guidance_scale": 4.0, "shift": 3.0},
        "t2v": {"steps": 4, "guidance_scale": 6.0, "shift": 10.0},
        "i2v": {"steps": 4, "guidance_scale": 5.0, "shift": 8.0},
    },
    "limits": {"max_windows": 8, "max_height": 256, "max_width": 256, "max_frames": 33, "max_steps": 60, "max_prompt_tokens": 600,
               "max_prompt_bytes": 2048, "max_image_pixels": 65536, "max_pixel_frames": 2_000_000},
}  # fmt: skip


@pytest.fixture(scope="session")
def served_deployment(nano_ckpt, tmp_path_factory):
    import yaml

    from cosmos3_core.deployment import Deployment

    path = tmp_path_factory.mktemp("deploy") / "served.yaml"
    # the guardrail stand-in (tests/safety_standin.py) acts only on its own prompt word and widths; opting out allowed
    standin = {"safety_checker": f"{Path(__file__).parent / 'safety_standin.py'}:make", "safety_checker_optional": True}
    path.write_text(yaml.safe_dump({**SERVED_CONFIG, "checkpoint": str(nano_ckpt), **standin}))
    return path, Deployment.load(path)


class Server:
    def __init__(self, grpc: int, http: int, metrics: int, proc=None):
        from cosmos3_core.triton.launcher import stub_pids

        self.url = f"127.0.0.1:{grpc}"
        self.http_port, self.metrics_port = http, metrics
        self.proc = proc
        self.stubs = set(stub_pids(proc)) if proc is not None else set()

    def alive(self) -> bool:
        """tritonserver and every Python stub it had when ready are still running."""
        from cosmos3_core.triton.launcher import stub_pids

        return self.proc is None or (self.proc.poll() is None and set(stub_pids(self.proc)) == self.stubs)

    def metrics(self, settle: bool = False) -> dict[str, float]:
        """cosmos3_* samples summed over instances, keyed by name (and outcome label). `settle`: first wait out
        the engine metrics' publishing interval (0.2 s)."""
        import re
        import time
        import urllib.request

        if settle:
            time.sleep(0.6)
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^(cosmos3_\w+)\{([^}]*)\} (\S+)$", line)
            if m:
                outcome = re.search(r'outcome="(\w+)"', m.group(2))
                key = m.group(1) + (f":{outcome.group(1)}" if outcome else "")
                out[key] = out.get(key, 0.0) + float(m.group(3))
        return out


def running_server(deployment, workdir: Path, faults: str = ""):
    """A real tritonserver on `deployment` (free loopback ports), ready → yields its `Server`, stopped after.
    `faults`: COSMOS3_FAULTS for its processes (cosmos3_core/faults.py). For module or session fixtures."""
    from cosmos3_core.triton.launcher import server_env, stop_server, wait_until_ready
    from cosmos3_core.triton.serve import start

    env = {**server_env(), **({"COSMOS3_FAULTS": faults} if faults else {})}
    proc, ports, _ = start(deployment, workdir, env)
    try:
        wait_until_ready(ports[1], proc=proc, timeout_s=300)
        yield Server(*ports, proc=proc)
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def server(served_deployment, tmp_path_factory):
    faults = "step_delay_s=0.02,fail_step_seed=666,fail_decode_seed=667"
    yield from running_server(served_deployment[1], tmp_path_factory.mktemp("serve"), faults)


@pytest.fixture(scope="session")
def offline(served_deployment):
    """The offline path (same code, same deployment) that served results must equal."""
    from cosmos3_core.generate import Generator

    return Generator(served_deployment[1])


class KeepSink:
    """An engine sink for tests: keeps the final latents, sound and actions; an error fails the test."""

    latents = sound = actions = None

    def progress(self, *a): ...
    def chunk(self, *a): ...
    def done(self, latents, info, sound=None, actions=None):
        self.latents, self.sound, self.actions = latents, sound, actions

    def error(self, message):
        raise AssertionError(message)

    def cancelled(self):
        return False


def host_syncs_per_tick(engine) -> list[int]:
    """Run the engine's remaining ticks under CUDA's sync detector → per tick, the host synchronisations it saw
    (after checking that the detector sees a known one). The GPU tests of "no step syncs the host" share it."""
    torch.cuda.synchronize()
    syncs = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.ones(1, device="cuda").item()
        assert any("synchroniz" in str(w.message) for w in caught), "the sync detector saw no .item()"
        while engine.has_work():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.tick()
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return syncs


class StubTensor:
    """`pb_utils.Tensor` as the stand-in keeps it: its name and value."""

    def __init__(self, name: str, value):
        self.name, self.value = name, value

    @staticmethod
    def from_dlpack(name: str, capsule) -> StubTensor:
        return StubTensor(name, torch.utils.dlpack.from_dlpack(capsule))


@pytest.fixture
def denoise_stub(monkeypatch):
    """`cosmos3_core.triton.denoise`, imported as a stub imports it, beside a stand-in for Triton's utils; the modules
    imported so are gone again after the test (the package's attributes too), so no other test meets the stand-in."""
    utils = types.ModuleType("triton_python_backend_utils")
    utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    utils.Logger = types.SimpleNamespace(log_info=print, log_warn=print, log_error=print)
    utils.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    utils.InferenceResponse = lambda output_tensors=None, error=None: types.SimpleNamespace(
        outputs={t.name: t.value for t in output_tensors or []}, error=error
    )
    utils.TritonError = str
    utils.Tensor = StubTensor
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", utils)
    before = set(sys.modules)
    yield importlib.import_module("cosmos3_core.triton.denoise")
    package = sys.modules["cosmos3_core.triton"]
    for name in set(sys.modules) - before:
        if name.startswith("cosmos3_core.triton."):
            del sys.modules[name]
            if hasattr(package, name.rsplit(".", 1)[1]):
                delattr(package, name.rsplit(".", 1)[1])
