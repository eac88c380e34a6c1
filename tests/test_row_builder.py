"""The row builder is the only constructor of a step input, and the step reads exactly what it builds."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from cosmos3_core import rows, step

PKG = Path(step.__file__).parent


def test_rows_are_built_only_by_denoise_step_row():
    """No module but rows.py constructs `Row(...)`, and inside rows.py only `denoise_step_row` does."""
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Row":
                    assert path.name == "rows.py", f"{path}: builds a Row outside the row builder"
        if path.name == "rows.py":
            for fn in tree.body:
                if isinstance(fn, ast.FunctionDef) and fn.name != "denoise_step_row":
                    calls = [
                        n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Row"
                    ]
                    assert not calls, f"rows.{fn.name} builds a Row"


def test_step_reads_every_row_field(monkeypatch, action_ckpt):
    """Rename any field of the builder's output (without the step following) and the real step fails (a row with
    every band: vision, sound and actions)."""
    import dataclasses

    import pytest

    from cosmos3_core.kv_pool import KVPool
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.layers import GEN

    ckpt = Checkpoint.open(action_ckpt)
    cfg = ckpt.config
    model = ckpt.load_transformer({GEN}, "cpu", torch.float32)
    pool = KVPool(8, 4, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    pages = pool.alloc(5)
    cos = sin = torch.ones(1 * 2 * 2 + 3 + 2, cfg.head_dim)  # 4 vision, 3 sound, 2 action tokens
    branch = rows.Branch((pages,), cos, sin)
    latents = torch.randn(1, cfg.latent_channel, 1, 4, 4)
    action = rows.ActionBand(torch.randn(2, cfg.action_dim), domain=7, noisy=True)
    row = rows.denoise_step_row(
        latents, 500.0, torch.arange(1), (branch,), cfg.latent_patch_size, torch.float32,
        sound_latents=torch.randn(cfg.sound_dim, 3), action=action,
    )  # fmt: skip
    step.DenoiseStep(model, pool)([row])  # the builder's row runs
    for f in dataclasses.fields(rows.Row):
        renamed = type("RenamedRow", (), {(f.name + "_renamed" if k == f.name else k): getattr(row, k)
                                          for k in (g.name for g in dataclasses.fields(rows.Row))})  # fmt: skip
        with pytest.raises(AttributeError):
            step.DenoiseStep(model, pool)([renamed])
