"""`precompiled.py`: a function compiled ahead per input signature, saved, and loaded by a later instance (as a
restarted process would) without compiling again; arguments its guards refuse, and what this torch cannot compile
ahead, go the traced way. The decoder's kernels through it: tests/test_decoder.py."""

from __future__ import annotations

import torch

from cosmos3_core.precompiled import Precompiled


def scale_add(x: torch.Tensor, bias: torch.Tensor, factor: int) -> torch.Tensor:
    return x * factor + bias


def dynamic_rows(args: list) -> list:
    """Rows dynamic, channels static (the decoder's marks, without its unbacked time axes)."""
    out = [a.contiguous().view(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
    torch._dynamo.maybe_mark_dynamic(out[0], 0)
    return out


def untraced(*args):
    raise AssertionError("the traced path ran")


def test_an_instance_loads_what_another_compiled_and_every_signature_is_its_own(tmp_path):
    g = torch.Generator().manual_seed(0)
    x, bias = torch.randn(5, 8, generator=g), torch.randn(8, generator=g)
    first = Precompiled(scale_add, [dynamic_rows], tmp_path, untraced)
    assert torch.equal(first(x, bias, 3), scale_add(x, bias, 3))
    (artifact,) = tmp_path.iterdir()
    mtime = artifact.stat().st_mtime_ns
    later = Precompiled(scale_add, [dynamic_rows], tmp_path, untraced)
    y = torch.randn(11, 8, generator=g)  # other rows: the same artifact, loaded
    assert torch.equal(later(y, bias, 3), scale_add(y, bias, 3))
    assert [p.name for p in tmp_path.iterdir()] == [artifact.name] and artifact.stat().st_mtime_ns == mtime
    assert torch.equal(later(y, bias, 2), scale_add(y, bias, 2))  # another integer argument: another artifact
    z = torch.randn(5, 16, generator=g)
    assert torch.equal(later(z, torch.ones(16), 3), scale_add(z, torch.ones(16), 3))  # other channels: another
    assert len(list(tmp_path.iterdir())) == 3


def test_arguments_an_artifacts_guards_refuse_go_the_traced_way_and_it_is_said(tmp_path, capsys):
    """Rows left static by the mark: the artifact for 5 rows refuses 7 (a guard beyond the signature); those are
    answered by the traced path, every time, and the artifact stays."""
    traced = []

    def counted(*args):
        traced.append(args)
        return scale_add(*args)

    static = Precompiled(scale_add, [lambda args: args], tmp_path, counted)
    x, y, bias = torch.randn(5, 8), torch.randn(7, 8), torch.randn(8)
    for _ in range(2):
        assert torch.equal(static(x, bias, 3), scale_add(x, bias, 3))
        assert torch.equal(static(y, bias, 3), scale_add(y, bias, 3))
    assert len(traced) == 2 and len(list(tmp_path.iterdir())) == 1
    assert capsys.readouterr().err.count("guards refuse") == 1


def test_the_next_mark_is_tried_when_one_does_not_compile(tmp_path):
    def refused(args: list) -> list:
        raise RuntimeError("this torch cannot mark that")

    fn = Precompiled(scale_add, [refused, dynamic_rows], tmp_path, untraced)
    x, bias = torch.randn(5, 8), torch.randn(8)
    assert torch.equal(fn(x, bias, 3), scale_add(x, bias, 3)) and len(list(tmp_path.iterdir())) == 1


def data_dependent(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # a graph break: no full graph to compile ahead
        return x + 1
    return x - 1


def test_what_cannot_be_compiled_ahead_is_traced_and_said(tmp_path, capsys):
    calls = []

    def traced(*args):
        calls.append(args)
        return data_dependent(*args)

    fn = Precompiled(data_dependent, [lambda args: args], tmp_path, traced)
    x = torch.ones(3)
    assert torch.equal(fn(x), x + 1) and torch.equal(fn(-x), -x - 1)
    assert len(calls) == 2 and not list(tmp_path.glob("*.bin"))
    assert "data_dependent is traced in this process" in capsys.readouterr().err


def test_an_artifact_that_fails_its_first_run_is_dropped_for_the_traced_way(tmp_path, capsys):
    """An artifact that loads but cannot run here (a kernel built for another machine, say) fails only its first
    call's artifact run: that call and every later one of its signature are traced."""
    from cosmos3_core.precompiled import signature

    class Unrunnable:
        def guard_check(self, *args) -> bool:
            return True

        def __call__(self, *args):
            raise RuntimeError("no kernel image is available for execution on the device")

    traced = []

    def counted(*args):
        traced.append(args)
        return scale_add(*args)

    fn = Precompiled(scale_add, [dynamic_rows], tmp_path, counted)
    x, bias = torch.randn(5, 8), torch.randn(8)
    fn.loaded[signature((x, bias, 3))] = Unrunnable()
    for _ in range(2):
        assert torch.equal(fn(x, bias, 3), scale_add(x, bias, 3))
    assert len(traced) == 2 and capsys.readouterr().err.count("failed its first run") == 1


def test_it_compiles_ahead_where_dynamo_has_that_switched_off_by_default(tmp_path):
    """torch 2.11 (the GPU image's) leaves `enable_aot_compile` off, and its compiled functions then have no
    `aot_compile`: the store turns it on for its own compile, so an artifact is still written."""
    x, bias = torch.randn(5, 8), torch.randn(8)
    with torch._dynamo.config.patch(enable_aot_compile=False):
        assert torch.equal(
            Precompiled(scale_add, [dynamic_rows], tmp_path, untraced)(x, bias, 3), scale_add(x, bias, 3)
        )
    assert len(list(tmp_path.iterdir())) == 1


class Scaled(torch.nn.Module):
    def __init__(self, scale_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0, dtype=scale_dtype))


def through(layer: Scaled, x: torch.Tensor) -> torch.Tensor:
    return layer.lin(x) * layer.scale.to(x.dtype)


def dynamic_rows_of(i: int):
    def mark(args: list) -> list:
        out = [a.contiguous().view(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
        torch._dynamo.maybe_mark_dynamic(out[i], 0)
        return out

    return mark


def test_a_module_argument_keys_by_its_structure_one_artifact_per_kind_of_layer(tmp_path):
    """Layers built alike share one artifact (their weights are its inputs); a layer whose tensors differ in dtype
    (the same repr: an FP8 layer's scales beside a 16-bit one's) gets its own, not the other's refusing guards."""
    torch.manual_seed(0)
    a, b, other = Scaled(), Scaled(), Scaled(torch.float64)
    fn = Precompiled(through, [dynamic_rows_of(1)], tmp_path, untraced)
    x, y = torch.randn(5, 8), torch.randn(3, 8)
    assert torch.equal(fn(a, x), through(a, x)) and torch.equal(fn(b, y), through(b, y))
    assert len(list(tmp_path.iterdir())) == 1
    assert torch.equal(fn(other, x), through(other, x)) and len(list(tmp_path.iterdir())) == 2


def test_a_modules_plain_attributes_are_in_its_key():
    """A norm's eps is not in its repr: two layers alike but for it get artifacts of their own."""
    from cosmos3_core.precompiled import module_key

    a, b = Scaled(), Scaled()
    a.eps, b.eps = 1e-6, 1e-5
    assert module_key(a) != module_key(b) and module_key(a) == module_key(a)
