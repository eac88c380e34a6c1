"""What the CLI prints about a finished request: where its time went, from the done event's `timings` and the
client's own clock, and which steps step caching skipped.

The done event's timings (seconds; the server measures them, wire.py) follow the request through the server:
  prefill_s     prefill's own work: validation, tokenizing, the text tower, encoding an image or clip
  to_denoise_s  arrival → the denoise model, less prefill_s: prefill's Triton queue and the hand-off of its outputs
  queue_s       the engine's queue: waiting for K/V pages (admission)
  denoise_s     admission → the last step (every window of a long video)
  to_decode_s   the engine's done → its decode starting: the latents' hand-off, earlier pieces still decoding
  decode_s      decoding the last piece (and the audio)
  server_e2e_s  arrival → the last frames out of decode: the sum of the above
The client's end-to-end time adds the rest ("transfer"): gRPC both ways, the ensemble's first step, reading the
response. Servers without some part leave it out; what the parts miss shows as "not measured".
"""

from __future__ import annotations

PARTS = (  # (timings key, label, what it is)
    ("prefill_s", "prefill", "validate, tokenize, text tower, image/clip encode"),
    ("to_denoise_s", "to denoise", "prefill's queue in Triton, its outputs handed to denoise"),
    ("queue_s", "queue", "the engine's queue: waiting for K/V pages"),
    ("denoise_s", "denoise", "admission to the last step"),
    ("to_decode_s", "to decode", "latents handed to decode, earlier pieces still decoding"),
    ("decode_s", "decode", "the last piece's VAE decode"),
)


def timing_lines(timings: dict[str, float], client_e2e_s: float) -> list[str]:
    """The breakdown, one part a line, and the sums they add up to."""
    rows = [(label, timings[key], what) for key, label, what in PARTS if key in timings]
    server = timings.get("server_e2e_s")
    if server is not None:
        rest = server - sum(r[1] for r in rows)
        if abs(rest) >= 0.05:  # a server without some part (the parts' own clocks agree to milliseconds)
            rows.append(("not measured", rest, "server time the parts above miss"))
        rows.append(("= server", server, "arrival to the last frames out"))
        rows.append(("transfer", client_e2e_s - server, "gRPC both ways, the ensemble's first step, reading"))
    rows.append(("= client", client_e2e_s, "send to the final response"))
    return ["where the time went (s):"] + [f"  {label:<13}{value:8.2f}  {what}" for label, value, what in rows]


def cache_lines(skipped: dict[str, list[int]] | list[dict[str, list[int]]] | None) -> list[str]:
    """Step caching's report (the done event's `cache_skipped`, absent without a cache policy): per CFG branch the
    0-based steps that reused a residual; for a long video one such line per window."""

    def branches(d: dict[str, list[int]]) -> str:
        return ", ".join(f"{branch} {len(steps)} {steps}" for branch, steps in d.items())

    if skipped is None:
        return []
    if isinstance(skipped, dict):
        return [f"cache_skipped (steps per branch): {branches(skipped)}"]
    return [f"cache_skipped window {i + 1}: {branches(d)}" for i, d in enumerate(skipped)]
