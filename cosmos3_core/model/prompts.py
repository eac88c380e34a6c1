"""Prompt → token ids, exactly as `Cosmos3OmniPipeline.tokenize_prompt` builds them.

Templates (duration for video, resolution always) are appended to the prompt, their inverses to the
negative prompt; the chat template wraps the text with an optional mode-specific system prompt and the
generation prompt; `eos` and `<|vision_start|>` close the sequence.
"""

from __future__ import annotations

SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."


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
