"""Nano AR windows: the engine against a hand-written sequential reference loop, page accounting, and
chunk-by-chunk decode against one decode of the whole latent sequence."""

from __future__ import annotations

import math

import pytest
import torch

from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.layers import GEN, UND
from cosmos3_core.model.rotary import rotary_tables, vision_position_ids
from cosmos3_core.model.towers import _gen_qkv, _gen_residual, embed_latent_tokens
from cosmos3_core.requests import Defaults, Limits
from cosmos3_core.rows import patchify, unpatchify
from cosmos3_core.sampling import guided_velocity, initial_noise, make_scheduler
from cosmos3_core.stages import DecodeStage, PrefillStage

H, W, FPS = 64, 96, 16.0


class ChunkSink:
    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.infos: list[dict] = []
        self.errors: list[str] = []
        self.finished = False

    def progress(self, step, steps, window, windows):
        pass

    def chunk(self, latents, info):
        self.chunks.append(latents.clone())
        self.infos.append(info)

    def done(self, latents, info):
        self.chunk(latents, info)
        self.finished = True

    def error(self, message):
        self.errors.append(message)

    def cancelled(self):
        return False


@pytest.fixture(scope="module")
def setup(nano_ckpt):
    ckpt = Checkpoint.open(nano_ckpt)
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=H, width=W, fps=FPS), Limits())
    model = ckpt.load_transformer({UND, GEN}, "cpu", torch.float32)
    return ckpt, prefill, model


def reference_gen(model, tokens, timestep, noisy_mask, rot, prefix_k, prefix_v):
    """GEN tower for one branch over [prefix | own tokens], plain SDPA. → (prediction tokens, per-layer k, v)."""
    x = embed_latent_tokens(model, tokens, noisy_mask, torch.tensor([float(timestep)]))
    ks, vs = [], []
    for i, layer in enumerate(model.layers):
        q, k, v = _gen_qkv(layer, x, *rot, len(x))  # 16-bit model: every row W8A16 (ignored)
        ks.append(k)
        vs.append(v)
        keys, values = torch.cat([prefix_k[i], k]), torch.cat([prefix_v[i], v])
        attn = (
            torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], enable_gqa=True
            )[0]
            .transpose(0, 1)
            .flatten(-2)
        )
        x = _gen_residual(layer, x, attn, len(x))
    return model.proj_out(model.norm_moe_gen(x)), torch.stack(ks), torch.stack(vs)


@torch.inference_mode()
def reference_ar(ckpt, model, pre, mode: str, window_lat: int, overlap_lat: int, context_lat: int, total_lat: int):
    """Sequential AR loop: one window at a time, one CFG branch at a time, K/V kept in Python lists."""
    cfg, p = ckpt.config, pre.params
    patch = cfg.latent_patch_size
    h, w = H // 16 // patch, W // 16 // patch
    per_frame = h * w
    ctx_k = [[] for _ in pre.text_k]  # per branch: list of per-frame [L, per_frame, kvh, d]
    ctx_v = [[] for _ in pre.text_k]
    windows, prev, start, k_idx = [], None, 0, 0
    while start < total_lat:
        pinned = overlap_lat if (mode == "chained" and prev is not None) else 0
        length = min(window_lat, pinned + total_lat - start)
        offset = start if mode == "kv" else 0
        lat = initial_noise((1, cfg.latent_channel, length, h * patch, w * patch), p.seed + k_idx, "cpu")
        if pinned:
            lat[:, :, :pinned] = prev[:, :, -pinned:]
        noisy = torch.zeros(length * per_frame, dtype=torch.bool)
        noisy[pinned * per_frame :] = True
        rots = [
            rotary_tables(
                cfg, vision_position_ids(cfg, (length, h, w), k.shape[1], p.fps, offset), torch.float32, "cpu"
            )
            for k in pre.text_k
        ]
        prefix = [
            ([torch.cat([pre.text_k[b][i], *[f[i] for f in ctx_k[b]]]) for i in range(cfg.num_hidden_layers)],
             [torch.cat([pre.text_v[b][i], *[f[i] for f in ctx_v[b]]]) for i in range(cfg.num_hidden_layers)])
            for b in range(len(pre.text_k))
        ]  # fmt: skip
        sched = make_scheduler(ckpt.scheduler_config, p.steps, p.shift, ckpt.use_native_flow_schedule, "cpu")
        keep = torch.zeros(length)
        keep[pinned:] = 1
        for t in sched.timesteps:
            vel = []
            for b in range(len(pre.text_k)):
                out, _, _ = reference_gen(model, patchify(lat, patch), float(t), noisy, rots[b], *prefix[b])
                vel.append(unpatchify(out, (length, h, w), patch, (h * patch, w * patch)) * keep.view(1, 1, -1, 1, 1))
            lat = sched.step(
                guided_velocity(vel, p.guidance_scale).unsqueeze(0), t, lat.unsqueeze(0), return_dict=False
            )[0].squeeze(0)
        windows.append(lat[:, :, pinned:])
        start += length - pinned
        if mode == "kv" and start < total_lat:  # commit: clean latents, no timestep; keep the last context frames
            for b in range(len(pre.text_k)):
                _, k, v = reference_gen(model, patchify(lat, patch), 0.0, torch.zeros_like(noisy), rots[b], *prefix[b])
                for f in range(length):
                    ctx_k[b].append(k[:, f * per_frame : (f + 1) * per_frame])
                    ctx_v[b].append(v[:, f * per_frame : (f + 1) * per_frame])
                if context_lat:
                    ctx_k[b], ctx_v[b] = ctx_k[b][-context_lat:], ctx_v[b][-context_lat:]
        prev, k_idx = lat, k_idx + 1
    return windows


@pytest.mark.parametrize(
    "mode, params, window_lat, overlap_lat, context_lat",
    [
        ("kv", {"num_frames": 41, "window_frames": 13, "context_frames": 17}, 4, 0, 5),  # 11 latent: 4+4+3, horizon 5
        ("kv", {"num_frames": 25, "window_frames": 9, "context_frames": 0}, 3, 0, 0),  # keep all context
        ("chained", {"num_frames": 37, "window_frames": 17, "overlap_frames": 8}, 5, 2, 0),  # 10 latent: 5+3+2
    ],
)
def test_windows_match_reference_and_pages_are_exact(setup, mode, params, window_lat, overlap_lat, context_lat):
    ckpt, prefill, model = setup
    p = prefill.validate(
        "a train crosses a bridge", {**params, "window_mode": mode, "steps": 3, "seed": 11, "guidance_scale": 4.0}, None
    )
    pre = prefill.run(p, None)
    total_lat = 1 + (p.num_frames - 1) // 4
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=512, page_size=4, max_queue=2)
    sink = ChunkSink()
    job_id = engine.submit(pre, sink)
    per_frame_pages = engine.pool.pages_for((H // 32) * (W // 32))
    text_pages = sum(engine.pool.pages_for(k.shape[1]) for k in pre.text_k)
    while engine.has_work():
        engine.tick()
        if engine.num_live:
            job = engine.scheduler.live[0]
            committed = (
                sum(engine.scheduler.plan(p).windows[i].length for i in range(job.window)) if mode == "kv" else 0
            )
            held = min(context_lat, committed) if context_lat else committed
            assert engine.pool.pages_used == text_pages + len(pre.text_k) * held * per_frame_pages
            assert engine.pages_held(job_id) == engine.pool.pages_used
    assert sink.finished and not sink.errors
    assert engine.pool.pages_used == 0 and engine.scheduler.reserved == 0
    ref = reference_ar(ckpt, model, pre, mode, window_lat, overlap_lat, context_lat, total_lat)
    assert len(sink.chunks) == len(ref)
    for ours, theirs in zip(sink.chunks, ref):
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() <= 1e-5 * max(1.0, theirs.abs().max().item())
    assert sum(c.shape[2] for c in sink.chunks) == total_lat
    assert [i["latent_offset"] for i in sink.infos] == [
        sum(c.shape[2] for c in sink.chunks[:k]) for k in range(len(ref))
    ]


def test_chained_single_window_equals_single_shot(setup):
    ckpt, prefill, _ = setup
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=256, page_size=16, max_queue=2)
    results = []
    for extra in ({"window_mode": "chained", "window_frames": 17}, {}):
        p = prefill.validate("x", {"num_frames": 17, "steps": 2, "seed": 5, **extra}, None)
        if extra:  # same templates as the single-shot request: a 17-frame clip either way
            assert p.window_frames == p.num_frames
        sink = ChunkSink()
        engine.submit(prefill.run(p, None), sink)
        engine.run_until_idle()
        results.append(sink.chunks)
    assert len(results[0]) == 1 and torch.equal(results[0][0], results[1][0])


def test_a_stream_whose_chunk_failed_fails_its_later_chunks(setup):
    """A chunk that fails to decode leaves its stream without its causal context: the stream's later chunks fail
    instead of decoding as a new stream's start, and other streams decode as usual."""
    ckpt, _, _ = setup
    decode = DecodeStage(ckpt, "cpu", torch.float32)
    assert list(decode.startup) == ["vae", "sound tokenizer", "decoder"]  # no compile on the CPU; the server logs them
    good = torch.randn(1, ckpt.config.latent_channel, 2, H // 16, W // 16, generator=torch.Generator().manual_seed(0))
    decode.start_chunk("s", good[:, :, :1], last=False)().numpy()
    with pytest.raises(RuntimeError):
        decode.start_chunk("s", good[:, :3, 1:], last=False)().numpy()  # wrong channel count
    with pytest.raises(RuntimeError, match="an earlier chunk of stream s failed"):
        decode.start_chunk("s", good[:, :, 1:], last=True)().numpy()
    assert decode.start_chunk("other", good, last=True)().numpy().shape == (5, H, W, 3)
    assert not decode.streams


def test_stream_decode_joins_like_one_decode(setup):
    ckpt, _, _ = setup
    decode = DecodeStage(ckpt, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, ckpt.config.latent_channel, 7, H // 16, W // 16, generator=g)
    whole = decode.run(latents)
    parts = [decode.start_chunk("s1", latents[:, :, a:b], last=b == 7)().numpy() for a, b in ((0, 3), (3, 5), (5, 7))]
    joined = torch.cat([torch.from_numpy(x) for x in parts]).numpy()
    assert joined.shape == whole.shape == (25, H, W, 3)
    mse = ((joined.astype("float64") - whole.astype("float64")) ** 2).mean()
    psnr = float("inf") if mse == 0 else 10 * math.log10(255**2 / mse)
    print(f"stream decode vs one decode: PSNR {psnr} dB (mse {mse})")
    assert psnr >= 40.0
    assert "s1" not in decode.streams


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: parked state really moves to host memory"))])  # fmt: skip
def test_streams_beyond_the_plans_live_ones_park_their_state_and_decode_the_same(setup, device, monkeypatch):
    """Three streams interleaved piece by piece, the decoder holding 2 streams' state on its device (in bytes): while
    a piece decodes, its stream's state is on the device and at most 2 streams' bytes are; the least recently decoded
    wait in host memory and come back at their next piece; a stream whose state failed to come back fails its later
    pieces; and every stream's frames equal its decode alone."""
    from cosmos3_core.model.conditioning import StreamDecoder

    ckpt, _, _ = setup
    decode = DecodeStage(ckpt, device, torch.float32)
    g = torch.Generator().manual_seed(1)
    streams = {s: torch.randn(1, ckpt.config.latent_channel, 3, H // 16, W // 16, generator=g) for s in "abc"}
    alone = {s: [decode.start_chunk(s, z[:, :, i : i + 1], last=i == 2)().numpy() for i in range(3)]
             for s, z in streams.items()}  # fmt: skip
    one = decode.state_seen[(H // 16, W // 16)]  # a stream's state after its pieces
    assert one > 0
    where: dict[int, str] = {}  # id(decoder) → where its state is (as move_state was last told)
    move, start = StreamDecoder.move_state, StreamDecoder.start

    def move_state(self, to, pinned=True):  # (on the CPU, host and device are one: told apart by what is passed)
        where[id(self)] = "host" if isinstance(to, str) else "device"  # parking passes "cpu", a restore the device
        move(self, to, pinned)

    def start_piece(self, latents):
        live = [dec for dec, _ in decode.streams.values() if dec is not None]
        assert where.get(id(self), "device") == "device"
        on_device = sum(d.state_bytes() for d in live if where.get(id(d), "device") == "device")
        assert on_device + max(self.state_bytes(), one) <= decode.gpu_state_bytes
        return start(self, latents)

    monkeypatch.setattr(StreamDecoder, "move_state", move_state)
    monkeypatch.setattr(StreamDecoder, "start", start_piece)
    decode.gpu_state_bytes = 2 * one
    mixed: dict[str, list] = {s: [] for s in streams}
    for i in range(3):
        for s, z in streams.items():
            mixed[s].append(decode.start_chunk(s, z[:, :, i : i + 1], last=i == 2)().numpy())
            if i < 2 and device == "cuda":
                assert all(t.device.type == "cpu" for p in decode.parked
                           for t in decode.streams[p][0].stream.state.values())  # fmt: skip
    for s in streams:
        assert all((x == y).all() for x, y in zip(alone[s], mixed[s], strict=True)), s
    assert not decode.streams and not decode.parked

    def failed_restore(self, to, pinned=True):
        if not isinstance(to, str):
            raise torch.cuda.OutOfMemoryError("no room to bring the state back")
        move_state(self, to, pinned)

    for s in "ab":  # "a" parked by "b"'s and the new "c"'s pieces, with room for 1
        decode.start_chunk(s, streams[s][:, :, :1], last=False)().numpy()
    decode.gpu_state_bytes = one
    decode.start_chunk("c", streams["c"][:, :, :1], last=False)().numpy()
    assert decode.parked == {"a", "b"}
    monkeypatch.setattr(StreamDecoder, "move_state", failed_restore)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        decode.start_chunk("a", streams["a"][:, :, 1:2], last=False)
    with pytest.raises(RuntimeError, match="an earlier chunk of stream a failed"):
        decode.start_chunk("a", streams["a"][:, :, 2:], last=True)


def test_states_waiting_on_the_host_are_pinned_up_to_the_stages_bound(setup, monkeypatch):
    """Pinned host memory cannot be swapped out: parked streams' and kept sessions' states are pinned while those
    waiting stay within `pinned_host_bytes`, and the next goes to pageable memory."""
    from cosmos3_core.model.conditioning import StreamDecoder

    ckpt, _, _ = setup
    decode = DecodeStage(ckpt, "cpu", torch.float32)
    seen: dict[int, bool] = {}  # id(decoder) → whether its move to the host was pinned
    move = StreamDecoder.move_state

    def move_state(self, to, pinned=True):
        if isinstance(to, str):
            seen[id(self)] = pinned
        move(self, to, pinned)

    monkeypatch.setattr(StreamDecoder, "move_state", move_state)
    z = torch.randn(1, ckpt.config.latent_channel, 1, H // 16, W // 16, generator=torch.Generator().manual_seed(3))
    decode.start_chunk("a", z, last=False)()
    one = decode.streams["a"][0].state_bytes()
    decode.gpu_state_bytes, decode.pinned_host_bytes = one, one  # one state on the device, one pinned on the host
    for sid in "bc":  # each parks the one before it
        decode.start_chunk(sid, z, last=False)()
    assert decode.parked == {"a", "b"}
    assert [seen[id(decode.streams[s][0])] for s in "ab"] == [True, False]
    decode.start_chunk("c", z, last=True, keep="kept")()  # a third waiting state: pageable too
    assert seen[id(decode.sessions["kept"][0])] is False


def test_parked_streams_are_counted_in_bytes_not_streams(setup):
    """The plan holds one stream's state at the largest frame and the rest at the default size: a second live stream
    at the largest frame takes more than the room of two small ones, so it parks the first, where counting streams
    (3 fit) would have parked none; a small third then fits beside it."""
    ckpt, _, _ = setup
    decode = DecodeStage(ckpt, "cpu", torch.float32)
    g = torch.Generator().manual_seed(2)
    small = torch.randn(1, ckpt.config.latent_channel, 1, H // 16, W // 16, generator=g)
    large = torch.randn(1, ckpt.config.latent_channel, 1, 2 * H // 16, 2 * W // 16, generator=g)
    for sid, z in (("s", small), ("l", large)):  # each size's state, as its pieces leave it
        decode.start_chunk(sid, z, last=False)()
        decode.start_chunk(sid, z, last=True)()
    small_bytes, large_bytes = decode.state_seen[small.shape[-2:]], decode.state_seen[large.shape[-2:]]
    assert large_bytes > small_bytes > 0
    decode.gpu_state_bytes = large_bytes + 2 * small_bytes  # three live streams, one at the largest frame
    decode.start_chunk("a", large, last=False)()
    decode.start_chunk("b", large, last=False)()
    assert decode.parked == {"a"}
    decode.start_chunk("c", small, last=False)()
    assert decode.parked == {"a"}
    assert decode.state_seen[small.shape[-2:]] == small_bytes  # a first piece's smaller state does not lower it


@pytest.mark.parametrize(
    "params",
    [
        {"num_frames": 9},
        {"num_frames": 33, "window_mode": "chained"},
        {"num_frames": 33, "window_mode": "kv"},
        {"num_frames": 1},
    ],  # fmt: skip
    ids=["t2v", "chained", "kv", "t2i"],
)
def test_the_done_params_sent_back_are_accepted_and_resolve_the_same(setup, params):
    """README: `done.params` reproduces a result when sent back. Every window mode's echo must validate again (no
    field the mode refuses, e.g. a chained request's context_frames) and resolve to itself."""
    _, prefill, _ = setup
    echo = prefill.validate("a fox", params, None).resolved()
    assert prefill.validate("a fox", echo, None).resolved() == echo
