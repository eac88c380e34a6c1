"""The request schema: parse and validate once, used by the offline CLI, the Triton models and the client.

Every failure is a `RequestError(field, message)` whose text names the field and the allowed range; it is
raised before any page or tensor is allocated.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from .model.embodiments import FORWARD, INVERSE, MODES, POLICY, RAW_ACTION_DIMS, RESOLUTION_BINS, ActionGeometry
from .model.prompts import VIEW_POINTS


class RequestError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    max_prompt_bytes: int = 8192
    max_prompt_tokens: int = 1024
    max_height: int = 1280
    max_width: int = 1280
    max_frames: int = 189
    max_steps: int = 100
    max_guidance: float = 30.0
    max_image_pixels: int = 4096 * 4096
    max_pixel_frames: int = 1280 * 720 * 189  # frames × height × width budget per request (per window for AR)
    # height × width of one frame (0: max_height × max_width): what the VAE's calls and a decoder stream's state scale
    # with (memory.py)
    max_frame_pixels: int = 0
    max_windows: int = 64
    max_video_frames: int = 1024  # frames of a v2v or action conditioning clip (each at most max_image_pixels)
    max_chunk_size: int = 64  # actions per action request (its video: chunk_size + 1 frames)
    max_raw_actions: int = 1024  # rows of a forward-dynamics `raw_actions` (longer ones would be truncated anyway)


@dataclass(frozen=True)
class TaskDefaults:
    """Built-in values are `Cosmos3OmniPipeline.__call__`'s own (one set for every task); a deployment config may
    set its own per task."""

    steps: int = 35
    guidance_scale: float = 6.0
    shift: float | None = None  # None: the checkpoint scheduler's flow_shift, as the pipeline samples


CACHE_POLICIES = ("sea",)
MAX_CACHE_STEPS = 1_000_000  # step-count fields: any value past a request's steps means "all of them"


@dataclass(frozen=True)
class SeaCacheParams:
    """`parameters.cache` with policy "sea": diffusers' `SeaCacheConfig` (0.42.1, `hooks/sea_cache.py`) — the same
    fields, defaults and checks — without its `raw_vision_callback` (a Python hook; Cosmos3's built-in adapter is
    what cosmos3_core/cache.py implements). What each field does: cache.py."""

    policy: str = "sea"
    threshold: float = 0.25  # accumulated relative-L1 budget of the indicator; larger reuses more often
    residual_order: int = 1  # 0: reuse the last residual; 1: extrapolate from the last two full executions
    retention_steps: int = 1  # the first steps always run in full
    cache_end_steps: int = 1  # the last steps always run in full
    max_consecutive_cached: int = 2  # reuses in a row before a forced full step; 0: no limit
    power_exp: float = 3.0  # exponent of the SEA filter's clean-signal power prior


def parse_cache(value: Any) -> SeaCacheParams | None:
    """`parameters.cache` (a JSON object, or null: off) → its policy's parameters. Errors name the field
    (`cache.threshold: ...`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("cache", f'must be a JSON object such as {{"policy": "sea"}}, or null; got {value!r:.64}')
    policy = value.get("policy")
    if policy not in CACHE_POLICIES:
        raise RequestError("cache.policy", f"must be one of {', '.join(CACHE_POLICIES)}, got {policy!r:.64}")
    known = [f.name for f in fields(SeaCacheParams)]
    unknown = sorted(set(value) - set(known), key=str)
    if unknown:
        key = unknown[0]
        name = f"cache.{key}" if key.isidentifier() else "cache"
        raise RequestError(name, f"unknown field {key[:64]!r}; known: {', '.join(known)}")
    d = SeaCacheParams()
    threshold = _number(value, "threshold", d.threshold)
    if threshold < 0:
        raise RequestError("cache.threshold", f"must be a finite number >= 0, got {threshold}")
    power_exp = _number(value, "power_exp", d.power_exp)
    if power_exp <= 0:
        raise RequestError("cache.power_exp", f"must be a finite number > 0, got {power_exp}")
    order = value.get("residual_order", d.residual_order)
    if isinstance(order, bool) or not isinstance(order, int) or order not in (0, 1):
        raise RequestError("cache.residual_order", f"must be 0 or 1, got {order!r:.64}")
    counts = {
        k: _int(value, k, getattr(d, k), 0, MAX_CACHE_STEPS, f"cache.{k}")
        for k in ("retention_steps", "cache_end_steps", "max_consecutive_cached")
    }
    return SeaCacheParams(policy, threshold, order, power_exp=power_exp, **counts)


MAX_LORA_SCALE = 100.0  # |scale| of `parameters.lora`


@dataclass(frozen=True)
class LoraChoice:
    """`parameters.lora`: an adapter of the deployment's `lora_dir` by name, and its scale (diffusers'
    `set_adapters(name, weights=scale)`). Whether the name is one: lora_store.py."""

    name: str
    scale: float = 1.0


def parse_lora(value: Any) -> LoraChoice | None:
    """`parameters.lora` (a JSON object, or null: the base model) → the choice. Errors name the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("lora", f'must be a JSON object such as {{"name": "my_adapter", "scale": 1.0}}, or null; '
                           f"got {value!r:.64}")  # fmt: skip
    unknown = sorted(set(value) - {"name", "scale"}, key=str)
    if unknown:
        key = unknown[0]
        name = f"lora.{key}" if key.isidentifier() else "lora"
        raise RequestError(name, f"unknown field {key[:64]!r}; known: name, scale")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("lora.name", f"must be the name of an adapter (a string), got {name!r:.64}")
    scale = value.get("scale", 1.0)
    number = not isinstance(scale, bool) and isinstance(scale, (int, float)) and _finite(scale)
    if not number or abs(scale) > MAX_LORA_SCALE:
        raise RequestError("lora.scale", f"must be a finite number in [-100, 100], got {scale!r:.64}")
    return LoraChoice(name, float(scale))


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    # an int past float range (1e400 as JSON digits) is finite but has no float: reject it with the others
    if isinstance(value, bool) or not isinstance(value, (int, float)) or abs(value) > 1e300 or not math.isfinite(value):
        raise RequestError(f"cache.{key}", f"must be a finite number, got {value!r:.64}")
    return float(value)


@dataclass(frozen=True)
class Defaults:
    """A request's unset parameters. Built-in values are the reference pipeline's defaults, so a request with no
    parameters means the same thing here as `pipe(prompt)` does."""

    height: int = 720
    width: int = 1280
    num_frames: int = 189
    fps: float = 24.0
    t2i: TaskDefaults = field(default_factory=TaskDefaults)
    t2v: TaskDefaults = field(default_factory=TaskDefaults)
    i2v: TaskDefaults = field(default_factory=TaskDefaults)
    window_frames: int = 29  # AR window, pixel frames (8 latent)
    overlap_frames: int = 8  # chained overlap, pixel frames (2 latent; the minimum)
    context_frames: int = 61  # kv context horizon, pixel frames (16 latent); 0 keeps everything
    cache: SeaCacheParams | None = None  # step caching of every request (AR windows too); None: off (the pipeline's)
    resolution_tier: int = 480  # an action request's, when it names none (the pipeline's default)

    def __post_init__(self) -> None:  # a config's `cache:` mapping, checked like a request's
        if not isinstance(self.cache, (SeaCacheParams, type(None))):
            object.__setattr__(self, "cache", parse_cache(self.cache))
        if isinstance(self.resolution_tier, bool) or self.resolution_tier not in RESOLUTION_BINS:
            tiers = ", ".join(map(str, RESOLUTION_BINS))
            raise ValueError(f"defaults.resolution_tier: must be one of {tiers}, got {self.resolution_tier!r:.64}")


@dataclass(frozen=True)
class GenerationParams:
    prompt: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int
    fps: float
    steps: int
    guidance_scale: float
    shift: float  # resolved: the request's, the deployment's, or the checkpoint scheduler's flow_shift
    seed: int
    use_system_prompt: bool | None
    add_templates: bool
    has_image: bool
    window_mode: str = "none"  # none | chained | kv
    window_frames: int = 0
    overlap_frames: int = 0
    context_frames: int = 0
    has_video: bool = False  # v2v: a conditioning clip came with the request
    # v2v: latent frames kept clean (as given; () without video); action: policy / forward dynamics (0,), inverse all
    condition_frame_indexes: tuple[int, ...] = ()
    condition_video_keep: str = "first"  # v2v: which end of a longer clip is kept
    enable_sound: bool = False
    cache: SeaCacheParams | None = None  # step caching (cache.py); None: every step runs in full
    lora: LoraChoice | None = None  # the request's adapter (lora_store.py); None: the base model
    # robot actions (`parameters.action`); action_mode "" without. Then height × width is the tier's canvas (what the
    # prompt states and what is encoded), num_frames = chunk_size + 1, and the video is video_height × video_width:
    # the content's latent grid in pixels (model/embodiments.ActionGeometry)
    action_mode: str = ""  # policy | forward_dynamics | inverse_dynamics
    chunk_size: int = 0
    domain: str = ""
    resolution_tier: int = 0
    view_point: str | None = None
    video_height: int = 0
    video_width: int = 0
    # the deployment's guardrail on this request's prompt and frames (safety.py); false only where the deployment
    # has safety_checker_optional (checked by `PrefillStage.validate`), as the pipeline's `enable_safety_check`
    enable_safety_check: bool = True
    # AR sessions (`parameters.session`, sessions.py): keep the stream's state after its last window; continue the
    # session of that id (num_frames then counts the new frames: a multiple of the VAE's temporal factor)
    session_keep: bool = False
    session_continue: str = ""
    # prefill's digest of the request's text tokens (every CFG branch): a continuation whose digest is its session's
    # reuses the session's text K/V
    text_digest: str = ""

    def __post_init__(self) -> None:  # JSON gives a list and a mapping back: keep the field types
        object.__setattr__(self, "condition_frame_indexes", tuple(self.condition_frame_indexes))
        if isinstance(self.cache, dict):
            object.__setattr__(self, "cache", SeaCacheParams(**self.cache))
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoraChoice(**self.lora))

    @property
    def task(self) -> str:
        if self.action_mode:
            return "action"
        if self.num_frames == 1:
            return "t2i"
        return "i2v" if self.has_image else ("v2v" if self.has_video else "t2v")

    @property
    def clean_frames(self) -> tuple[int, ...]:
        """Latent frames of the first window kept clean: i2v's frame 0, v2v's listed frames, an action request's
        (frame 0; inverse dynamics: all), else none."""
        if self.has_video or self.action_mode:
            return tuple(sorted(set(self.condition_frame_indexes)))
        return (0,) if self.has_image else ()

    @property
    def frame_size(self) -> tuple[int, int]:
        """(height, width) of the generated frames: the request's, or an action request's content crop."""
        return (self.video_height, self.video_width) if self.action_mode else (self.height, self.width)

    @property
    def raw_action_dim(self) -> int:
        """The domain's raw action width (0 without actions): actions beyond it are zero."""
        return RAW_ACTION_DIMS[self.domain] if self.action_mode else 0

    @property
    def returns_actions(self) -> bool:
        """Policy and inverse dynamics generate actions; forward dynamics is given them."""
        return self.action_mode in (POLICY, INVERSE)

    @property
    def cfg_branches(self) -> int:
        return 1 if self.guidance_scale == 1.0 else 2

    def resolved(self) -> dict[str, Any]:
        """Every parameter as sampled (defaults filled in), echoed with `done` so any result can be reproduced by
        sending them back (an action request's as `action`, without the sizes its chunk and tier set)."""
        hidden = {"prompt", "negative_prompt", "has_image", "has_video", *ACTION_FIELDS, "video_height", "video_width"}
        if not self.has_video or self.action_mode:  # v2v's own parameters only apply with a clip
            hidden |= {"condition_frame_indexes", "condition_video_keep"}
        if self.action_mode:
            hidden |= set(NOT_WITH_ACTION)
        # a window field the mode does not read is refused when sent (`_validate_windows`): not echoed either
        hidden |= {"none": {"window_frames", "overlap_frames", "context_frames"}, "chained": {"context_frames"},
                   "kv": {"overlap_frames"}}[self.window_mode]  # fmt: skip
        hidden |= {"session_keep", "session_continue", "text_digest"}
        out = {k: v for k, v in asdict(self).items() if k not in hidden}
        if self.session_keep or self.session_continue:
            out["session"] = {
                "keep": self.session_keep,
                **({"continue": self.session_continue} if self.session_continue else {}),
            }
        if self.action_mode:
            out["action"] = dict(zip(ACTION_KEYS, (getattr(self, f) for f in ACTION_FIELDS), strict=True))
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GenerationParams:
        return cls(**json.loads(text))


PARAMETER_KEYS = (
    "negative_prompt", "height", "width", "num_frames", "fps", "steps", "guidance_scale", "shift", "seed",
    "use_system_prompt", "add_templates", "window_mode", "window_frames", "overlap_frames", "context_frames",
    "max_windows", "condition_frame_indexes", "condition_video_keep", "enable_sound", "action", "cache", "lora",
    "enable_safety_check", "session",
)  # fmt: skip
ACTION_KEYS = ("mode", "chunk_size", "domain", "resolution_tier", "view_point")  # parameters.action
ACTION_FIELDS = ("action_mode", "chunk_size", "domain", "resolution_tier", "view_point")  # as GenerationParams has them
# parameters an action request may not set: the chunk size sets the frames, the tier the size, the pipeline the prompt
NOT_WITH_ACTION = (
    "num_frames", "height", "width", "add_templates", "window_mode", "window_frames", "overlap_frames",
    "context_frames", "max_windows", "condition_frame_indexes", "condition_video_keep", "session",
)  # fmt: skip
WINDOW_MODES = ("none", "chained", "kv")
MIN_CHAINED_OVERLAP_LATENT = 2


def _int(params: dict[str, Any], key: str, default: int, lo: int, hi: int, name: str = "") -> int:
    """`name`: the field the error names (default `key`)."""
    value = params.get(key, default)
    name = name or key
    # int() of inf / NaN (JSON Infinity, NaN, 1e400) raises: reject non-finite floats first
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or value != int(value):
        raise RequestError(name, f"must be an integer in [{lo}, {hi}], got {value!r}")
    value = int(value)
    if not lo <= value <= hi:
        raise RequestError(name, f"must be in [{lo}, {hi}], got {value}")
    return value


def _float(params: dict[str, Any], key: str, default: float | None, lo: float, hi: float) -> float | None:
    value = params.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise RequestError(key, f"must be a finite number in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(key, f"must be in [{lo}, {hi}], got {value}")
    return float(value)


def _finite(value: int | float) -> bool:
    """math.isfinite converts to float, which overflows on an int beyond 1e308: ints are finite, so no cast."""
    return isinstance(value, int) or math.isfinite(value)


def _bool(params: dict[str, Any], key: str, default: bool | None) -> bool | None:
    value = params.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise RequestError(key, f"must be true or false, got {value!r}")
    return value


def decode_text(raw: bytes | str, field_name: str, limits: Limits) -> str:
    if isinstance(raw, str):  # a JSON string may hold lone surrogates ("\ud800"): the decode below rejects them
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > limits.max_prompt_bytes:
        raise RequestError(field_name, f"is {len(raw)} bytes, limit {limits.max_prompt_bytes}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(field_name, f"is not valid UTF-8 ({e.reason} at byte {e.start})") from e


def parse_parameters_json(raw: bytes | str | None) -> dict[str, Any]:
    if raw is None or raw in (b"", ""):
        return {}
    try:
        params = json.loads(raw)
    # ValueError: also an int of more digits than Python converts (4300); RecursionError: deep nesting
    except (ValueError, RecursionError) as e:
        raise RequestError("parameters", f"is not valid JSON ({e})") from e
    if not isinstance(params, dict):
        raise RequestError("parameters", f"must be a JSON object, got {type(params).__name__}")
    return params


def warmup_inputs(params: dict[str, Any], defaults: Defaults) -> tuple[np.ndarray | None, ...]:
    """(image, condition_video, raw_actions) a deployment's warmup request runs with: none, or for an `action`
    request a blank image at the deployment's default height × width (inverse dynamics: a blank clip of chunk + 1
    frames), and for forward dynamics zero actions of the domain's width: the shapes of a served action request
    conditioned at that size. A malformed `action` gets nothing, and `validate` names the field."""
    spec = params.get("action")
    if not isinstance(spec, dict):
        return None, None, None
    mode, chunk, domain = spec.get("mode"), spec.get("chunk_size"), spec.get("domain")
    frame = np.zeros((defaults.height, defaults.width, 3), np.uint8)
    if mode == INVERSE:
        frames = chunk + 1 if isinstance(chunk, int) and chunk > 0 else 1
        return None, np.broadcast_to(frame, (frames, *frame.shape)).copy(), None
    raw = None
    if mode == FORWARD and isinstance(chunk, int) and chunk > 0 and domain in RAW_ACTION_DIMS:
        raw = np.zeros((chunk, RAW_ACTION_DIMS[domain]), np.float32)
    return frame, None, raw


def validate(
    prompt: bytes | str,
    params: dict[str, Any],
    image: np.ndarray | None,
    defaults: Defaults,
    limits: Limits,
    alignment: int,
    temporal_factor: int,
    checkpoint_shift: float,
    video: np.ndarray | None = None,
    raw_actions: np.ndarray | None = None,
    kept: GenerationParams | None = None,
) -> GenerationParams:
    """Check a request against the limits; fill defaults. `alignment`: H, W multiple; frames ≡ 1 mod temporal;
    `checkpoint_shift`: the scheduler config's flow_shift, the shift when neither request nor deployment sets one.
    An action request (`parameters.action`) takes its conditioning from `image` or `video` and, for forward
    dynamics, `raw_actions` FP32 [T, D]; what the checkpoint must hold for it is checked by `PrefillStage.validate`.
    A continuation (`parameters.session.continue`) takes its session's sizes and windows from `kept`, the kept
    request's parameters (None: the session is not there, an error naming `session`)."""
    unknown = sorted(set(params) - set(PARAMETER_KEYS))
    if unknown:
        key = unknown[0]  # a key that is no name ("", "a: b") could not lead the error text: name `parameters`
        field_name, what = (
            (key, "unknown parameter") if key.isidentifier() else ("parameters", f"unknown key {key[:64]!r}")
        )
        raise RequestError(field_name, f"{what}; known: {', '.join(PARAMETER_KEYS)}")
    keep_session, ident = parse_session(params.get("session"))
    if ident:
        params, new_frames = _continuation(params, ident, kept, limits, temporal_factor)
        p = validate(prompt, params, image, defaults, limits, alignment, temporal_factor, checkpoint_shift, video,
                     raw_actions)  # fmt: skip
        return replace(p, num_frames=new_frames, session_keep=keep_session, session_continue=ident)
    if keep_session and params.get("window_mode", "none") not in ("chained", "kv"):
        raise RequestError("session", "keep: a session is an AR stream's; needs window_mode chained or kv")
    text = decode_text(prompt, "prompt", limits)
    if not text.strip():
        raise RequestError("prompt", "must not be empty")
    negative = params.get("negative_prompt", "")
    if not isinstance(negative, str):
        raise RequestError("negative_prompt", f"must be a string, got {type(negative).__name__}")
    decode_text(negative, "negative_prompt", limits)

    action = _validate_action(params, image, video, raw_actions, limits, alignment, defaults.resolution_tier)
    if action is not None:  # the tier's canvas, chunk + 1 frames, one window
        height, width = action["geometry"].canvas
        num_frames, mode, window, keep = action["chunk_size"] + 1, "none", (0, 0, 0), "first"
        # the pipeline's vision_condition_frames (P:846-855)
        indexes = tuple(range((num_frames - 1) // temporal_factor + 1)) if action["action_mode"] == INVERSE else (0,)
    else:
        height, width, num_frames, mode, window = _validate_size(params, defaults, limits, alignment, temporal_factor)
        if image is not None:
            if num_frames == 1:
                raise RequestError("image", "an image conditions video only (i2v); num_frames must be > 1")
            check_image(image, limits, height, width)
        indexes, keep = _validate_video(video, image, params, num_frames, mode, limits, temporal_factor)
    # v2v and action take i2v's defaults (a conditioned video)
    task = "t2i" if num_frames == 1 else ("i2v" if image is not None or video is not None else "t2v")
    sound = bool(_bool(params, "enable_sound", False))
    if sound and mode != "none":
        raise RequestError("window_mode", f"sound is not supported with AR windows (window_mode {mode!r})")
    if sound and num_frames == 1:
        raise RequestError("enable_sound", "sound comes with a video (t2v, i2v, v2v); num_frames must be > 1")
    # AR windows too: each window is its own trajectory with its own decisions (cache.py)
    cache = parse_cache(params["cache"]) if "cache" in params else defaults.cache
    td: TaskDefaults = getattr(defaults, task)  # v2v takes i2v's defaults (a conditioned video)
    seed = params.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise RequestError("seed", f"must be an integer in [0, 2^63), got {seed!r}")
    return GenerationParams(
        prompt=text,
        negative_prompt=negative,
        height=height,
        width=width,
        num_frames=num_frames,
        fps=_float(params, "fps", defaults.fps, 1.0, 120.0),  # type: ignore[arg-type]
        steps=_int(params, "steps", td.steps, 1, limits.max_steps),
        guidance_scale=_float(params, "guidance_scale", td.guidance_scale, 0.0, limits.max_guidance),  # type: ignore[arg-type]
        shift=_float(params, "shift", td.shift if td.shift is not None else checkpoint_shift, 0.01, 100.0),  # type: ignore[arg-type]
        seed=seed,
        use_system_prompt=_bool(params, "use_system_prompt", None),
        add_templates=bool(_bool(params, "add_templates", True)),
        has_image=image is not None,
        window_mode=mode,
        window_frames=window[0],
        overlap_frames=window[1],
        context_frames=window[2],
        has_video=video is not None,
        condition_frame_indexes=indexes,
        condition_video_keep=keep,
        enable_sound=sound,
        cache=cache,
        lora=parse_lora(params.get("lora")),
        **_action_fields(action, alignment),
        enable_safety_check=bool(_bool(params, "enable_safety_check", True)),
        session_keep=keep_session,
    )


# what a continuation takes from its session: a request may repeat them, not change them
SESSION_FIXED = ("height", "width", "fps", "seed", "shift", "window_mode", "window_frames", "overlap_frames",
                 "context_frames")  # fmt: skip


def parse_session(value: Any) -> tuple[bool, str]:
    """`parameters.session` → (keep, the id to continue or ""). Errors name `session`."""
    if value is None:
        return False, ""
    if not isinstance(value, dict):
        raise RequestError("session", f'must be a JSON object such as {{"keep": true}} or {{"continue": "<id>"}}, got '
                           f"{value!r:.64}")  # fmt: skip
    unknown = sorted(set(value) - {"keep", "continue"}, key=str)
    if unknown:
        raise RequestError("session", f"unknown field {str(unknown[0])[:64]!r}; known: keep, continue")
    keep, ident = value.get("keep", False), value.get("continue", "")
    if not isinstance(keep, bool):
        raise RequestError("session", f"keep: must be true or false, got {keep!r:.64}")
    if not isinstance(ident, str) or (ident and not re.fullmatch(r"[0-9a-f]{32}", ident)):
        raise RequestError("session", f"continue: a session id (32 hex digits, a done event's session_id), got "
                           f"{ident!r:.64}")  # fmt: skip
    return keep, ident


def continued_session(params: dict[str, Any]) -> str:
    """The id of the session a request's parameters continue ("" for none, or a malformed `session` that `validate`
    then names): callers look the session up before validating."""
    try:
        return parse_session(params.get("session"))[1]
    except RequestError:
        return ""


def _continuation(
    params: dict[str, Any], ident: str, kept: GenerationParams | None, limits: Limits, temporal: int
) -> tuple[dict[str, Any], int]:
    """A continuation's parameters as `validate` checks them (its session's sizes and windows filled in; num_frames
    as a stream of its new latent frames plus one would have) → (those, the new pixel frames)."""
    if kept is None:
        raise RequestError("session", f"{ident} is unknown, has expired or was evicted")
    for key in SESSION_FIXED:
        if key in params and params[key] != getattr(kept, key):
            raise RequestError(key, f"a continuation keeps its session's {key} ({getattr(kept, key)!r}); got "
                               f"{params[key]!r:.64}")  # fmt: skip
    for key in ("enable_sound", "action", "condition_frame_indexes", "condition_video_keep"):
        if key in params:
            raise RequestError(key, "does not apply to a session's continuation (an AR stream)")
    window_lat = latent_frames(kept.window_frames, temporal)
    step = window_lat - kept.overlap_frames // temporal if kept.window_mode == "chained" else window_lat
    frames = params.get("num_frames", temporal * step)  # default: one window's new frames
    if isinstance(frames, bool) or not isinstance(frames, int) or not temporal <= frames < limits.max_frames:
        raise RequestError("num_frames", f"a continuation's new frames: an integer in [{temporal}, "
                           f"{limits.max_frames - 1}], got {frames!r:.64}")  # fmt: skip
    if frames % temporal:
        raise RequestError("num_frames", f"a continuation's new frames: a multiple of {temporal} (whole latent "
                           f"frames), got {frames}")  # fmt: skip
    merged = {k: v for k, v in params.items() if k != "session"}
    merged.update({k: getattr(kept, k) for k in ("height", "width", "fps", "seed", "shift", "window_mode",
                                                 "window_frames")})  # fmt: skip
    if kept.window_mode == "chained":
        merged["overlap_frames"] = kept.overlap_frames
    else:
        merged["context_frames"] = kept.context_frames
    # what may change and is not sent stays the session's
    for key in (
        "negative_prompt",
        "steps",
        "guidance_scale",
        "use_system_prompt",
        "add_templates",
        "enable_safety_check",
    ):
        merged.setdefault(key, getattr(kept, key))
    for key in ("cache", "lora"):
        merged.setdefault(key, None if getattr(kept, key) is None else asdict(getattr(kept, key)))
    merged["num_frames"] = frames + 1
    return merged, frames


def latent_frames(pixel_frames: int, temporal: int) -> int:
    return 1 + (pixel_frames - 1) // temporal


def _validate_size(
    params: dict[str, Any], defaults: Defaults, limits: Limits, alignment: int, temporal: int
) -> tuple[int, int, int, str, tuple[int, int, int]]:
    """→ (height, width, num_frames, window_mode, (window, overlap, context) frames) of a request without actions."""
    height = _int(params, "height", defaults.height, alignment, limits.max_height)
    width = _int(params, "width", defaults.width, alignment, limits.max_width)
    for key, value in (("height", height), ("width", width)):
        if value % alignment:
            raise RequestError(key, f"must be a multiple of {alignment}, got {value}")
    if limits.max_frame_pixels and height * width > limits.max_frame_pixels:
        raise RequestError(
            "height", f"height×width = {height}x{width} exceeds max_frame_pixels {limits.max_frame_pixels}"
        )
    mode = params.get("window_mode", "none")
    if mode not in WINDOW_MODES:
        raise RequestError("window_mode", f"must be one of {', '.join(WINDOW_MODES)}, got {mode!r}")
    max_total = limits.max_frames if mode == "none" else 1 + (limits.max_frames - 1) * limits.max_windows
    num_frames = _int(params, "num_frames", defaults.num_frames, 1, max_total)
    if (num_frames - 1) % temporal:
        raise RequestError("num_frames", f"must be 1 mod {temporal} (1, {1 + temporal}, ...), got {num_frames}")
    window = _validate_windows(mode, params, num_frames, defaults, limits, temporal)
    budget_frames = num_frames if mode == "none" else window[0]
    if budget_frames * height * width > limits.max_pixel_frames:
        key = "num_frames" if mode == "none" else "window_frames"
        raise RequestError(
            key, f"frames×height×width = {budget_frames * height * width} exceeds the budget {limits.max_pixel_frames}"
        )
    return height, width, num_frames, mode, window


def _validate_action(
    params: dict[str, Any],
    image: np.ndarray | None,
    video: np.ndarray | None,
    raw_actions: np.ndarray | None,
    limits: Limits,
    alignment: int,
    default_tier: int,
) -> dict[str, Any] | None:
    """`parameters.action` with its conditioning and raw actions (the pipeline's checks, P:301-396 and 1039-1058,
    plus ours) → its fields and geometry; None without `action`. `default_tier`: the tier of a request naming none."""
    if "action" not in params:
        if raw_actions is not None:
            raise RequestError("raw_actions", "only applies with `action` (mode forward_dynamics)")
        return None
    spec = params["action"]
    if not isinstance(spec, dict):
        raise RequestError("action", f"must be a JSON object with {', '.join(ACTION_KEYS)}, got {spec!r:.100}")
    unknown = sorted(set(spec) - set(ACTION_KEYS))
    if unknown:
        key = unknown[0]
        name = f"action.{key}" if key.isidentifier() else "action"
        raise RequestError(name, f"unknown key {key[:64]!r}; known: {', '.join(ACTION_KEYS)}")
    for key in NOT_WITH_ACTION:
        if key in params:
            raise RequestError(
                key, "does not apply with `action` (chunk_size sets the frames, resolution_tier the size)"
            )
    for key in ("mode", "chunk_size", "domain"):
        if key not in spec:
            raise RequestError(f"action.{key}", "is required")
    mode = spec["mode"]
    if mode not in MODES:
        raise RequestError("action.mode", f"must be one of {', '.join(MODES)}, got {mode!r:.100}")
    chunk = _int(spec, "chunk_size", 0, 1, limits.max_chunk_size, "action.chunk_size")
    domain = spec["domain"]
    if not isinstance(domain, str) or domain not in RAW_ACTION_DIMS:
        known = ", ".join(sorted(RAW_ACTION_DIMS))
        raise RequestError(
            "action.domain", f"must be an embodiment with a known action width ({known}), got {domain!r:.100}"
        )
    tier = spec.get("resolution_tier", default_tier)
    if isinstance(tier, bool) or tier not in RESOLUTION_BINS:
        raise RequestError(
            "action.resolution_tier", f"must be one of {', '.join(map(str, RESOLUTION_BINS))}, got {tier!r:.100}"
        )
    view_point = spec.get("view_point", "ego_view")
    if view_point is not None and view_point not in VIEW_POINTS:
        raise RequestError(
            "action.view_point", f"must be one of {', '.join(VIEW_POINTS)} or null, got {view_point!r:.100}"
        )
    if image is not None and video is not None:
        raise RequestError("condition_video", "pass either `image` or `condition_video` with `action`, not both")
    if mode == INVERSE and video is None:
        raise RequestError("condition_video", "mode inverse_dynamics needs a clip (`condition_video`)")
    if image is None and video is None:
        raise RequestError("image", "`action` needs an `image` or a `condition_video`")
    if image is not None:
        check_image(image, limits)
        field_name, (h, w) = "image", image.shape[:2]
    else:
        check_clip(video, limits)  # type: ignore[arg-type]
        field_name, (h, w) = "condition_video", video.shape[1:3]  # type: ignore[union-attr]
    try:
        geometry = ActionGeometry.of(int(h), int(w), int(tier), alignment)
    except ValueError as e:
        raise RequestError(field_name, f"too small for `action`: {e}") from e
    th, tw = geometry.canvas
    if th > limits.max_height or tw > limits.max_width:
        raise RequestError(
            "action.resolution_tier", f"its {tw}x{th} canvas exceeds the limits {limits.max_width}x{limits.max_height}"
        )
    if (chunk + 1) * th * tw > limits.max_pixel_frames:
        raise RequestError(
            "action.chunk_size",
            f"(chunk_size+1)×canvas = {(chunk + 1) * th * tw} exceeds the budget {limits.max_pixel_frames}",
        )
    _check_raw_actions(raw_actions, mode, domain, limits)
    return {"action_mode": mode, "chunk_size": chunk, "domain": domain, "resolution_tier": int(tier),
            "view_point": view_point, "geometry": geometry}  # fmt: skip


def _check_raw_actions(raw: np.ndarray | None, mode: str, domain: str, limits: Limits) -> None:
    if mode != FORWARD:
        if raw is not None:
            raise RequestError("raw_actions", f"only applies with mode forward_dynamics, not {mode}")
        return
    if raw is None:
        raise RequestError("raw_actions", "mode forward_dynamics needs raw_actions FP32 [T, D]")
    if raw.dtype != np.float32:
        raise RequestError("raw_actions", f"must be FP32, got {raw.dtype}")
    width = RAW_ACTION_DIMS[domain]
    if raw.ndim != 2:
        raise RequestError("raw_actions", f"must be [T, {width}], got shape {list(raw.shape)}")
    if not 1 <= raw.shape[0] <= limits.max_raw_actions:
        raise RequestError("raw_actions", f"has {raw.shape[0]} rows, allowed 1..{limits.max_raw_actions}")
    if raw.shape[1] != width:
        raise RequestError("raw_actions", f"has {raw.shape[1]} channels; domain {domain!r} has {width}")
    if not np.isfinite(raw).all():
        raise RequestError("raw_actions", "must be finite")


def _action_fields(action: dict[str, Any] | None, alignment: int) -> dict[str, Any]:
    """GenerationParams' action fields; none without `action`."""
    if action is None:
        return {}
    lh, lw = action["geometry"].latent
    return {**{k: action[k] for k in ACTION_FIELDS}, "video_height": lh * alignment, "video_width": lw * alignment}


def _validate_video(
    video: np.ndarray | None,
    image: np.ndarray | None,
    params: dict[str, Any],
    num_frames: int,
    mode: str,
    limits: Limits,
    temporal: int,
) -> tuple[tuple[int, ...], str]:
    """v2v's clip and parameters (the pipeline's checks, P:1069-1089, plus ours) → (indexes, keep)."""
    if video is None:
        for key in ("condition_frame_indexes", "condition_video_keep"):
            if key in params:
                raise RequestError(key, "only applies with a `video` input (v2v)")
        return (), "first"
    if image is not None:
        raise RequestError("condition_video", "pass either `image` (i2v) or `condition_video` (v2v), not both")
    if num_frames == 1:
        raise RequestError("condition_video", "a clip conditions video only (v2v); num_frames must be > 1")
    if mode != "none":
        raise RequestError("condition_video", f"v2v is not supported with window_mode {mode!r}")
    check_clip(video, limits)
    indexes = params.get("condition_frame_indexes", [0, 1])
    latent = (num_frames - 1) // temporal + 1
    # bool is an int the pipeline accepts too (isinstance(True, int))
    if not isinstance(indexes, list) or not all(isinstance(i, int) and i >= 0 for i in indexes):
        raise RequestError("condition_frame_indexes", f"must be a list of non-negative integers, got {indexes!r}")
    if not indexes:
        raise RequestError("condition_frame_indexes", "must contain at least one index")
    if max(indexes) >= latent:
        raise RequestError(
            "condition_frame_indexes", f"must be < {latent} (latent frames of num_frames={num_frames}), got {indexes}"
        )
    keep = params.get("condition_video_keep", "first")
    if keep not in ("first", "last"):
        raise RequestError("condition_video_keep", f"must be 'first' or 'last', got {keep!r}")
    return tuple(int(i) for i in indexes), keep


def _validate_windows(
    mode: str, params: dict[str, Any], num_frames: int, defaults: Defaults, limits: Limits, temporal: int
) -> tuple[int, int, int]:
    """→ (window_frames, overlap_frames, context_frames) in pixel frames; (0, 0, 0) for mode none."""
    keys = ("window_frames", "overlap_frames", "context_frames", "max_windows")
    if mode == "none":
        extra = [k for k in keys if k in params]
        if extra:
            raise RequestError(extra[0], "only applies with window_mode chained or kv")
        return 0, 0, 0
    if num_frames == 1:
        raise RequestError("window_mode", "windows need a video (num_frames > 1)")
    window = _int(params, "window_frames", defaults.window_frames, 1 + temporal, limits.max_frames)
    if (window - 1) % temporal:
        raise RequestError("window_frames", f"must be 1 mod {temporal}, got {window}")
    w_lat = 1 + (window - 1) // temporal
    overlap = context = 0
    total_lat = 1 + (num_frames - 1) // temporal
    if mode == "chained":
        lo = MIN_CHAINED_OVERLAP_LATENT * temporal
        overlap = _int(params, "overlap_frames", defaults.overlap_frames, lo, window - temporal)
        if overlap % temporal:
            raise RequestError(
                "overlap_frames", f"must be a multiple of {temporal} (whole latent frames), got {overlap}"
            )
        o_lat = overlap // temporal
        windows = 1 + -(-max(0, total_lat - w_lat) // (w_lat - o_lat))
        if "context_frames" in params:
            raise RequestError("context_frames", "only applies with window_mode kv")
    else:
        if "overlap_frames" in params:
            raise RequestError("overlap_frames", "kv windows do not overlap; only applies with window_mode chained")
        context = _int(
            params, "context_frames", defaults.context_frames, 0, 1 + (limits.max_frames - 1) * limits.max_windows
        )
        if context and (context - 1) % temporal:
            raise RequestError("context_frames", f"must be 0 (keep all) or 1 mod {temporal}, got {context}")
        windows = -(-total_lat // w_lat)
    max_windows = _int(params, "max_windows", limits.max_windows, 1, limits.max_windows)
    if windows > max_windows:
        raise RequestError("num_frames", f"needs {windows} windows of {window} frames, max_windows is {max_windows}")
    return window, overlap, context


def check_clip(video: np.ndarray, limits: Limits) -> None:
    """A conditioning clip (v2v, action): uint8 [T, H, W, 3] within the limits."""
    if video.dtype != np.uint8:
        raise RequestError("condition_video", f"must be UINT8, got {video.dtype}")
    if video.ndim != 4 or video.shape[3] != 3:
        raise RequestError("condition_video", f"must be [T, H, W, 3] RGB, got shape {list(video.shape)}")
    t, h, w = video.shape[:3]
    if not 1 <= t <= limits.max_video_frames:
        raise RequestError("condition_video", f"has {t} frames, allowed 1..{limits.max_video_frames}")
    if h < 1 or w < 1 or h * w > limits.max_image_pixels:
        raise RequestError("condition_video", f"has {h}x{w} pixels per frame, allowed 1..{limits.max_image_pixels}")


def check_image(image: np.ndarray, limits: Limits, height: int = 0, width: int = 0) -> None:
    if image.dtype != np.uint8:
        raise RequestError("image", f"must be UINT8, got {image.dtype}")
    if image.ndim != 3 or image.shape[2] != 3:
        raise RequestError("image", f"must be [H, W, 3] RGB, got shape {list(image.shape)}")
    h, w = image.shape[:2]
    if h < 1 or w < 1 or h * w > limits.max_image_pixels:
        raise RequestError("image", f"has {h}x{w} pixels, allowed 1..{limits.max_image_pixels}")
    if height and width:
        # the image is resized to cover height x width before the centre crop (conditioning.preprocess_image): a
        # far-off aspect ratio makes that intermediate huge (1x65536 → 256x256: 256x16.7M pixels)
        scale = max(width / w, height / h)
        cover = math.ceil(scale * h) * math.ceil(scale * w)
        if cover > max(limits.max_image_pixels, 4 * height * width):
            raise RequestError(
                "image",
                f"aspect {w}:{h} is too far from the output's {width}:{height} (resize to cover: {cover} pixels)",
            )


# Command-line options for the request parameters, shared by the offline CLI and the client (one spelling).
CLI_PARAMS: dict[str, type] = {
    "negative_prompt": str, "height": int, "width": int, "num_frames": int, "fps": float, "steps": int,
    "guidance_scale": float, "shift": float, "seed": int,
}  # fmt: skip
CLI_WINDOW_PARAMS: dict[str, type] = {
    "window_frames": int,
    "overlap_frames": int,
    "context_frames": int,
    "max_windows": int,
}


# each flag's help, the factors Cosmos3's Wan2.2 VAE's (docs/requests.md); unset flags take the deployment's defaults
CLI_HELP = {
    "negative_prompt": "what the video should not show",
    "height": "frame height in pixels, a multiple of the VAE's spatial factor (16)",
    "width": "frame width in pixels, a multiple of 16",
    "num_frames": "frames, 1 mod the VAE's temporal factor (4) (1: an image)",
    "fps": "the video's frame rate",
    "steps": "denoising steps",
    "guidance_scale": "classifier-free guidance scale (1: no unconditional branch)",
    "shift": "the flow-matching schedule's shift",
    "seed": "the noise seed: the same seed and parameters give the same video",
    "chunk_size": "actions per chunk",
    "domain": "the embodiment (the checkpoint's action domains, e.g. av, bridge_orig_lerobot)",
    "resolution_tier": "the action canvas: 256, 480, 704 or 720",
    "view_point": "the action caption's camera: ego_view, third_person_view, wrist_view or concat_view",
    "window_frames": "frames per AR window, 1 mod 4",
    "overlap_frames": "chained: frames each window takes from the last, a multiple of 4 (at least 2 latent frames)",
    "context_frames": "kv: frames of committed context each window attends to, 1 mod 4 (0: all)",
    "max_windows": "the most windows the stream may take",
}


def add_request_arguments(ap, windows: bool = False) -> None:
    """--prompt, --image and every request parameter as a flag (`--guidance` for guidance_scale)."""
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--image", help="conditioning image for i2v (png/jpg)")
    for name, typ in CLI_PARAMS.items():
        flag = {"guidance_scale": "--guidance"}.get(name, "--" + name.replace("_", "-"))
        ap.add_argument(flag, dest=name, type=typ, help=CLI_HELP[name])
    ap.add_argument("--no-system-prompt", dest="use_system_prompt", action="store_const", const=False)
    ap.add_argument("--no-templates", dest="add_templates", action="store_const", const=False)
    ap.add_argument("--no-safety-check", dest="enable_safety_check", action="store_const", const=False,
                    help="skip the deployment's guardrail (where its safety_checker_optional allows)")  # fmt: skip
    ap.add_argument("--video", help="conditioning clip for v2v (.mp4, or .npy uint8 [T, H, W, 3])")
    ap.add_argument("--condition-frames", dest="condition_frame_indexes", type=_index_list,
                    help="v2v: latent frames kept clean, e.g. 0,1 (the default)")  # fmt: skip
    ap.add_argument("--condition-keep", dest="condition_video_keep", choices=("first", "last"))
    ap.add_argument("--sound", dest="enable_sound", action="store_const", const=True, help="generate sound too")
    ap.add_argument("--audio-out", help="the waveform: .wav (16-bit PCM), or .pt (float32 [2, S], the pipeline's)")
    ap.add_argument("--cache", help='step caching, the `cache` parameter as JSON: \'{"policy": "sea", "threshold": 0.25}\' '
                    "(null: off, overriding the config's default)")  # fmt: skip
    ap.add_argument("--lora", help="a LoRA adapter (parameters.lora.name): the client's NAME in the server's lora_dir, "
                    "the offline CLI's DIR (a folder transformer.save_lora_adapter wrote)")  # fmt: skip
    ap.add_argument("--lora-scale", dest="lora_scale", type=float, help="the adapter's scale (default 1.0)")
    ap.add_argument("--action-mode", choices=MODES, help="robot actions from --image or --video (parameters.action)")
    for name, typ in CLI_ACTION_PARAMS.items():
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, help=CLI_HELP[name])
    ap.add_argument("--raw-actions", help="forward_dynamics: the actions, .npy float32 [T, D]")
    ap.add_argument("--actions-out", help="policy / inverse_dynamics: the actions float32 [chunk, D], .npy (CLI: or "
                    ".pt, the pipeline's out.action[0]; client: or .json)")  # fmt: skip
    if windows:
        ap.add_argument("--window-mode", dest="window_mode", choices=("chained", "kv"),
                        help="AR windows (the client's stream: chained unless given)")  # fmt: skip
        for name, typ in CLI_WINDOW_PARAMS.items():
            ap.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, help=CLI_HELP[name])


def params_from_arguments(args) -> dict[str, Any]:
    """The request parameters the user set on the command line (the rest take the deployment's defaults)."""
    keys = (*CLI_PARAMS, "use_system_prompt", "add_templates", "window_mode", *CLI_WINDOW_PARAMS, *CLI_VIDEO_PARAMS,
            "enable_safety_check")  # fmt: skip
    params = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "cache", None) is not None:  # JSON text: checked by `validate` like the server's `parameters`
        try:
            params["cache"] = json.loads(args.cache)
        except (ValueError, RecursionError) as e:
            raise RequestError("cache", f"is not valid JSON ({e})") from e
    flags = (("name", "lora"), ("scale", "lora_scale"))
    lora = {k: getattr(args, a) for k, a in flags if getattr(args, a, None) is not None}
    if lora:  # --lora-scale alone: validation names the missing `lora.name`
        params["lora"] = lora
    action = {"mode": args.action_mode} if getattr(args, "action_mode", None) else {}
    action.update({k: getattr(args, k) for k in CLI_ACTION_PARAMS if getattr(args, k, None) is not None})
    if action:  # an action flag without --action-mode: validation names the missing `action.mode`
        params["action"] = action
    return params


CLI_VIDEO_PARAMS = ("condition_frame_indexes", "condition_video_keep", "enable_sound")
CLI_ACTION_PARAMS: dict[str, type] = {"chunk_size": int, "domain": str, "resolution_tier": int, "view_point": str}


def _index_list(text: str) -> list[int]:
    """`0,1` → [0, 1] (argparse turns the ValueError into a usage error naming the flag)."""
    return [int(x) for x in text.split(",") if x.strip()]
