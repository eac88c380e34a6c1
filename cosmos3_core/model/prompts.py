"""Prompt → token ids, exactly as `Cosmos3OmniPipeline.tokenize_prompt` builds them.

Templates (duration for video, resolution always) are appended to the prompt, their inverses to the
negative prompt; the chat template wraps the text with an optional mode-specific system prompt and the
generation prompt; `eos` and `<|vision_start|>` close the sequence. An action request's prompt becomes the JSON
caption the action model was trained on (`action_caption`, the pipeline's `_build_action_json_prompt`) and its
negative prompt is used as given, without templates.
"""

from __future__ import annotations

import json
import math

SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."


# action captions: `cinematography.framing` per camera viewpoint, the sentences the action model was trained with
VIEW_POINTS = {
    "ego_view": "This video is captured from a first-person perspective looking at the scene.",
    "third_person_view": "This video is captured from a third-person perspective looking towards the agent from the front.",
    "wrist_view": "This video is captured from a wrist-mounted camera.",
    "concat_view": "This video contains concatenated views from multiple camera perspectives.",
}


def action_caption(
    description: str, view_point: str | None, num_frames: int, fps: float, height: int, width: int
) -> str:
    """The pipeline's `_build_action_json_prompt`, key order and number formatting included (`view_point` None: no
    framing field)."""
    seconds_f = num_frames / fps if fps > 0 else 0.0
    finite = seconds_f >= 0 and math.isfinite(seconds_f)
    duration, end = (int(seconds_f), round(seconds_f)) if finite else (0, 0)
    minutes, seconds = divmod(end, 60)
    desc = description.strip()
    if desc and not desc.endswith((".", "!", "?")):
        desc = f"{desc}."
    caption: dict = {}
    if view_point is not None and view_point in VIEW_POINTS:
        caption["cinematography"] = {"framing": VIEW_POINTS[view_point]}
    ratio = width / height if height > 0 else 1.0
    aspects = ("1,1", "4,3", "3,4", "16,9", "9,16")
    caption["actions"] = [{"time": f"0:00-{minutes}:{seconds:02d}", "description": desc}]
    caption["duration"] = f"{duration}s"
    caption["fps"] = float(fps)
    caption["resolution"] = {"H": int(height), "W": int(width)}
    caption["aspect_ratio"] = min(aspects, key=lambda r: abs(int(r.split(",")[0]) / int(r.split(",")[1]) - ratio))
    return json.dumps(caption)


def _append(base: str, addition: str) -> str:
    base = base.rstrip(".")
    return f"{base}. {addition}" if base else addition


def with_templates(text: str, negative: bool, num_frames: int, height: int, width: int, fps: float) -> str:
    no = "not " if negative else ""
    if num_frames == 1:
        return _append(text, f"This image is {no}of {height}x{width} resolution.")
    text = _append(text, f"The video is {no}{num_frames / fps:.1f} seconds long and is {no}of {fps:.0f} FPS.")
    return _append(text, f"This video is {no}of {height}x{width} resolution.")


class PromptEncoder:
    def __init__(self, tokenizer, default_use_system_prompt: bool = True):
        self.tokenizer = tokenizer
        self.default_use_system_prompt = default_use_system_prompt
        self.suffix = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>")]

    def ids(self, text: str, num_frames: int, use_system_prompt: bool) -> list[int]:
        conversation = []
        if use_system_prompt:
            system = SYSTEM_PROMPT_IMAGE if num_frames == 1 else SYSTEM_PROMPT_VIDEO
            conversation.append({"role": "system", "content": system})
        conversation.append({"role": "user", "content": text})
        enc = self.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=True, add_vision_id=False, return_dict=True
        )
        return list(enc["input_ids"]) + self.suffix

    def encode(
        self,
        prompt: str,
        negative_prompt: str,
        num_frames: int,
        height: int,
        width: int,
        fps: float,
        use_system_prompt: bool | None = None,
        add_templates: bool = True,
    ) -> tuple[list[int], list[int]]:
        """→ (cond_ids, uncond_ids)."""
        if use_system_prompt is None:
            use_system_prompt = self.default_use_system_prompt
        cond, uncond = prompt, negative_prompt
        if add_templates:
            cond = with_templates(cond, False, num_frames, height, width, fps)
            uncond = with_templates(uncond, True, num_frames, height, width, fps)
        return self.ids(cond, num_frames, use_system_prompt), self.ids(uncond, num_frames, use_system_prompt)

    def encode_action(
        self,
        prompt: str,
        negative_prompt: str,
        num_frames: int,
        height: int,
        width: int,
        fps: float,
        view_point: str | None,
        use_system_prompt: bool | None = None,
    ) -> tuple[list[int], list[int]]:
        """An action request → (cond_ids, uncond_ids): the JSON caption, and the negative prompt as given."""
        if use_system_prompt is None:
            use_system_prompt = self.default_use_system_prompt
        caption = action_caption(prompt, view_point, num_frames, fps, height, width)
        cond = self.ids(caption, num_frames, use_system_prompt)
        return cond, self.ids(negative_prompt, num_frames, use_system_prompt)
