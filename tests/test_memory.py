"""The GPU memory plan (cosmos3_core/memory.py) on the CPU: the tool on every shipped config, the plan's exact
entries against what the real loaders and engine hold, a deployment that cannot fit refused at load naming what
to change, the step's row bound, the decoder's row bands against diffusers' own tiled decode, and the GEN
residual in row chunks against the whole. The activation coefficients are checked on the GPU (`bench.memory`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cosmos3_core import memory
from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.model import towers
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.layers import GEN, UND
from cosmos3_core.model.wan_decoder import WanDecoder
from cosmos3_core.requests import RequestError
from cosmos3_core.stages import PrefillStage
from cosmos3_core.tools import plan as plan_tool
from tests.test_engine import Recorder, prefilled

SHIPPED = ["configs/edge.yaml", "configs/nano.yaml", "configs/nano_ar.yaml"]


@pytest.mark.parametrize("config", SHIPPED)
@pytest.mark.parametrize("precision", ["checkpoint", "fp8"])
def test_every_shipped_config_fits_an_80_gb_card(config, precision, capsys):
    assert plan_tool.main(["--config", config, "--set", f"precision={precision}", "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "denoise     weights" in out and "vae_decode  workspace" in out


@pytest.mark.parametrize(
    "command",
    [
        "make plan CONFIG=configs/nano.yaml GPU_MEMORY=80",
        "make plan CONFIG=configs/nano.yaml GPU_MEMORY=80 SET=precision=fp8",
    ],
)
def test_make_plan_as_documented(command):
    import shlex
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(shlex.split(command) + ["-s"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fits 72.0 GiB" in out.stdout and ("fp8 linears" in out.stdout) == ("fp8" in command)


def test_a_plan_over_the_card_exits_1_saying_what_to_change(capsys):
    assert plan_tool.main(["--config", "configs/nano.yaml", "--gpu-memory", "40"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "precision: fp8 saves" in out and "pool_pages:" in out
    assert "max_step_rows" in out


def _tiny(nano_ckpt, **kw) -> Deployment:
    return Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", **{"pool_pages": 64, **kw})


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


@pytest.mark.parametrize("precision", ["checkpoint", "fp8"])
def test_the_plan_counts_what_the_loaders_and_engine_hold(nano_ckpt, precision):
    d = _tiny(nano_ckpt, precision=precision)
    ckpt = d.open_checkpoint()
    p = memory.plan(d, ckpt.root, ckpt.config, 0)
    entry = {(e.part, e.kind): e.bytes for e in p.entries}
    engine = DenoiseEngine.from_deployment(ckpt, d)
    held = _bytes([*engine.model.parameters(), *engine.model.buffers()])
    assert entry["denoise", "weights"] == held
    assert entry["denoise", "kv_pool"] == engine.pool.k_pages.nbytes + engine.pool.v_pages.nbytes
    und = ckpt.load_transformer({UND}, "cpu", torch.float32)
    encoder = ckpt.load_vae("cpu", torch.float32, ("encoder",))
    assert entry["prefill", "weights"] == _bytes([*und.parameters(), *und.buffers()]) + _bytes(encoder.parameters())
    decoder = ckpt.load_vae("cpu", torch.float32, ("decoder",))
    assert entry["vae_decode", "weights"] == _bytes(decoder.parameters())
    assert _bytes(encoder.decoder.parameters()) == 0 and _bytes(decoder.encoder.parameters()) == 0  # halves


def test_the_vae_counts_are_kept_per_config_and_recounted_when_unreadable(nano_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path))
    config = (Path(nano_ckpt) / "vae" / "config.json").read_text()
    key = json.dumps(json.loads(config), sort_keys=True)
    memory._vae_params.cache_clear()
    counted = memory._vae_params(key)
    (memo,) = (tmp_path / "memo").glob("vae-params-*.json")
    assert json.loads(memo.read_text()) == list(counted)
    memo.write_text(json.dumps([1, 2]))  # a later process reads it, importing no VAE class
    memory._vae_params.cache_clear()
    assert memory._vae_params(key) == (1, 2)
    memo.write_text("{")  # half a file (or another version's): counted again
    memory._vae_params.cache_clear()
    assert memory._vae_params(key) == counted
    memory._vae_params.cache_clear()


def test_a_deployment_that_cannot_fit_is_refused_at_load_naming_the_keys(nano_ckpt, monkeypatch):
    monkeypatch.setattr(memory, "card_bytes", lambda device="cuda": 2 * memory.GIB)
    d = _tiny(nano_ckpt)
    ckpt = d.open_checkpoint()
    with pytest.raises(memory.PlanError, match="does not fit") as denoise:
        DenoiseEngine.from_deployment(ckpt, d)
    assert "pool_pages" in str(denoise.value) and "precision: fp8" in str(denoise.value)
    with pytest.raises(memory.PlanError, match="gpu_memory_utilization"):
        PrefillStage.from_deployment(ckpt, d, "cpu")
    monkeypatch.setattr(memory, "card_bytes", lambda device="cuda": 80 * memory.GIB)
    assert DenoiseEngine.from_deployment(ckpt, d).pool.num_pages == 64  # fits: served as configured


def test_auto_pool_takes_what_the_card_leaves_up_to_its_cap(nano_ckpt):
    d = _tiny(nano_ckpt, pool_pages="auto")
    ckpt = d.open_checkpoint()
    roomy = memory.plan(d, ckpt.root, ckpt.config, 80 * memory.GIB)
    assert roomy.pool_pages == memory.max_pool_pages(ckpt.config, d)
    page = memory.page_bytes(ckpt.config, d.page_size, torch.float32)
    others = roomy.total - roomy.pool_pages * page
    tight = memory.plan(d, ckpt.root, ckpt.config, int((others + 200 * page) / d.gpu_memory_utilization) + 1)
    assert 199 <= tight.pool_pages <= 200 and tight.fits


def test_a_step_holds_at_most_max_step_rows(nano_ckpt):
    ckpt = Checkpoint.open(nano_ckpt)
    from cosmos3_core.requests import Defaults, Limits

    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=32, num_frames=5), Limits())
    one = prefilled(prefill, 0, steps=2)
    probe = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=64, page_size=16, max_queue=4)
    rows = probe.scheduler.rows(one.params, probe.scheduler.plan(one.params))
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=64, page_size=16, max_queue=4, max_step_rows=rows)
    sinks = [Recorder(), Recorder()]
    for s in sinks:
        engine.submit(prefilled(prefill, 1, steps=2), s)
    engine.tick()
    assert engine.num_live == 1 and engine.num_waiting == 1  # the second waits for room in the step
    engine.run_until_idle()
    assert all(s.latents is not None and not s.errors for s in sinks)
    small = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=64, page_size=16, max_queue=4, max_step_rows=rows - 1)
    with pytest.raises(RequestError, match="max_step_rows"):
        small.submit(prefilled(prefill, 2, steps=2), Recorder())


def test_the_gen_residual_in_row_chunks_equals_it_whole(nano_ckpt, monkeypatch):
    """The real step, every layer's residual run 16 rows at a time (W8A16 rows keep their place) against once."""
    ckpt = Checkpoint.open(nano_ckpt)
    from cosmos3_core.requests import Defaults, Limits

    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=32, num_frames=5), Limits())

    def run() -> torch.Tensor:
        engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=64, page_size=16, max_queue=4)
        sinks = [Recorder(), Recorder()]
        for seed, s in enumerate(sinks):  # two requests packed: chunks cross their boundary
            engine.submit(prefilled(prefill, seed, steps=2), s)
        engine.run_until_idle()
        return torch.stack([s.latents for s in sinks])

    whole = run()
    monkeypatch.setattr(towers, "MLP_CHUNK_ROWS", 16)
    chunked = run()
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def vae(nano_ckpt):
    return Checkpoint.open(nano_ckpt).load_vae("cpu", torch.float32)


def test_banded_decode_is_nearer_the_whole_frame_than_diffusers_tiled_decode(vae):
    """24 latent rows in bands of 8 (+8 rows of halo each side), streamed in two chunks, against one whole-frame
    decode; diffusers' own tiled decode (tiles of 16 latent rows, 12 apart: its defaults' ratio) against its untiled
    one. Ours must be at least as near."""
    s = 16  # Wan2.2: 8x spatial × patch 2
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(1, vae.config.z_dim, 3, 24, 8, generator=g)
    whole = WanDecoder(vae).stream()(latents)
    banded_stream = WanDecoder(vae, band_rows=lambda h, w: 8).stream()
    banded = torch.cat([banded_stream(latents[:, :, :1]), banded_stream(latents[:, :, 1:])])
    assert banded.shape == whole.shape
    ours = (banded.float() - whole.float()).abs().mean().item()

    def diffusers_frames(tiled: bool) -> torch.Tensor:
        if tiled:
            vae.enable_tiling(tile_sample_min_height=16 * s, tile_sample_min_width=16 * s,
                              tile_sample_stride_height=12 * s, tile_sample_stride_width=12 * s)  # fmt: skip
        else:
            vae.disable_tiling()
        with torch.no_grad():
            video = vae.decode(latents).sample.clamp(-1, 1)
        vae.disable_tiling()
        return ((video[0].permute(1, 2, 3, 0) * 0.5 + 0.5) * 255).round()

    theirs = (diffusers_frames(True) - diffusers_frames(False)).abs().mean().item()
    assert ours <= theirs, (ours, theirs)
    assert np.isfinite(ours)


def test_one_latent_frame_a_call_decodes_bit_identical_to_four(vae):
    g = torch.Generator().manual_seed(5)
    latents = torch.randn(1, vae.config.z_dim, 9, 4, 6, generator=g)
    one = WanDecoder(vae, frames_per_call=1).stream()(latents)
    four = WanDecoder(vae, frames_per_call=4).stream()(latents)
    assert torch.equal(one, four)


def test_the_server_exports_each_parts_plan(server, served_deployment):
    """`cosmos3_gpu_memory_bytes{part, kind, of}`: the plan of every part, as `memory.plan` makes it (on the CPU: sizes,
    no card), and each stub's in-use and peak gauges (0 off CUDA)."""
    from bench import prom

    d = served_deployment[1]
    ckpt = d.open_checkpoint()
    p = memory.plan(d, ckpt.root, ckpt.config, 0)
    seen = {(labels["part"], labels["kind"], labels["of"]): v
            for labels, v in prom.samples(prom.scrape(server.metrics_port), "cosmos3_gpu_memory_bytes")}  # fmt: skip
    for part in memory.PARTS:
        assert seen[part, "total", "planned"] == p.part_bytes(part), part
    assert seen["denoise", "weights", "planned"] == next(e.bytes for e in p.entries if e.part == "denoise"
                                                         and e.kind == "weights")  # fmt: skip
    held = {seen[part, "total", of] for part in ("prefill", "denoise", "vae_decode") for of in ("in_use", "peak")}
    assert held == {0.0}


def test_the_largest_request_is_the_one_with_the_most_rows():
    """The search counts rows, not pixels: a latent grid that is not a multiple of the patch rounds up, so 1264x1264
    (40x40 patches) at 109 frames packs more rows than 1280x720x189 under the same pixel budget."""
    from cosmos3_core.model.provision import resolve_checkpoint
    from cosmos3_core.requests import Limits

    cfg = Checkpoint.open(resolve_checkpoint("random:nano")).config
    largest = memory.largest_request(cfg, Limits())
    for h, w, f in ((720, 1280, 189), (1264, 1264, 109), (1280, 1280, 105)):
        gh, gw = cfg.token_grid(h, w)
        assert largest.rows >= 2 * gh * gw * (1 + (f - 1) // 4), (h, w, f)
    assert (largest.frame_height, largest.frame_width) == (1280, 1280)
    capped = memory.largest_request(cfg, dataclasses.replace(Limits(), max_frame_pixels=1280 * 720))
    assert capped.frame_pixels <= 1280 * 720 and capped.rows < largest.rows


def test_max_frame_pixels_refuses_a_larger_frame_by_name():
    from cosmos3_core.requests import Defaults, Limits, validate

    limits = dataclasses.replace(Limits(), max_frame_pixels=64 * 64)
    with pytest.raises(RequestError, match="height.*max_frame_pixels"):
        validate("p", {"height": 64, "width": 128, "num_frames": 1}, None, Defaults(), limits, 16, 4, None)
    validate("p", {"height": 64, "width": 64, "num_frames": 1}, None, Defaults(), limits, 16, 4, None)


def test_a_bound_below_the_largest_request_keeps_it_out_of_the_warmup(nano_ckpt):
    d = dataclasses.replace(_tiny(nano_ckpt, max_step_rows=1024), device="cuda", dtype="bfloat16")
    ckpt = d.open_checkpoint()
    planned, p = d.planned(ckpt, card=80 * memory.GIB)
    assert p.largest.rows > 1024 and planned.warmup_requests == d.warmup_requests
    roomy, p = dataclasses.replace(d, max_step_rows="auto").planned(ckpt, card=80 * memory.GIB)
    assert roomy.warmup_requests[-1] == p.largest.warmup_request(d.limits)
    assert roomy.planned(ckpt, card=80 * memory.GIB)[0].warmup_requests == roomy.warmup_requests  # added once
    # a part reloaded in the same server's life: its first load proved that peak on this card (ServerState)
    reload, _ = dataclasses.replace(d, max_step_rows="auto").planned(ckpt, card=80 * memory.GIB, peak_warmup=False)
    assert reload.warmup_requests == d.warmup_requests


def test_a_graph_bucket_over_max_capture_rows_is_refused_at_load(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("graph_buckets: [4096, 131072]\nmax_capture_rows: 65536\n")
    with pytest.raises(ValueError, match="graph_buckets.*max_capture_rows"):
        Deployment.load(path)


def test_a_decoder_streams_state_is_counted_once():
    """The decoder's workspace was measured over whole streams (its own stream's causal state inside): nano.yaml's
    one live stream at an unbanded 1280x720 adds nothing beside it, while Edge's banded 1280x1280 frame adds its
    other bands' state (halos included) and nothing for the band its call decodes."""
    nano = Deployment.load("configs/nano.yaml", checkpoint="random:nano", safety_checker="none")
    ckpt = nano.open_checkpoint()
    p = memory.plan(nano, ckpt.root, ckpt.config, 0)
    assert p.largest.frame_pixels <= memory.BAND_ABOVE_PIXELS and p.decode_streams == 1
    assert {e.kind for e in p.entries if e.part == "vae_decode"} == {"weights", "workspace", "context"}
    edge = Deployment.load("configs/edge.yaml", checkpoint="random:edge", safety_checker="none")
    ckpt = edge.open_checkpoint()
    p = memory.plan(edge, ckpt.root, ckpt.config, 0)
    s = ckpt.config.vae_scale_spatial
    h, w = p.largest.frame_height // s, p.largest.frame_width // s
    band = memory.plan_band_rows(h, w, s)
    assert band < h  # banded
    call = band + 2 * memory.BAND_HALO_ROWS
    bands_state = memory.STREAM_STATE_BYTES_PER_PIXEL * (-(-h // band) * call - call) * w * s * s
    others = memory.STREAM_STATE_BYTES_PER_PIXEL * edge.defaults.height * edge.defaults.width * (p.decode_streams - 1)
    streams = next(e.bytes for e in p.entries if e.kind == "streams")
    assert streams == bands_state + others


def test_expandable_segments_is_a_boolean_named_when_wrong(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("expandable_segments: yes-please\n")
    with pytest.raises(ValueError, match="expandable_segments: true or false"):
        Deployment.load(path)
    path.write_text("expandable_segments: false\n")
    assert Deployment.load(path).expandable_segments is False


@pytest.mark.parametrize("config", SHIPPED)
@pytest.mark.parametrize("spec", ["default", "largest", "streams"])
def test_the_memory_benchs_requests_are_admitted_by_each_shipped_config(config, spec):
    """`bench.memory --served` measures each part against its plan through these requests on the GPU: one the
    limits refuse would cost a device run and measure nothing. `streams` holds the plan's live decoder streams."""
    from bench.memory import requests_of
    from cosmos3_core.model.provision import resolve_checkpoint
    from cosmos3_core.requests import validate

    d = Deployment.load(config, safety_checker="none")
    ckpt = Checkpoint.open(resolve_checkpoint(f"random:{'edge' if 'edge' in config else 'nano'}"))
    p = memory.plan(d, ckpt.root, ckpt.config, 80 * memory.GIB)
    params = requests_of(spec, d, p)
    assert len(params) == (p.decode_streams if spec == "streams" else 1)
    for q in params:
        validate("p", q, None, d.defaults, d.limits, ckpt.config.pixel_alignment, ckpt.config.vae_scale_temporal, 1.0)
    if spec == "streams":
        assert (params[0]["width"], params[0]["height"]) == (p.largest.frame_width, p.largest.frame_height)


@pytest.mark.parametrize("stride", [24, 32])
def test_the_memory_bench_reads_nvmls_process_records_at_either_driver_stride(stride):
    """NVML's per-process record is 24 bytes on most drivers and 32 on R535 (the same function version): the sampler
    must find which from the records themselves, or every process after the first reads as garbage."""
    import ctypes
    import os

    from bench.memory import GpuProcesses

    records = [(os.getpid(), 3 * memory.GIB), (os.getppid(), 5 * memory.GIB + 123)]

    def query(handle, count_ref, raw):
        count_ref._obj.value = len(records)
        for i, (pid, used) in enumerate(records):
            entry = pid.to_bytes(4, "little") + bytes(4) + used.to_bytes(8, "little") + bytes(stride - 16)
            ctypes.memmove(ctypes.addressof(raw) + i * stride, entry, stride)
        return 0

    g = GpuProcesses()
    g.nvml, g.query, g.handles = object(), query, [None]
    assert g._nvml() == {os.getpid(): 3 * memory.GIB, os.getppid(): 5 * memory.GIB} and g.stride == stride


@pytest.fixture(scope="module")
def fp8_stored(nano_ckpt, tmp_path_factory) -> dict[str, Path]:
    """The tiny Nano as a ModelOpt FP8 checkpoint (`all`), and the same with its first layer's linears kept 16-bit
    (`partial`, as an FP8 revision may keep some)."""
    from safetensors.torch import load_file, save_file

    from cosmos3_core.tools.make_fp8 import make_fp8

    root = tmp_path_factory.mktemp("fp8_stored")
    full = make_fp8(nano_ckpt, root / "all")
    partial = make_fp8(nano_ckpt, root / "partial")
    src = load_file(nano_ckpt / "transformer" / "diffusion_pytorch_model.safetensors")
    path = partial / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(path)
    kept = [k.removesuffix(".weight") for k, v in state.items() if v.dtype == torch.float8_e4m3fn and ".0." in k]
    assert kept, "no FP8 linear in the first layer"
    for name in kept:
        for key in [k for k in state if k.startswith(name + ".")]:
            del state[key]
        state |= {k: v for k, v in src.items() if k.startswith(name + ".")}
    save_file(state, path)
    return {"all": full, "partial": partial}


@pytest.mark.parametrize("stored, precision", [("all", "checkpoint"), ("partial", "checkpoint"), ("partial", "fp8")])
def test_the_plan_counts_an_fp8_checkpoints_towers_as_loaded(fp8_stored, stored, precision):
    """A ModelOpt FP8 checkpoint's towers as they load: its E4M3 linears with tensorwise scales, the linears it keeps
    16-bit as such (or, served `precision: fp8`, quantized at load with a scale per output channel). Sized all FP8,
    a partially FP8 checkpoint was planned below what it holds."""
    d = Deployment(checkpoint=str(fp8_stored[stored]), device="cpu", dtype="float32", pool_pages=64,
                   precision=precision)  # fmt: skip
    ckpt = d.open_checkpoint()
    entry = {(e.part, e.kind): e.bytes for e in memory.plan(d, ckpt.root, ckpt.config, 0).entries}
    gen = ckpt.load_transformer({GEN}, "cpu", torch.float32)
    und = ckpt.load_transformer({UND}, "cpu", torch.float32)
    assert entry["denoise", "weights"] == _bytes([*gen.parameters(), *gen.buffers()])
    encoder = ckpt.load_vae("cpu", torch.float32, ("encoder",))
    assert entry["prefill", "weights"] == _bytes([*und.parameters(), *und.buffers()]) + _bytes(encoder.parameters())
