"""Our Wan2.2 decoder forward (`wan_decoder.py`) against diffusers' `AutoencoderKLWan.decode` on the tiny VAE in
fp32: whole videos and streamed chunks, an odd latent grid, and non-trivial norm weights (the tiny checkpoint's
are ones, which would hide a norm applied over the wrong axis)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.conditioning import StreamDecoder, VaeCodec
from cosmos3_core.model.random_checkpoint import WAN22_VAE
from cosmos3_core.model.wan_decoder import EAGER, DecoderKernels, WanDecoder
from cosmos3_core.model.wan_weights import WanDecoderWeights


@pytest.fixture(scope="module")
def vae(nano_ckpt):
    vae = Checkpoint.open(nano_ckpt).load_vae("cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in vae.decoder.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return vae


def reference_frames(vae, latents: torch.Tensor) -> np.ndarray:
    """diffusers' decode, then the pipeline's `output_type="np"` × 255, rounded."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents * std + mean).sample.clamp(-1, 1)
    frames = (video[0].permute(1, 2, 3, 0) * 0.5 + 0.5).clamp(0, 1)
    return (frames * 255).round().to(torch.uint8).numpy()


@pytest.mark.parametrize("grid", [(4, 6), (3, 5)])
def test_decoder_matches_diffusers_whole_and_streamed(vae, grid):
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, vae.config.z_dim, 7, *grid, generator=g)
    ref = reference_frames(vae, latents)
    codec = VaeCodec(vae)
    whole = codec.decode(latents).numpy()
    stream = StreamDecoder(codec)
    parts = [stream.decode(latents[:, :, a:b]).numpy() for a, b in ((0, 1), (1, 6), (6, 7))]
    joined = np.concatenate(parts)
    assert whole.shape == joined.shape == ref.shape == (25, grid[0] * 16, grid[1] * 16, 3)
    for ours in (whole, joined):
        diff = np.abs(ours.astype(int) - ref.astype(int))
        assert diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())


def test_each_latent_frame_decodes_the_same_in_any_chunking(vae):
    """Frame-by-frame (diffusers' call pattern, our CPU default) vs 4-frame calls (our CUDA default): the same
    per-conv causal state."""
    latents = torch.randn(1, vae.config.z_dim, 6, 4, 4, generator=torch.Generator().manual_seed(2))
    x = latents * torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    by_frame = WanDecoder(vae, frames_per_call=1).stream()
    one = torch.cat([by_frame(x[:, :, i : i + 1]) for i in range(6)])
    chunked = WanDecoder(vae, frames_per_call=4).stream()(x)
    assert torch.equal(one, chunked) or (one.int() - chunked.int()).abs().max() <= 1


def test_compiled_decoder_kernels_equal_eager_on_cpu(vae, tmp_path):
    """The kernels the GPU runs compiled (`compile: true`), compiled here on CPU in fp32, in 4-frame calls as
    on CUDA, over two sizes: a fusion or a dynamic-shape guard that changes the result fails here. They are
    compiled ahead into a store (as served, `precompiled.py`); a second decoder, as a restarted process would,
    loads them from it for other sizes, a square one included (no guard ties the grid's sides), and compiles none."""
    eager = WanDecoder(vae, frames_per_call=4)

    def check(decoder: WanDecoder, shapes) -> None:
        for shape in shapes:
            x = torch.randn(1, vae.config.z_dim, *shape, generator=torch.Generator().manual_seed(4))
            diff = (eager.stream()(x).int() - decoder.stream()(x).int()).abs()
            assert diff.max() <= 1 and diff.float().mean() < 0.01, (shape, diff.max(), diff.float().mean())

    check(WanDecoder(vae, DecoderKernels.compiled(tmp_path), frames_per_call=4), [(6, 4, 6)])
    artifacts = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert artifacts and all(name.endswith(".bin") for name in artifacts), artifacts
    check(WanDecoder(vae, DecoderKernels.compiled(tmp_path), frames_per_call=4), [(9, 3, 5), (5, 6, 6)])
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == artifacts


def test_a_one_frame_piece_runs_the_compiled_kernels_of_a_four_frame_one():
    """The compiled kernels' time axes are unbacked: a stream's first piece (one latent frame) and the later ones
    (four, two) share a graph, equal to eager. With sizes 0 and 1 specialised (`maybe_mark_dynamic` alone) each
    kernel here recompiled at four frames, and the served warmup loaded 24 graphs instead of 17 (~0.7 s each at
    startup on the H200)."""
    import torch._dynamo

    compiled, g = DecoderKernels.compiled(), torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g)

    cases = {  # kernel → its arguments for a piece of t latent frames
        "split_time": lambda t: (rand(1, t, 3, 5, 16), rand(16)),
        "dup_up_add": lambda t: (rand(1, 2 * t, 6, 10, 8), rand(1, t, 3, 5, 16), 2, 0),
        "dup_up_add ": lambda t: (rand(1, t, 6, 10, 8), rand(1, t, 3, 5, 16), 1, 0),  # a spatial-only block
        "phases_to_pixels": lambda t: (rand(t, 4, 6, 32), rand(32)),
        "to_frames": lambda t: (rand(1, t, 3, 5, 12), rand(12), 2),
    }
    with torch._dynamo.config.patch(error_on_recompile=True):
        for name, args in cases.items():
            torch._dynamo.reset()  # each case from no graph: its integer arguments make a graph of their own
            for t in (1, 4, 2):
                a = args(t)
                kernel = name.strip()
                assert torch.equal(getattr(compiled, kernel)(*a), getattr(EAGER, kernel)(*a)), (name, t)


def test_a_torch_that_refuses_an_unbacked_time_axis_compiles_it_backed(monkeypatch, capfd):
    """Where tracing a time axis unbacked fails (a torch without the support), the kernel says so once on stderr and
    compiles as before (size 1 specialised): the decoder still loads and decodes, only with more graphs."""
    import torch._dynamo

    def refuse(t, dim):
        raise RuntimeError("unbacked symbols are not supported here")

    monkeypatch.setattr(torch._dynamo.decorators, "mark_unbacked", refuse)
    torch._dynamo.reset()
    compiled = DecoderKernels.compiled()
    for t in (1, 4):
        y, bias = torch.randn(1, t, 3, 5, 16), torch.randn(16)
        assert torch.equal(compiled.split_time(y, bias), EAGER.split_time(y, bias))
    err = capfd.readouterr().err
    assert err.count("split_time compiles with its time axis backed") == 1, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled decoder kernels: CUDA")
def test_compiled_decoder_kernels_in_bf16_on_gpu_are_as_close_to_fp32_as_eager(nano_ckpt):
    """bf16 rounds differently when the norm, SiLU and concatenation are fused, so compiled and eager are each
    held to the fp32 CPU decode (itself held to diffusers above)."""
    ckpt = Checkpoint.open(nano_ckpt)
    latents = torch.randn(1, ckpt.config.latent_channel, 6, 4, 6, generator=torch.Generator().manual_seed(3))
    ref = VaeCodec(ckpt.load_vae("cpu", torch.float32)).decode(latents).float()
    codec = VaeCodec(ckpt.load_vae("cuda", torch.bfloat16))
    eager = (codec.decode(latents).float() - ref).abs()
    codec.decoder.kernels = DecoderKernels.compiled()
    compiled = (codec.decode(latents).float() - ref).abs()
    print(
        f"vs fp32: eager mean {eager.mean():.3f} max {eager.max():.0f}; compiled mean {compiled.mean():.3f} max {compiled.max():.0f}"
    )
    assert eager.mean() < 2.0 and compiled.mean() < 2.0, (eager.mean(), compiled.mean())
    assert compiled.mean() <= 1.5 * eager.mean() + 0.25, (eager.mean(), compiled.mean())


def gpu_codec_and_chunks(nano_ckpt, seed: int) -> tuple[VaeCodec, list[torch.Tensor]]:
    """The tiny VAE in bf16 on the GPU, and 9 random latent frames in a stream's pieces of 1, 4 and 4."""
    ckpt = Checkpoint.open(nano_ckpt)
    codec = VaeCodec(ckpt.load_vae("cuda", torch.bfloat16))
    latents = torch.randn(1, ckpt.config.latent_channel, 9, 4, 6, generator=torch.Generator().manual_seed(seed))
    return codec, [latents[:, :, a:b] for a, b in ((0, 1), (1, 5), (5, 9))]


def decoded_one_by_one(codec: VaeCodec, chunks: list[torch.Tensor]) -> torch.Tensor:
    """One stream's pieces, each waited on before the next starts: the reference for launches that overlap."""
    stream = StreamDecoder(codec)
    return torch.cat([stream.decode(c).clone() for c in chunks])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="asynchronous host copies: CUDA")
def test_chunks_started_back_to_back_on_gpu_equal_the_same_chunks_decoded_one_by_one(nano_ckpt):
    """`StreamDecoder.start` returns before a chunk's frames reach the host. Chunks launched back to back from
    another thread (as vae_decode's decode thread does) and waited on afterwards equal the same chunks decoded one
    at a time, each waited on before the next starts: a wait that returned before its copy would hand over stale
    pinned memory. The reference is the same chunking, not one whole decode: in bf16 on the GPU a frame's result
    depends on the frame count of its call (other conv shapes, other kernels); the whole-decode version of this test
    failed on the H200 on 2026-12-01 with its numbers lost, and this one separates a race from that."""
    codec, chunks = gpu_codec_and_chunks(nano_ckpt, seed=5)
    one_by_one = decoded_one_by_one(codec, chunks)
    stream, pending = StreamDecoder(codec), []
    launch = threading.Thread(target=lambda: pending.extend(stream.start(c) for c in chunks))
    launch.start()
    launch.join()
    joined = torch.cat([wait() for wait in pending])
    assert joined.shape == one_by_one.shape == (33, 64, 96, 3)
    diff = (joined.int() - one_by_one.int()).abs()
    assert diff.max() <= 1, f"back to back vs one by one: max |diff| {diff.max()}, mean {diff.float().mean():.3f}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned, non-blocking state moves: CUDA")
def test_a_stream_whose_state_waits_on_the_host_between_pieces_decodes_as_one_that_stays(nano_ckpt):
    """A parked stream's or kept session's decoder state goes to pinned host memory and back without waiting
    (`StreamDecoder.move_state`): each copy queues behind the piece before it and ahead of the next. Launched back
    to back with the moves between them, with a large allocation on the same stream in between (the freed device
    state reused), the frames equal the same pieces with the state kept on the device, bit for bit."""
    codec, chunks = gpu_codec_and_chunks(nano_ckpt, seed=7)
    reference = decoded_one_by_one(codec, chunks)
    moved, pending = StreamDecoder(codec), []
    for i, c in enumerate(chunks):
        pending.append(moved.start(c))
        if i < len(chunks) - 1:
            shapes = [(v.shape, v.dtype) for st in moved._streams() for v in st.state.values()]
            moved.move_state("cpu")
            # the freed state's blocks, taken at once and overwritten: a copy to the host that had not yet read
            # them would read 7s
            scribble = [torch.full(shape, 7, dtype=dtype, device="cuda") for shape, dtype in shapes]
            del scribble
            moved.move_state("cuda")
    joined = torch.cat([wait() for wait in pending])
    assert torch.equal(joined, reference)


def test_our_decoder_weights_are_diffusers_decoder_half_and_decode_alike(nano_ckpt, vae):
    """`load_vae_decoder` reads the checkpoint's decoder keys into our container: the same names, shapes and
    values as diffusers' `AutoencoderKLWan` decoder half, and our forward over it decodes as over diffusers' (here
    with the fixture's non-trivial norms and biases copied in)."""
    ours = Checkpoint.open(nano_ckpt).load_vae_decoder("cpu", torch.float32)
    assert isinstance(ours, WanDecoderWeights)
    theirs = Checkpoint.open(nano_ckpt).load_vae("cpu", torch.float32, ("decoder",))
    half = {k: v for k, v in theirs.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))}
    mine = ours.state_dict()
    assert {k: tuple(v.shape) for k, v in mine.items()} == {k: tuple(v.shape) for k, v in half.items()}
    assert all(torch.equal(mine[k], half[k]) for k in half)
    ours.load_state_dict({k: v for k, v in vae.state_dict().items() if k in mine})
    latents = torch.randn(1, vae.config.z_dim, 6, 4, 5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(VaeCodec(ours).decode(latents), VaeCodec(vae).decode(latents))


def test_the_decode_stage_loads_a_wan22_vae_without_importing_diffusers(nano_ckpt):
    """A vae_decode start imports no diffusers for a checkpoint without sound (seconds of a reload): the stage built
    as the stub builds it, and a stream's chunks decoded. In a fresh process, as a stub's."""
    # a module whose sys.modules entry is None was blocked, not imported (the GPU machine's venv blocks scipy so)
    script = (
        "import sys, torch\n"
        "from cosmos3_core.model.checkpoint import Checkpoint\n"
        "from cosmos3_core.stages import DecodeStage\n"
        f"stage = DecodeStage(Checkpoint.open({str(nano_ckpt)!r}), 'cpu', torch.float32)\n"
        "assert stage.sound_tokenizer is None, 'a checkpoint with sound: its tokenizer is diffusers class'\n"
        "z = torch.zeros(1, stage.codec.vae.config.z_dim, 2, 2, 2)\n"
        "stage.start_chunk('s', z[:, :, :1], False)()\n"
        "stage.start_chunk('s', z[:, :, 1:], True)()\n"
        "print(sorted(m for m, mod in sys.modules.items() if mod is not None\n"
        "             and m.split('.')[0] in ('diffusers', 'transformers', 'scipy')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_a_vae_missing_a_decoder_tensor_is_refused_by_file_and_name(nano_ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from cosmos3_core.model.checkpoint import CheckpointError

    root = tmp_path / "ckpt"
    shutil.copytree(nano_ckpt, root)
    weights = root / "vae" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    del state["decoder.conv_out.weight"]
    save_file(state, weights)
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model.safetensors: 1 decoder tensor\(s\) missing, "
                       r"e.g. decoder.conv_out.weight"):  # fmt: skip
        Checkpoint.open(root).load_vae_decoder("cpu", torch.float32)


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"decoder_base_dim": None},
        {"num_res_blocks": 0},
        {"num_res_blocks": 3},
        {"dim_mult": [1, 1, 2, 4, 4], "temperal_downsample": [False, False, True, True]},
        {"temperal_downsample": [True, False, True]},
        {k: v for k, v in WAN22_VAE.items() if k != "_class_name"},  # the real Wan2.2 VAE's (meta: no memory)
    ],
)
def test_our_decoder_weights_have_diffusers_names_and_shapes_for_any_wan22_config(tmp_path, over):
    """Built from config.json alone, on the meta device: every decoder tensor of diffusers' `AutoencoderKLWan` and
    none more, of its shape, and the attributes `WanDecoder` reads (causal padding, norm scale, upsample modes,
    the duplicate-upsample shortcut's factors)."""
    from diffusers import AutoencoderKLWan

    from cosmos3_core.model.wan_weights import read_config

    cfg = {"base_dim": 16, "decoder_base_dim": 24, "z_dim": 8, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
           "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
           "patch_size": 2, **over}  # fmt: skip
    cfg |= {"latents_mean": [0.0] * cfg["z_dim"], "latents_std": [1.0] * cfg["z_dim"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with torch.device("meta"):
        theirs, ours = AutoencoderKLWan(**cfg), WanDecoderWeights(read_config(tmp_path))
    half = {k: tuple(v.shape) for k, v in theirs.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == half

    def attrs(vae) -> dict:
        out = {}
        for name, m in vae.decoder.named_modules():
            for attr in ("_padding", "scale"):
                if hasattr(m, attr):
                    out[(name, attr)] = getattr(m, attr)
            if hasattr(m, "resample"):  # WanResample: its mode (upsample2d / upsample3d)
                out[(name, "mode")] = m.mode
        for i, block in enumerate(vae.decoder.up_blocks):
            s = block.avg_shortcut
            out[(i, "shortcut")] = s and (s.in_channels, s.out_channels, s.factor_t, s.factor_s)
        return out

    assert attrs(ours) == attrs(theirs)


def test_a_wan22_config_our_forward_refuses_is_left_to_diffusers(tmp_path):
    """`wan_weights.unsupported` asks our forward (`wan_decoder.unsupported`) of the container it would build: a
    residual VAE whose duplicate-upsample shortcut our broadcast form cannot take goes to diffusers' class."""
    from cosmos3_core.model.wan_weights import unsupported

    cfg = {k: v for k, v in WAN22_VAE.items() if k != "_class_name"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert unsupported(tmp_path, random_weights=True) is None
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "dim_mult": [1, 2, 4, 2]}))
    assert "DupUp3D" in (unsupported(tmp_path, random_weights=True) or "")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "is_residual": False}))
    assert "is_residual" in (unsupported(tmp_path, random_weights=True) or "")


def test_our_decoder_refuses_a_vae_other_than_wan22():  # VaeCodec then falls back (test_vae_fallback.py)
    from diffusers import AutoencoderKLWan

    wan21 = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1)  # no residual, no patch
    with pytest.raises(ValueError, match="Wan2.2"):
        WanDecoder(wan21)
