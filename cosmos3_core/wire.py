"""What crosses between the stages and to the client, typed, with the one encode/decode of each.

- `PrefillResult`: prefill → denoise. Tensors for Triton (`to_wire` / `from_wire`): text_kv
  [2, layers, sum(branch tokens), kv_heads, head_dim] (model dtype), text_lens INT64 [branches], cond_latent FP32
  [1, C, 1, h, w] (i2v), [1, C, T_lat, h, w] (v2v and action: `params.clean_frames` encoded, the rest zero) or
  [0,0,0,0,0]; cond_actions FP32 [chunk, action_dim] (forward dynamics: the given actions, padded) or [0, 0]; with it
  `RequestMeta` as JSON (BYTES [1] `request`). A session's continuation with its session's prompt sends no text K/V
  (text_lens [0], text_kv a [2, 1, 1, 1, 1] placeholder): the engine reuses the session's.
- Events, JSON (BYTES [1] `event`), denoise → decode → client: `ProgressEvent` after each step; `ChunkEvent`
  (type "chunk") per streamed piece of latents; the last piece's type is "done" and carries the resolved
  parameters. The engine fills a chunk's place in the video and its timings; decode adds `frames`,
  `frame_offset` and its timings, and drops the server-internal `t0` before the client sees it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np

from .requests import GenerationParams

if TYPE_CHECKING:  # the client reads events through this module without importing torch
    import torch

EVENT_TYPES = ("progress", "chunk", "done", "error", "accepted", "poll", "end")


class ProgressEvent(TypedDict):
    type: Literal["progress"]
    id: str
    step: int  # 1-based, within the window
    steps: int
    window: int
    windows: int


class _CacheReport(TypedDict, total=False):
    # done only, with a cache policy: per branch (cond, uncond) the 0-based steps that reused a residual; with AR
    # windows (`window_mode` not none) a list of those, one per window in order, steps counted within the window
    cache_skipped: dict[str, list[int]] | list[dict[str, list[int]]]
    session_id: str  # done only, of a stream that kept its session (sessions.py): the id a continuation names


class ChunkInfo(_CacheReport):
    """Where a piece of latents lands in the video, and the engine's timings (seconds)."""

    window: int
    windows: int
    latent_offset: int
    latent_frames: int
    # queue_s, window_s; denoise_s on the last piece. The done event's add up to server_e2e_s (docs/metrics.md):
    # prefill_s (RequestMeta), to_denoise_s (the denoise model), to_decode_s and decode_s (decode)
    timings: dict[str, float]


class ChunkEvent(ChunkInfo, total=False):
    type: Literal["chunk", "done"]
    id: str
    t0: float  # request arrival (epoch s), server-internal: decode measures TTFC and e2e from it
    frames: int  # decode: pixel frames in this response's video
    frame_offset: int  # decode: the first one's index in the whole video
    fps: float  # the video's frame rate (every piece: a client writes each as it arrives)
    seed: int  # done only
    params: dict[str, Any]  # done only: GenerationParams.resolved()
    unchecked: bool  # server-internal, true only: the request opted out of the video guardrail (decode drops it)
    continues: str  # a session's continuation: the session whose decoder state its first piece goes on from


class ErrorEvent(TypedDict):
    """The engine's end of a failed or cancelled request, sent as data in its FINAL response; the decode step
    after it, the request's last, turns it into the Triton error the client sees (triton/lifecycle.py: why not
    an error from the engine's step)."""

    type: Literal["error"]
    id: str
    message: str


class AcceptedEvent(TypedDict):
    """Server-internal, never sent to a client: the denoise model took the request. vae_decode answers nothing for it
    but holds its step (triton/lifecycle.py), so that a process besides denoise holds every request denoise holds
    and can answer for it should denoise die."""

    type: Literal["accepted"]
    id: str
    t0: float  # the request's arrival (epoch s): a denoise death after it was this stream's denoise's (lifecycle.gone)


class StreamEvent(TypedDict):
    """Server-internal, never sent to a client: denoise's `poll` (a step that carries a client's cancel to vae_decode
    while its pieces decode) and `end` (its FINAL, once vae_decode is done with the frames): triton/lifecycle.py."""

    type: Literal["poll", "end"]
    id: str


Event = ProgressEvent | ChunkEvent | ErrorEvent | AcceptedEvent | StreamEvent


def encode_event(event: Event) -> str:
    return json.dumps(event)


def decode_event(text: str | bytes) -> Event:
    event = json.loads(text)
    if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES:
        raise ValueError(f"not an event: {str(text)[:200]!r}")
    return event  # type: ignore[return-value]


@dataclass(frozen=True)
class RequestMeta:
    """What prefill learned about a request, for the stages after it."""

    id: str  # the request's stream id (cancel marks, the decoder cache)
    params: GenerationParams
    t0: float  # arrival, epoch s
    prefill_s: float

    def encode(self) -> str:
        return json.dumps({**asdict(self), "params": asdict(self.params)})

    @classmethod
    def decode(cls, text: str | bytes) -> RequestMeta:
        raw = json.loads(text)
        return cls(raw["id"], GenerationParams(**raw["params"]), raw["t0"], raw["prefill_s"])

    def progress(self, step: int, steps: int, window: int, windows: int) -> ProgressEvent:
        return {"type": "progress", "id": self.id, "step": step, "steps": steps, "window": window, "windows": windows}

    def chunk(self, info: ChunkInfo, final: bool) -> ChunkEvent:
        event: ChunkEvent = {"type": "done" if final else "chunk", "id": self.id, "t0": self.t0, **info}  # type: ignore[typeddict-item]
        event["fps"] = self.params.fps
        if not self.params.enable_safety_check:
            event["unchecked"] = True
        if self.params.session_continue:
            event["continues"] = self.params.session_continue
        if final:
            event["timings"] = {"prefill_s": self.prefill_s, **info["timings"]}
            event["params"] = self.params.resolved()
            event["seed"] = self.params.seed
        return event


def max_text_kv_bytes(layers: int, kv_heads: int, head_dim: int, itemsize: int, max_prompt_tokens: int) -> int:
    """The largest `text_kv` a request can send: both CFG branches at the prompt limit."""
    return 2 * layers * 2 * max_prompt_tokens * kv_heads * head_dim * itemsize


@dataclass
class PrefillResult:
    params: GenerationParams
    text_k: list[torch.Tensor]  # per branch (cond[, uncond]) [layers, tokens, kv_heads, head_dim]
    text_v: list[torch.Tensor]
    cond_latent: torch.Tensor | None  # [1, C, 1, h, w] fp32 (i2v), [1, C, T_lat, h, w] (v2v, action) or None
    cond_actions: torch.Tensor | None = None  # forward dynamics: [chunk, action_dim] fp32, the clean action tokens

    def to_wire(self, kv_dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor | np.ndarray]:
        """`kv_dtype`, `device`: the deployment's (`text_kv`'s type in the model config, also with no K/V)."""
        import torch

        if self.text_k:
            kv = torch.stack([torch.cat(self.text_k, dim=1), torch.cat(self.text_v, dim=1)])
        else:  # a continuation that reuses its session's text K/V (no branches: text_lens [0]). One element, not
            # none: an empty 16-bit tensor cannot leave a Python stub (numpy has no bfloat16, and the backend
            # refuses an empty tensor's DLPack strides)
            kv = torch.zeros(2, 1, 1, 1, 1, dtype=kv_dtype, device=device)
        lens = np.array([k.shape[1] for k in self.text_k], dtype=np.int64)
        cond = self.cond_latent if self.cond_latent is not None else torch.zeros(0, 0, 0, 0, 0)
        actions = self.cond_actions if self.cond_actions is not None else torch.zeros(0, 0)
        return {"text_kv": kv, "text_lens": lens, "cond_latent": cond.float(), "cond_actions": actions.float()}

    @classmethod
    def from_wire(
        cls,
        params: GenerationParams,
        text_kv: torch.Tensor,
        text_lens: np.ndarray,
        cond_latent: torch.Tensor,
        cond_actions: torch.Tensor,
    ) -> PrefillResult:
        splits = [int(n) for n in text_lens]
        return cls(
            params=params,
            text_k=list(text_kv[0].split(splits, dim=1)) if splits else [],
            text_v=list(text_kv[1].split(splits, dim=1)) if splits else [],
            cond_latent=cond_latent if cond_latent.numel() else None,
            cond_actions=cond_actions if cond_actions.numel() else None,
        )
