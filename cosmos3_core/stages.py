"""The two stages Triton hosts around the denoise engine (what crosses between them: wire.py).

PrefillStage: validated request → token ids (templates, chat template; an action request's JSON caption) → UND tower
once per CFG branch → `PrefillResult` (per-branch text K/V `[layers, tokens, kv_heads, head_dim]`, the i2v / v2v /
action conditioning latents, forward dynamics' clean action tokens).
DecodeStage: normalised latents → uint8 frames, whole or a stream's chunks in order (`launch` a chunk event's,
then wait for its frames), each stream keeping its decoder cache. The offline CLI chains the same objects.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import replace

import numpy as np
import torch

from . import faults, memory
from .deployment import Deployment, use_device
from .lora_store import LoraSettings, adapter_dir, open_store, weights_file
from .memory import MemoryPlan
from .model.action import condition_actions, encode_action_condition
from .model.checkpoint import Checkpoint
from .model.conditioning import HostFrames, StreamDecoder, VaeCodec
from .model.embodiments import DOMAIN_IDS, FORWARD, ActionGeometry
from .model.layers import UND
from .model.lora import AdapterRows
from .model.prompts import PromptEncoder
from .model.rotary import rotary_tables, text_position_ids
from .model.sound import SoundSpec, decode_sound, load_sound_tokenizer
from .model.towers import prefill_text_kv
from .model.video_input import encode_video_condition
from .parallel.group import Group
from .parallel.vae import PatchDecoder
from .requests import Defaults, GenerationParams, Limits, RequestError, validate
from .safety import TEXT, VIDEO, Guardrail, Refused
from .sampling import checkpoint_shift
from .windows import pixel_frames_of_chunk
from .wire import ChunkEvent, PrefillResult


def text_digest(branches: list[list[int]], lora: object) -> str:
    """What a request's text K/V depends on besides the weights: each CFG branch's token ids and the adapter."""
    ids = [[int(i) for i in b] for b in branches]
    return hashlib.sha256(json.dumps([ids, repr(lora)]).encode()).hexdigest()[:32]


class PrefillStage:
    def __init__(
        self,
        ckpt: Checkpoint,
        device: str,
        dtype: torch.dtype,
        defaults: Defaults,
        limits: Limits,
        lora: LoraSettings | None = None,
        *,
        safety: Guardrail | None = None,
        safety_optional: bool = False,
        encoder_in_background: bool = False,
    ):
        """`lora`: the deployment's adapters; one on the UND tower changes the text K/V, so prefill applies it.
        `safety`: the text guardrail every prompt passes before any work (None: no checks); `safety_optional`: a
        request may opt out (`enable_safety_check` false). `encoder_in_background`: the VAE encoder loads on a
        thread of its own while the stage serves text requests; the first request that encodes waits for it (a
        reload: the encoder's import is seconds, and a text-only request needs none of it)."""
        self.safety, self.safety_optional = safety, safety_optional
        self.cfg = ckpt.config
        self.device, self.dtype = device, dtype
        self.defaults, self.limits = defaults, limits
        self.plan: MemoryPlan | None = None  # the deployment's memory plan (from_deployment)
        self.startup: dict[str, float] = {}  # seconds per part of the load (the server logs them)
        t0 = time.perf_counter()
        self.shift = checkpoint_shift(ckpt.scheduler_config)
        t1 = time.perf_counter()
        # the tokenizer (transformers' import: seconds) on a thread while the tower loads; the adapters only after
        # the join: peft imports transformers too, and two threads importing one package can see it half made
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
            tokenizer = pool.submit(ckpt.load_tokenizer)
            self.model = ckpt.load_transformer({UND}, device, dtype)
            t2 = time.perf_counter()
            self.prompts = PromptEncoder(tokenizer.result(), ckpt.default_use_system_prompt)
        t3 = time.perf_counter()
        self.loras = open_store(lora, ckpt, self.model)
        # FP8: the UND tower (the policy's reasoner) runs W8A16 or W8A8 for every request alike
        self.und_a16 = ckpt.fp8 is None or ckpt.fp8.policy.reasoner_a16
        self.startup.update({"flow shift": t1 - t0, "UND tower": t2 - t1, "tokenizer after it": t3 - t2})
        self._ckpt = ckpt
        self._encoder: VaeCodec | None = None
        self._encoder_loading: threading.Thread | None = None
        if encoder_in_background:
            self._encoder_loading = threading.Thread(target=self._load_encoder_here, name="vae-encoder", daemon=True)
            self._encoder_loading.start()
        else:
            self._encoder = self._load_encoder()
            self.startup["VAE encoder"] = time.perf_counter() - t3
        try:
            SoundSpec.open(ckpt.root)
            self.no_sound: str | None = None
        except (ValueError, OSError) as e:  # a checkpoint without sound still serves everything else
            self.no_sound = str(e)

    def _load_encoder(self) -> VaeCodec:
        return VaeCodec(self._ckpt.load_vae(self.device, self.dtype, ("encoder",)))  # it only encodes

    def _load_encoder_here(self) -> None:
        """The background load (on its own thread): a failure is said, and the next request that encodes loads again."""
        t = time.perf_counter()
        try:
            use_device(self.device)
            self._encoder = self._load_encoder()
            print(f"cosmos3_prefill: VAE encoder loaded in the background in {time.perf_counter() - t:.1f}s",
                  file=sys.stderr, flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001
            print(f"cosmos3_prefill: the VAE encoder's load in the background failed ({type(e).__name__}: {e}); the "
                  "next request that encodes loads it again", file=sys.stderr, flush=True)  # fmt: skip

    @property
    def codec(self) -> VaeCodec:
        """The VAE encoder: waits for its load in the background; after one that failed, loads it here (its error,
        if it fails again, is this caller's). Requests run one at a time per stage (a prefill instance's `execute`)."""
        if self._encoder_loading is not None:
            self._encoder_loading.join()
            self._encoder_loading = None
        if self._encoder is None:
            self._encoder = self._load_encoder()
        return self._encoder

    @classmethod
    def from_deployment(
        cls, ckpt: Checkpoint, d: Deployment, device: str, turn: AbstractContextManager | None = None,
        peak_warmup: bool = True,
    ) -> PrefillStage:  # fmt: skip
        """With the deployment's text guardrail (`safety.Unavailable` when it cannot be built here). Refuses a
        deployment whose memory plan does not fit its card (`memory.PlanError`). `turn`: held around the encoder's
        warmup at the largest frame (a server's parts reach their peaks one at a time: `ServerState.warmup_turn`);
        `peak_warmup` False skips it (a reload, that peak proven by the part's first load) and loads the encoder in
        the background."""
        t0 = time.perf_counter()
        _, plan = d.planned(ckpt)
        t1 = time.perf_counter()
        safety = Guardrail.load(d.safety_checker, device, TEXT)
        t2 = time.perf_counter()
        stage = cls(ckpt, device, d.torch_dtype, d.defaults, d.limits, d.lora, safety=safety,
                    safety_optional=d.safety_checker_optional, encoder_in_background=not peak_warmup)  # fmt: skip
        stage.plan = plan
        stage.startup = {"plan": t1 - t0, "guardrail": t2 - t1, **stage.startup}
        if (
            str(device).startswith("cuda") and peak_warmup
        ):  # the encoder's peak at load: a clip's first call at the largest frame
            t2, big = time.perf_counter(), plan.largest
            with turn or contextlib.nullcontext(), torch.inference_mode():
                clip = torch.zeros(1, 3, 5, big.frame_height, big.frame_width, dtype=stage.codec.dtype, device=device)
                stage.codec.vae.encode(clip)
                del clip
                memory.release_cached()
            stage.startup["memory warmup"] = time.perf_counter() - t2
        return stage

    def validate(
        self,
        prompt: bytes | str,
        params: dict,
        image: np.ndarray | None,
        video: np.ndarray | None = None,
        raw_actions: np.ndarray | None = None,
        kept: GenerationParams | None = None,
    ) -> GenerationParams:
        """`kept`: the parameters of the session a continuation names (sessions.py), None when it has none."""
        p = validate(
            prompt, params, image, self.defaults, self.limits, self.cfg.pixel_alignment, self.cfg.vae_scale_temporal,
            self.shift, video, raw_actions, kept,
        )  # fmt: skip
        if not p.enable_safety_check and self.safety is not None and not self.safety_optional:
            raise RequestError("enable_safety_check", f"this deployment always runs the {self.safety.name} "
                               "(its safety_checker_optional is false)")  # fmt: skip
        if p.enable_sound and self.no_sound is not None:
            raise RequestError("enable_sound", f"this checkpoint cannot make sound ({self.no_sound})")
        if p.action_mode:
            self._check_action(p)
        if p.lora is not None:  # the name (and the refusal of pickles) now; its weights are checked by `run`
            if self.loras is None:
                raise RequestError("lora", "this deployment serves no adapters (its lora_dir is not set)")
            weights_file(adapter_dir(self.loras.settings.dir, p.lora.name))
        return p

    def _check_action(self, p: GenerationParams) -> None:
        """What an action request needs of the checkpoint (P:1049-1058, 830-835)."""
        cfg = self.cfg
        if not cfg.action_gen:
            raise RequestError("action", "this checkpoint has no action weights (action_gen)")
        if p.raw_action_dim > cfg.action_dim:
            raise RequestError(
                "action.domain",
                f"{p.domain!r} has {p.raw_action_dim} action channels; this checkpoint's action_dim is {cfg.action_dim}",
            )
        if DOMAIN_IDS[p.domain] >= cfg.num_embodiment_domains:
            raise RequestError(
                "action.domain", f"{p.domain!r} is domain {DOMAIN_IDS[p.domain]}; this checkpoint has "
                f"{cfg.num_embodiment_domains} (num_embodiment_domains)",
            )  # fmt: skip

    @torch.inference_mode()
    def run(
        self,
        p: GenerationParams,
        image: np.ndarray | None,
        video: np.ndarray | None = None,
        raw_actions: np.ndarray | None = None,
        reuse: str = "",
    ) -> PrefillResult:
        """`reuse`: a continuation's session's `text_digest`: when the request's text tokens are the session's, the
        result holds no text K/V (the engine reuses the session's) and the prompt, already checked, is not again."""
        # an AR window is generated as a clip of window_frames: its templates describe that clip
        frames = p.num_frames if p.window_mode == "none" else p.window_frames
        if p.action_mode:  # the canvas's size and chunk + 1 frames, in the JSON caption
            cond_ids, uncond_ids = self.prompts.encode_action(
                p.prompt, p.negative_prompt, frames, p.height, p.width, p.fps, p.view_point, p.use_system_prompt
            )
        else:
            cond_ids, uncond_ids = self.prompts.encode(
                p.prompt, p.negative_prompt, frames, p.height, p.width, p.fps, p.use_system_prompt, p.add_templates
            )
        branches = [cond_ids, uncond_ids][: p.cfg_branches]
        for name, ids in zip(("prompt", "negative_prompt"), branches):
            if len(ids) > self.limits.max_prompt_tokens:
                raise RequestError(name, f"is {len(ids)} tokens with templates, limit {self.limits.max_prompt_tokens}")
        p = replace(p, text_digest=text_digest(branches, p.lora))
        if reuse and p.session_continue and reuse == p.text_digest:
            return PrefillResult(p, [], [], None)
        if self.safety is not None and p.enable_safety_check:  # the prompt as given, before the tower (the pipeline's)
            self.safety.check_prompt(p.prompt)
        text_k, text_v = [], []
        slot = self._hold_lora(p)
        try:
            for ids in branches:
                cos, sin = rotary_tables(self.cfg, text_position_ids(len(ids)), self.dtype, self.device)
                lora = None if slot is None else AdapterRows.single(slot, p.lora.scale, len(ids), self.device)  # type: ignore[union-attr]
                k, v = prefill_text_kv(self.model, torch.tensor(ids, device=self.device), cos, sin, self.und_a16, lora)
                text_k.append(k)
                text_v.append(v)
        finally:
            if slot is not None:
                self.loras.release(slot)  # type: ignore[union-attr]
        if p.action_mode:
            return PrefillResult(p, text_k, text_v, *self._action_condition(p, image, video, raw_actions))
        cond = self.codec.encode_first_frame(image, p.height, p.width) if image is not None else None
        if video is not None:  # v2v: [1, C, T_lat, h, w], the clean frames encoded, the rest zero
            cond = encode_video_condition(
                self.codec, video, p.condition_frame_indexes, p.condition_video_keep,  # type: ignore[arg-type]
                p.num_frames, p.height, p.width,
            ).latents  # fmt: skip
        return PrefillResult(p, text_k, text_v, cond)

    def _hold_lora(self, p: GenerationParams) -> int | None:
        """The slot of the request's adapter, pinned (RequestError `lora` for one that cannot serve this checkpoint);
        None without one, or when it adapts only the GEN tower (the text K/V is the base model's)."""
        if p.lora is None or self.loras is None:
            return None
        ref = self.loras.check(p.lora.name)
        if UND not in ref.towers:
            return None
        slot = self.loras.acquire(ref)
        if slot is None:  # prefill releases its slot after each request: only a concurrent caller could hold them
            raise RuntimeError("every adapter slot of the prefill stage is held")
        return slot

    def _action_condition(
        self, p: GenerationParams, image: np.ndarray | None, video: np.ndarray | None, raw: np.ndarray | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """→ (clean vision latents [1, C, T_lat, lh, lw]: the anchor frame, or the whole clip for inverse dynamics;
        forward dynamics' clean action tokens [chunk, action_dim] or None)."""
        clip = video if video is not None else image[None]  # type: ignore[index]  # an image is a one-frame clip
        geo = ActionGeometry.of(clip.shape[1], clip.shape[2], p.resolution_tier, self.cfg.pixel_alignment)
        cond = encode_action_condition(self.codec, clip, p.action_mode, p.chunk_size, geo)
        if p.action_mode != FORWARD:
            return cond, None
        return cond, condition_actions(torch.from_numpy(raw), p.chunk_size, self.cfg.action_dim)  # type: ignore[arg-type]


def warm_decoder(codec: VaeCodec, latent_channel: int) -> None:
    """Compile the decoder's fused kernels now, not mid-stream: 1 + 4 + 1 latent frames (a stream's first piece
    passes its own integer arguments) at distinct sizes (no duck-sized guards) cover every later size."""
    codec.decode(torch.zeros(1, latent_channel, 6, 5, 7))


class DecodeStage:
    """Whole videos, or AR streams chunk by chunk (decoder cache kept per stream id between chunks)."""

    STREAM_IDLE_S = 900.0  # a stream whose chunks stopped (its request failed upstream) is dropped after this

    def __init__(
        self,
        ckpt: Checkpoint,
        device: str,
        dtype: torch.dtype,
        compile: bool = False,
        group: Group | None = None,
        safety: Guardrail | None = None,
        plan: MemoryPlan | None = None,
        turn: AbstractContextManager | None = None,
        peak_warmup: bool = True,
    ):
        """`group`: decode each chunk split by rows over its decode ranks (parallel/vae.py). `startup`: seconds
        per part of this load (the server logs them). `safety`: the video guardrail every piece of frames passes
        before it is returned (None: no checks). `plan`: the deployment's memory plan (on CUDA): the decoder's
        latent frames per call and its row bands by frame size, and a warmup decode of the largest admitted frame,
        so its memory is claimed at load (None: the decoder's defaults). `turn`: held around that warmup;
        `peak_warmup` False skips it (a reload, that peak proven by the part's first load)."""
        self.safety = safety
        self.plan = plan
        # stream id → (why the guardrail blocked one of its pieces, when): its later pieces are refused too, never
        # sent. Kept past `drop` (pieces launched before the request's end may still be finishing), until idle
        self.blocked: dict[str, tuple[str, float]] = {}
        t = time.perf_counter()
        self.startup: dict[str, float] = {}

        def lap(part: str) -> None:
            nonlocal t
            if cuda:  # the part's queued GPU work counts as its own
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            self.startup[part] = now - t
            t = now

        # cuDNN's heuristics, not its benchmark: on the H200 the Edge video decodes as fast either way (1.34 s), and
        # the benchmark made a server's first video 6.9 s instead of 1.5 s (H200, measured 2026-11)
        cuda = str(device).startswith("cuda")
        compile = compile and cuda  # the fused kernels save memory traffic on the GPU; on CPU, only compile time
        wrap = None if group is None else (lambda decoder: PatchDecoder(decoder, group))
        # a group's workers choose their own calls: the plan's (from rank 0's rows) would desynchronise them
        calls = (plan.decode_frames_per_call, plan.decode_band_rows) if plan and group is None else (None, None)
        self.codec = VaeCodec(ckpt.load_vae_decoder(device, dtype), compile, wrap, *calls)
        lap("vae")
        try:  # the sound tokenizer in the deployment's dtype, as the pipeline loads its components
            self.sound_tokenizer = load_sound_tokenizer(ckpt.root, device, dtype)
        except (ValueError, OSError):
            self.sound_tokenizer = None  # prefill refuses sound requests for this checkpoint
        lap("sound tokenizer")
        self.temporal = ckpt.config.vae_scale_temporal
        # stream id → (its decoder, last chunk's time); decoder None: a chunk of it failed, and its later chunks
        # fail too rather than decode as a new stream's start
        self.streams: dict[str, tuple[StreamDecoder | None, float]] = {}
        # streams whose state waits in host memory between pieces: the least recently decoded ones, beyond the
        # decoder state the plan holds on the GPU (`decode_state_bytes`: its live streams, one at the largest frame)
        self.parked: set[str] = set()
        # None: no bound (the CPU; a group's streams keep their state on its workers)
        self.gpu_state_bytes: int | None = plan.decode_state_bytes if plan is not None and group is None else None
        # the states waiting in host memory are pinned up to this many bytes (memory.pinned_host_bytes), pageable after
        self.pinned_host_bytes = memory.pinned_host_bytes()
        # the most state a stream at latent grid (h, w) has held after a piece: a new stream's, before it has any
        self.state_seen: dict[tuple[int, int], int] = {}
        # session id → the decoder its kept stream ended with, and when: its continuation's first piece goes on from it
        self.sessions: dict[str, tuple[StreamDecoder, float]] = {}
        # whether a session is still live (the server's record of it); those that are not are let go at each keep
        self.session_live: Callable[[str], bool] = lambda ident: True
        _ = self.codec.decoder  # prepared and checked at load, not on the first request
        lap("decoder")
        if compile:
            warm_decoder(self.codec, ckpt.config.latent_channel)
            lap("compile warmup")
        if (
            plan is not None and group is None and peak_warmup
        ):  # its largest calls: 1 + 4 latent frames (a first and a full call)
            s = ckpt.config.vae_scale_spatial
            with turn or contextlib.nullcontext():
                for h, w in plan.decode_warmup_sizes():
                    self.codec.decode(torch.zeros(1, ckpt.config.latent_channel, 5, h // s, w // s, device=device))
                memory.release_cached()
            lap("memory warmup")

    @classmethod
    def from_deployment(
        cls, ckpt: Checkpoint, d: Deployment, device: str, group: Group | None = None,
        turn: AbstractContextManager | None = None, peak_warmup: bool = True,
    ) -> DecodeStage:  # fmt: skip
        """`group`: a running group to decode over (the CLI's, shared with its engine); else one of the
        deployment's `parallel.vae` ranks is started when that is above 1. `turn`: held around the memory warmup;
        `peak_warmup` False skips it (a reload)."""
        t0 = time.perf_counter()
        _, plan = d.planned(ckpt)  # refuses a deployment that does not fit its card
        planned_s = time.perf_counter() - t0
        safety = Guardrail.load(d.safety_checker, device, VIDEO)  # first: a missing guardrail fails before the VAE
        if group is None and d.parallel.vae > 1:
            group = Group(d.worker_spec(ckpt.root, ("decode",)))
        cuda = str(device).startswith("cuda")
        stage = cls(ckpt, device, d.torch_dtype, d.compile, group if d.parallel.vae > 1 else None, safety,
                    plan if cuda else None, turn, peak_warmup)  # fmt: skip
        stage.plan = plan
        stage.startup = {"plan": planned_s, **stage.startup}
        return stage

    def run(self, latents: torch.Tensor, safety_check: bool = True) -> np.ndarray:
        """normalised latents [1, C, T, h, w] → uint8 [T', H, W, 3], through the video guardrail unless the
        request opted out (`safety_check` False). Raises `safety.Refused` when the guardrail blocks them."""
        return self.checked(self.codec.decode(latents).numpy(), safety_check)

    def checked(self, frames: np.ndarray, safety_check: bool = True, stream_id: str = "", first_frame: int = 0,
                last: bool = True) -> np.ndarray:  # fmt: skip
        """uint8 frames [T, H, W, 3] (`first_frame`.. of stream `stream_id`'s video) → as the guardrail returns
        them. A blocked piece raises `Refused`, and so does every later piece of its stream. Pieces are finished
        (and so checked) by one thread, the only one that touches `blocked`."""
        now = time.monotonic()
        for sid in [s for s, (_, t) in self.blocked.items() if now - t > self.STREAM_IDLE_S]:
            del self.blocked[sid]
        if stream_id in self.blocked:
            raise Refused("video", (self.blocked.pop(stream_id) if last else self.blocked[stream_id])[0])
        if self.safety is None or not safety_check:
            return frames
        try:
            return self.safety.check_frames(frames, first_frame)
        except Refused as e:
            if stream_id and not last:
                self.blocked[stream_id] = (str(e).removeprefix("video: "), now)
            raise

    def start_chunk(
        self, stream_id: str, latents: torch.Tensor, last: bool, resume: str = "", keep: str = ""
    ) -> HostFrames:
        """Launch one chunk of a stream; the result waits for its frames on the host. Chunks of one stream must
        be started in order, from one thread. `resume`: the session the stream continues (its first chunk goes on
        from the session's decoder); `keep`: on the last chunk, the session to keep the decoder for."""
        now = time.monotonic()
        for sid in [s for s, (_, t) in self.streams.items() if now - t > self.STREAM_IDLE_S]:
            del self.streams[sid]
            self.parked.discard(sid)
        if stream_id not in self.streams and resume:
            kept = self.sessions.pop(resume, None)
            if kept is None:
                raise RuntimeError(f"session {resume}: its decoder state is gone (a restart of vae_decode)")
            decoder, restore = kept[0], True
        elif stream_id not in self.streams:
            decoder, restore = StreamDecoder(self.codec), False
        elif (decoder := self.streams.pop(stream_id)[0]) is None:
            if not last:
                self.streams[stream_id] = (None, now)
            raise RuntimeError(f"an earlier chunk of stream {stream_id} failed to decode")
        else:
            restore = stream_id in self.parked
        self.parked.discard(stream_id)
        try:
            if self.gpu_state_bytes is not None:  # this stream's state joins the others' on the device: room first
                self._park_beyond(self.gpu_state_bytes - self._state_of(decoder, latents))
            if restore:
                decoder.move_state(self.codec.device)
            pending = decoder.start(latents)
            size = tuple(latents.shape[-2:])  # a first piece leaves less state than the later ones: keep the most
            self.state_seen[size] = max(self.state_seen.get(size, 0), decoder.state_bytes())
        except Exception:  # its state is gone or partial: its later chunks fail rather than start a new stream
            if not last:
                self.streams[stream_id] = (None, now)
            raise
        if not last:
            self.streams[stream_id] = (decoder, now)
        elif keep:
            for ident in [i for i in self.sessions if not self.session_live(i)]:
                del self.sessions[ident]
            self._to_host(decoder)  # after its last chunk's kernels (same stream); idle, it holds no GPU memory
            self.sessions[keep] = (decoder, now)
        return pending

    def audio(self, sound: torch.Tensor | None) -> np.ndarray:
        """Sound latents [sound_dim, T_s] → waveform float32 [channels, T_s·hop] in [-1, 1]; [0, 0] without."""
        if sound is None or not sound.numel():
            return np.zeros((0, 0), np.float32)
        if self.sound_tokenizer is None:
            raise RuntimeError("sound latents but this checkpoint has no sound tokenizer")
        return decode_sound(self.sound_tokenizer, sound).cpu().numpy()

    def launch(
        self, event: ChunkEvent, latents: torch.Tensor, sound: torch.Tensor | None = None
    ) -> Callable[[], tuple[np.ndarray, ChunkEvent, np.ndarray]]:
        """Start decoding a chunk/done event's latents → a function that waits for its frames (uint8
        [T, H, W, 3]) and returns them with the event completed (`frames`, `frame_offset`, `timings.decode_s`)
        and the waveform of `sound` (the done event's sound latents; [0, 0] without)."""
        t = time.time()
        last = event["type"] == "done"
        frames = self.start_chunk(event["id"], latents, last, event.get("continues", ""), event.get("session_id", ""))

        def finish() -> tuple[np.ndarray, ChunkEvent, np.ndarray]:
            audio = self.audio(sound)
            video = frames().numpy()
            if faults.FAIL_DECODE_SEED is not None and event.get("seed") == faults.FAIL_DECODE_SEED:
                raise faults.InjectedFault(f"injected fault in the decode (seed {event['seed']})")
            event["frame_offset"] = pixel_frames_of_chunk(
                event["latent_offset"], event["latent_frames"], self.temporal
            )[0]
            # every piece passes the guardrail before it leaves: the frames as it returns them, or `Refused`
            video = self.checked(video, not event.pop("unchecked", False), event["id"], event["frame_offset"], last)
            event["frames"] = int(video.shape[0])
            event["timings"]["decode_s"] = time.time() - t
            return video, event, audio

        return finish

    def _state_of(self, decoder: StreamDecoder, latents: torch.Tensor) -> int:
        """The bytes of `decoder`'s stream's state once this piece (latents [1, C, T, h, w]) has decoded: what it
        holds, or a new stream's at its size (as seen, or as the plan counts it)."""
        h, w = latents.shape[-2:]
        seen = self.state_seen.get((h, w)) or (self.plan.decoder_state_bytes(h, w) if self.plan is not None else 0)
        return max(decoder.state_bytes(), seen)  # a stream's first piece may leave less than its later ones

    def _park_beyond(self, room: int) -> None:
        """Move the causal state of the least recently decoded live streams to host memory (a copy that waits for
        their pieces' kernels) until the state left on the device is at most `room` bytes; each comes back at its
        next piece. Bytes, not streams: two live streams at the largest frame hold more than one there and one at the
        default size, as the plan counts them."""
        on_gpu = sorted(
            (t, sid) for sid, (dec, t) in self.streams.items() if dec is not None and sid not in self.parked
        )
        held = sum(self.streams[sid][0].state_bytes() for _, sid in on_gpu)  # type: ignore[union-attr]
        for _, sid in on_gpu:
            if held <= room:
                break
            decoder = self.streams[sid][0]
            held -= decoder.state_bytes()  # type: ignore[union-attr]
            self._to_host(decoder)  # type: ignore[arg-type]
            self.parked.add(sid)

    def _to_host(self, decoder: StreamDecoder) -> None:
        """Move a stream's state to host memory: pinned while the states already waiting there (kept sessions, parked
        streams) and this one stay within `pinned_host_bytes`, else pageable."""
        waiting = [d for d, _ in self.sessions.values()]
        waiting += [d for sid in self.parked if (d := self.streams.get(sid, (None, 0.0))[0]) is not None]
        held = sum(d.state_bytes() for d in waiting)
        decoder.move_state("cpu", pinned=held + decoder.state_bytes() <= self.pinned_host_bytes)

    def drop(self, stream_id: str) -> None:
        self.parked.discard(stream_id)
        self.streams.pop(stream_id, None)
