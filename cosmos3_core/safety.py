"""The safety checker a deployment runs (`safety_checker`), as diffusers' `Cosmos3OmniPipeline` runs NVIDIA's Cosmos
guardrail: the text guardrail on the prompt before any work, the video guardrail on the decoded frames.

A checker is any object with
- `check_text_safety(prompt: str) -> bool`: False refuses the request (the negative prompt is not checked);
- `check_video_safety(frames: np.ndarray uint8 [T, H, W, 3]) -> np.ndarray uint8 [T, H, W, 3] | None`: the frames
  to send (the Cosmos guardrail pixelates faces), or None to block the video.

`safety_checker` in the deployment config picks it:
- `cosmos`: `cosmos_guardrail.CosmosSafetyChecker`, the object diffusers builds (text: a blocklist, then
  Qwen3Guard; video: RetinaFace face pixelation). Its checkpoints come from the Hugging Face cache or Hub. The
  video check is `CosmosVideoBatched`: the package's own objects and calls, `FACE_BATCH` frames at a time, RetinaFace
  included (one forward a batch, on CUDA replayed as a graph; the package runs one frame a forward), on the stage's
  device and a CUDA stream of its own. On the CPU the same frames out as the package's `check_video_safety`
  (tests/test_safety_cosmos.py); on a GPU confidences within ~2e-3 of the package's, so a box that close to the
  threshold can go the other way (`FACE_BATCH`).
- `none`: no checks (random-weight and test deployments).
- `module:callable`: `callable()` returns a checker; `module` is an importable name or a `.py` file.
A checker that cannot be built fails the stage's load with one line naming what to install or set (`Unavailable`).

`Guardrail` is what the stages hold: prefill calls `check_prompt` before tokenizing (so before any K/V page is
reserved), decode calls `check_frames` on every piece of frames before it leaves (stages.py). A refusal is a
`Refused` (a `RequestError`: "<field>: refused by ..."), which names the guardrail and never quotes the prompt.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from .requests import RequestError

COSMOS, NONE = "cosmos", "none"
COSMOS_NAME = "Cosmos Guardrail"
# what `CosmosSafetyChecker()` downloads: its default checkpoint id and Qwen3Guard's model id (cosmos_guardrail 0.3.2)
COSMOS_CHECKPOINTS = ("nvidia/Cosmos-1.0-Guardrail", "Qwen/Qwen3Guard-Gen-0.6B")
LICENSE = "the NVIDIA Open Model License Agreement"
TEXT, VIDEO = "text", "video"  # which guardrail a stage runs
# frames copied, preprocessed and run through RetinaFace in ONE forward: a streamed piece (Edge: 13-16 frames), a
# shorter batch padded with zeros to it (one CUDA graph serves every piece). The package runs one frame a forward,
# which costs ~0.37 s per 121-frame 480x832 video on the H200 even replayed as a graph, against ~0.21 s at 32 frames
# a forward (the guardrail's budget is 5 % of a request). What that gives up: on the CPU the frames out are
# still the package's (tests/test_safety_cosmos.py), but on a GPU batched convolutions are other kernels whose TF32
# sums put confidences up to ~2e-3 from the package's (1.7e-3 measured on the H200), so a box whose confidence is
# within that of the 0.7 threshold can be pixelated by one and not by the other (bench/guardrail_cost.py measures it)
FACE_BATCH = 16
FACE_GRAPHS = 4  # (batch, frame size) CUDA graphs kept, each with its activations' pool


class SafetyChecker(Protocol):
    def check_text_safety(self, prompt: str) -> bool: ...
    def check_video_safety(self, frames: np.ndarray) -> np.ndarray | None: ...


class Refused(RequestError):
    """A prompt or a video the guardrail refused; the text names the guardrail, not the prompt."""


class Unavailable(ValueError):
    """The deployment's checker cannot be built here: one line saying what to install or set."""


def check_spec(spec: Any, where: str) -> str:
    """A config's `safety_checker` value, checked at load (not imported: that is the stages' load) → the spec,
    a relative `.py` path made absolute (the rendered deployment is read from another directory)."""
    if spec in (COSMOS, NONE):
        return spec
    if not isinstance(spec, str) or spec.count(":") < 1 or not all(spec.rsplit(":", 1)):
        raise ValueError(f"{where}: safety_checker: cosmos, none or module:callable; got {spec!r}")
    module, name = spec.rsplit(":", 1)
    if module.endswith(".py"):
        module = str(Path(module).absolute())
    return f"{module}:{name}"


class Guardrail:
    """A deployment's checker as the stages use it: refusals become `Refused`, a checker's bad answer an error."""

    def __init__(self, checker: SafetyChecker, name: str, terms: str = ""):
        """`name`: how refusals name it; `terms`: what a refused request must abide by (named in the error)."""
        self.checker, self.name = checker, name
        self.terms = f"; the generation must abide by {terms}" if terms else ""

    @classmethod
    def load(cls, spec: str, device: str, role: str) -> Guardrail | None:
        """The checker of `spec` for a stage on `device` that runs the `role` (TEXT or VIDEO) guardrail; None
        for `none`. Raises `Unavailable`."""
        if spec == NONE:
            return None
        if spec == COSMOS:
            return cls(_cosmos(device, role), COSMOS_NAME, LICENSE)
        module, name = spec.rsplit(":", 1)
        return cls(_factory(spec)(), f"safety checker {Path(module).stem if module.endswith('.py') else module}:{name}")

    def check_prompt(self, prompt: str) -> None:
        if not self.checker.check_text_safety(prompt):
            raise Refused("prompt", f"refused by the {self.name} (text guardrail){self.terms}")

    def check_frames(self, frames: np.ndarray, first_frame: int = 0) -> np.ndarray:
        """uint8 [T, H, W, 3] (frames `first_frame`.. of the video) → the frames to send, as the checker returns
        them (faces pixelated). Raises `Refused` when it blocks them."""
        checked = self.checker.check_video_safety(frames)
        if checked is None:
            last = first_frame + len(frames) - 1
            raise Refused(
                "video", f"blocked by the {self.name} (video guardrail) at frames {first_frame}..{last}{self.terms}"
            )
        checked = np.asarray(checked)
        if checked.dtype != np.uint8 or checked.shape != frames.shape:
            raise RuntimeError(
                f"the {self.name} returned {checked.dtype} {list(checked.shape)} for uint8 {list(frames.shape)} frames"
            )
        return checked


def _factory(spec: str) -> Callable[[], SafetyChecker]:
    module_name, name = spec.rsplit(":", 1)
    try:
        if module_name.endswith(".py"):
            where = importlib.util.spec_from_file_location(f"cosmos3_safety_{Path(module_name).stem}", module_name)
            if where is None or where.loader is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(where)
            where.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        factory = getattr(module, name)
    except (ImportError, AttributeError) as e:
        raise Unavailable(f"safety_checker {spec}: cannot import it ({e}); set safety_checker to a module:callable "
                          "that returns a checker, cosmos or none") from e  # fmt: skip
    return factory


def _cosmos(device: str, role: str) -> SafetyChecker:
    """`CosmosSafetyChecker()` as diffusers builds it, with the `role`'s guardrail models on `device` (the other
    role's stay on the CPU, unused: the prefill stage runs the text guardrail, the decode stage the video one)."""
    try:
        from cosmos_guardrail import CosmosSafetyChecker
    except ImportError as e:  # the package, or one of its imports (torchvision must match the installed torch)
        raise Unavailable(
            f"safety_checker cosmos needs the cosmos_guardrail package, which does not import here ({e}): "
            "pip install -e '.[safety]' with a torchvision that matches torch, or set safety_checker: none "
            "(no guardrail) or module:callable"
        ) from e
    try:
        checker = CosmosSafetyChecker()
    except Exception as e:  # noqa: BLE001 - the hub's and transformers' errors for a missing or unreachable checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        raise Unavailable(
            f"safety_checker cosmos: cannot load the guardrail's checkpoints {' and '.join(COSMOS_CHECKPOINTS)} "
            f"from the Hugging Face cache ({cache}) or the Hub ({type(e).__name__}: {first}); download them "
            "(`hf download <id>` for each) or set HF_HOME to a cache that holds them"
        ) from e
    runner = checker.text_guardrail if role == TEXT else checker.video_guardrail
    for model in runner.models:
        if hasattr(model, "to"):  # the blocklist is no module
            model.to(device)
    return CosmosText(checker) if role == TEXT else CosmosVideoBatched(checker)


class CosmosText:
    """A `CosmosSafetyChecker` whose `check_text_safety` is the package's (0.3.2): its text guardrail's models in
    order (the blocklist, then Qwen3Guard), the first that refuses ends it, logged as the package logs it — with
    Qwen3Guard's generation ended as soon as its verdict label ("Safety: Safe|Unsafe|Controversial") is out. The
    package generates up to 128 tokens and then reads only that label (its categories go into the log message), so
    the decision is the same: the tokens up to the label are the ones it would generate, and its parser finds the
    same first label in them. A real verdict, "Safety: Safe\nCategories: None", puts the label about 3 tokens in
    of ~10: ~0.13 s instead of ~0.45 s on the H200 at 44.7 ms a token (2026-12-03). An answer with no
    label is let through, as the package does (it logs an error)."""

    def __init__(self, package: Any):
        from cosmos_guardrail.cosmos_guardrail import UNSAFE_CATEGORIES, Qwen3Guard, logger

        self.package, self._qwen3guard, self._logger = package, Qwen3Guard, logger
        self._categories = "(" + "|".join(UNSAFE_CATEGORIES.values()) + ")"

    def check_text_safety(self, prompt: str) -> bool:
        runner = self.package.text_guardrail
        for guard in runner.safety_models or ():
            safe, message = self._qwen(guard, prompt) if isinstance(guard, self._qwen3guard) else guard.is_safe(prompt)
            if not safe:
                reason = runner.generic_block_msg or f"{type(guard).__name__.upper()}: {message}"
                self._logger.critical(f"GUARDRAIL BLOCKED: {reason}")
                return False
        return True

    def check_video_safety(self, frames: np.ndarray) -> np.ndarray | None:
        return self.package.check_video_safety(frames)

    def _qwen(self, guard: Any, prompt: str) -> tuple[bool, str]:
        """`Qwen3Guard.is_safe(prompt)`, its generation stopped at the label."""
        from transformers import StoppingCriteriaList

        try:
            text = guard.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False)
            inputs = guard.tokenizer([text], return_tensors="pt").to(guard.model.device)
            start = inputs.input_ids.shape[1]
            out = guard.model.generate(**inputs, max_new_tokens=128,
                                       stopping_criteria=StoppingCriteriaList([_LabelOut(guard.tokenizer, start)]))  # fmt: skip
            content = guard.tokenizer.decode(out[0][start:].tolist(), skip_special_tokens=True)
            found = re.search(QWEN3GUARD_LABEL, content)
            label = found.group(1) if found else None
            if label.lower() == "unsafe":  # no label: AttributeError, below, as in the package
                categories = re.findall(self._categories, content)
                return False, f"Prompt blocked by Qwen3Guard. Safety: {label}, Categories: {categories}"
            return True, ""
        except Exception as e:  # noqa: BLE001 - the package's own policy: logged, let through
            self._logger.error(f"Unexpected error occurred when running Qwen3Guard guardrail: {e}")
            return True, "Unexpected error occurred when running Qwen3Guard guardrail."


QWEN3GUARD_LABEL = r"Safety: (Safe|Unsafe|Controversial)"  # the package's parser (Qwen3Guard, 0.3.2)


class _LabelOut:
    """A `transformers` stopping criterion: True once the tokens generated after `start` hold Qwen3Guard's label."""

    def __init__(self, tokenizer: Any, start: int):
        self.tokenizer, self.start = tokenizer, start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.start :].tolist(), skip_special_tokens=True)
        return torch.full((input_ids.shape[0],), re.search(QWEN3GUARD_LABEL, text) is not None, dtype=torch.bool,
                          device=input_ids.device)  # fmt: skip


class CosmosVideoBatched:
    """A `CosmosSafetyChecker` whose `check_video_safety` is the package's, with its own objects and weights, laid
    out for speed: its video guardrail's content models (`run_safety_check`; none in 0.3.2, the SigLIP classifier is
    off there) may block, then each postprocessor runs; for the RetinaFace one its preprocessing (BGR, mean
    subtraction, fp32 as the net's parameters), its `PriorBox`, its net in phase "test", and its own
    `blur_detected_faces` (box decoding, confidence 0.7, NMS 0.4, top-k, the 20-pixel minimum, `pixelate_face`).

    What differs is how the work is laid out:
    - `batch` frames at a time (`FACE_BATCH`) cross to the device as uint8 (pinned, asynchronous) and become fp32
      there (the package converts the whole video on the host and copies 4x the bytes; uint8 -> fp32 is exact
      either way);
    - they go through the net in one forward (the package: one frame a forward), a shorter batch (a piece's tail)
      padded with zeros to `batch` rows whose outputs are dropped; a frame's scores do not depend on what shares its
      batch (per-sample convolutions, eval-mode BN, the same kernels at the one shape). On CUDA that forward is a
      CUDA graph captured at [batch, 3, H, W] (the same kernels as eager, replayed without the launches); if it
      cannot be captured, eager;
    - a frame with no score above the threshold (less 1e-6: a superset of the package's own test) skips
      `blur_detected_faces`, which would find no box in it and leave it as it is;
    - the frames are pixelated in place and returned (the package returns a copy of the same values);
    - on CUDA it runs on a high-priority stream of its own: a piece's check does not wait behind the next piece's
      decode, which the decode loop launches meanwhile on the default stream (triton/decode.py's DecodeLoop).
    So on the CPU the frames out equal the package's call frame for frame (tests/test_safety_cosmos.py). On a GPU
    they need not: the batched forward's convolution kernels are not the package's one-frame ones, and their TF32
    sums put confidences within ~2e-3 of the package's (1.7e-3 measured on the H200), so a box whose confidence is
    that close to the 0.7 threshold can be pixelated by one and not by the other (bench/guardrail_cost.py counts
    the frames equal). The text check is the package's own call."""

    def __init__(self, package: Any, batch: int = FACE_BATCH):
        from cosmos_guardrail.cosmos_guardrail import RetinaFaceFilter, logger

        self.package, self.batch, self._logger = package, batch, logger
        self._retinaface = RetinaFaceFilter
        # (h, w, device, dtype) → the package's priors, its box scale, its BGR means; made once
        self._constants: dict[tuple[int, int, torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._graphs: dict[tuple[int, int, int, torch.device, torch.dtype], _GraphedNet | None] = {}

    def check_text_safety(self, prompt: str) -> bool:
        return self.package.check_text_safety(prompt)

    def check_video_safety(self, frames: np.ndarray) -> np.ndarray | None:
        runner = self.package.video_guardrail
        safe, message = runner.run_safety_check(frames)
        if not safe:
            self._logger.critical(f"GUARDRAIL BLOCKED: {message}")  # the package's log line
            return None
        for post in runner.postprocessors or ():
            frames = self._faces(post, frames) if isinstance(post, self._retinaface) else post.postprocess(frames)
        return frames

    def _faces(self, face: Any, frames: np.ndarray) -> np.ndarray:
        """`face.postprocess(frames)`: uint8 [T, H, W, 3] → the same array, its faces pixelated."""
        param = next(face.net.parameters())
        device, dtype = param.device, param.dtype
        cuda = device.type == "cuda"
        if cuda and device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device, priority=-1)
        h, w = frames.shape[1:3]
        with torch.no_grad(), _on(self._streams[device] if cuda else None):
            priors, scale, means = self._constants_of(face, h, w, device, dtype)
            for start in range(0, len(frames), self.batch):
                u8 = torch.from_numpy(frames[start : start + self.batch])
                u8 = u8.pin_memory().to(device, non_blocking=True) if cuda else u8
                x = u8.to(dtype).permute(0, 3, 1, 2)[:, [2, 1, 0], :, :] - means
                loc, conf = self._scores(face, x)
                found = (conf[:, :, 1] > face.confidence_threshold - 1e-6).any(1)
                hits = found.cpu().nonzero().flatten().numpy()
                if len(hits) == len(found):  # the package's call on the batch as it is
                    face.blur_detected_faces(frames[start : start + len(hits)], loc, conf, priors, scale)
                elif len(hits):
                    rows, at = torch.from_numpy(hits).to(device), start + hits
                    frames[at] = np.stack(face.blur_detected_faces(frames[at], loc[rows], conf[rows], priors, scale))
        return frames

    def _scores(self, face: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The net's (loc, conf) for preprocessed frames x [n <= batch, 3, H, W], in one forward of `batch` rows (on
        CUDA the graph's): a shorter x (a piece's tail) is padded with zero rows, whose outputs are dropped."""
        n = len(x)
        if n < self.batch:  # so that one graph serves every piece; the real rows do not depend on the padding
            x = torch.cat([x, x.new_zeros(self.batch - n, *x.shape[1:])])
        cuda = x.device.type == "cuda"
        net = self._graphed(face, self.batch, *x.shape[2:], x.device, x.dtype) if cuda else face.net
        loc, conf = net(x)[:2]
        return loc[:n], conf[:n]

    def _graphed(self, face: Any, batch: int, h: int, w: int, device: torch.device, dtype: torch.dtype) -> Callable:
        """The net's forward on [batch, 3, h, w] as a CUDA graph, captured on first use; eager if it cannot be."""
        key = (batch, h, w, device, dtype)
        if key not in self._graphs:
            try:
                self._graphs[key] = _GraphedNet(face.net, (batch, 3, h, w), device, dtype)
            except RuntimeError as e:
                self._logger.warning(f"RetinaFace at {batch}x{h}x{w} not captured as a CUDA graph ({e}); it runs eager")
                self._graphs[key] = None
            while len(self._graphs) > FACE_GRAPHS:
                del self._graphs[next(iter(self._graphs))]
        return self._graphs[key] or face.net

    def _constants_of(
        self, face: Any, h: int, w: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The package's priors, box scale and BGR means for (h, w) frames, made once (its `PriorBox` is a Python
        loop over every anchor, ~16k at 480x832, which the package runs on every call)."""
        key = (h, w, device, dtype)
        if key not in self._constants:
            from retinaface.layers.functions.prior_box import PriorBox

            self._constants[key] = (
                PriorBox(face.cfg, image_size=(h, w)).forward().to(device, dtype=dtype),
                torch.Tensor([w, h, w, h]).to(device, dtype=dtype),
                torch.tensor([104.0, 117.0, 123.0], device=device, dtype=dtype).view(1, 3, 1, 1),
            )
        return self._constants[key]


class _GraphedNet:
    """A RetinaFace (phase "test") forward on inputs of one `shape` ([N, 3, H, W]), captured as a CUDA graph on the
    current (non-default) stream: the kernels of its eager forward at that shape, each launch replayed at once.
    Captured in thread-local mode, so the decode loop's thread may use the GPU meanwhile."""

    def __init__(self, net: torch.nn.Module, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype):
        self.x = torch.zeros(shape, device=device, dtype=dtype)
        for _ in range(2):  # cuDNN's kernels chosen and its workspace sized before the capture
            net(self.x)
        stream = torch.cuda.current_stream(device)
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.loc, self.conf, _ = net(self.x)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.x.copy_(x)
        self.graph.replay()
        return self.loc.clone(), self.conf.clone()


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
