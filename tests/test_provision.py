"""The tiny default (`checkpoint: ""`, model/provision.py) has every part the embedded default serves (the sound
tokenizer, the action heads), and one cached by an older version of its recipe is rebuilt, not reused."""

from __future__ import annotations

from cosmos3_core.model.provision import TINY_STAMP, is_current_tiny_default, resolve_checkpoint
from cosmos3_core.model.random_checkpoint import has_action, has_sound


def test_an_older_tiny_default_is_rebuilt_with_sound_and_actions(tmp_path, monkeypatch):
    target = tmp_path / "tiny-nano"
    monkeypatch.setenv("COSMOS3_TINY_CHECKPOINT", str(target))
    target.mkdir()  # what an earlier version left: a checkpoint (its index), no stamp of this version
    (target / "model_index.json").write_text('{"_class_name": "Cosmos3OmniPipeline"}')
    (target / "old-part").write_text("")

    assert resolve_checkpoint("") == target
    assert is_current_tiny_default(target) and not (target / "old-part").exists()
    assert has_sound(target) and has_action(target)

    stamp = (target / TINY_STAMP).stat().st_mtime_ns
    assert resolve_checkpoint("") == target and (target / TINY_STAMP).stat().st_mtime_ns == stamp  # reused as is
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # no leftovers
