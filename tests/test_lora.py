"""LoRA adapters chosen per request, offline (fp32, CPU): parity with diffusers' `load_lora_adapter` +
`set_adapters` (an adapter on the generation tower through the CLI's `--lora DIR`, one on both towers at scales 1
and 0.5, i2v, an action request); a pack of base + A + B at two scales + A again, each request bit for bit its solo
run; `max_loras: 2` with three adapters in rotation (nothing evicted mid-request); every bad adapter or choice an
error naming its field, the next request served; the maths alone (grouped deltas vs a per-row loop)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch._dynamo.utils import counters

from cosmos3_core.attention import SdpaAttention
from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator, main
from cosmos3_core.lora_store import METADATA_KEY, WEIGHTS
from cosmos3_core.model.lora import AdapterRows, adapted, dense_delta, grouped_delta, merged_linear
from cosmos3_core.requests import RequestError
from cosmos3_core.step import DenoiseStep
from cosmos3_core.tools.make_lora import make_lora
from tests.conftest import reference_pipeline, rel_l2, run_reference

PROMPT = "a robot arm stacks wooden blocks"
T2V = dict(num_frames=5, height=32, width=64, steps=2, guidance_scale=5.0, shift=8.0, seed=3, fps=16.0)


def _load(folder: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def bad_adapters(root: Path, good: Path) -> None:
    """Malformed adapters beside the good ones (`good` on the GEN tower with lora_alpha / r = 2, root/both on both
    towers): each must fail its request alone, naming `lora`."""
    sd, meta = _load(good)
    a_key = next(k for k in sd if k.endswith("lora_A.weight"))

    def write(name: str, tensors: dict, metadata: dict | None = meta) -> None:
        (root / name).mkdir()
        save_file(tensors, root / name / WEIGHTS, metadata=metadata)

    write("wrong_shape", {**sd, a_key: torch.zeros(4, 3)})
    write("wrong_key", {**sd, "layers.99.self_attn.add_q_proj.lora_A.weight": sd[a_key].clone()})
    write("half_pair", {k: v for k, v in sd.items() if k != a_key})
    write("not_finite", {**sd, a_key: torch.full_like(sd[a_key], float("nan"))})
    # on the UND tower (each stage checks the values of its own tower's modules: here prefill's)
    q = "layers.0.self_attn.add_q_proj.lora_"  # the UND tower's to_q has its shapes
    und = {"layers.0.self_attn.to_q.lora_A.weight": torch.full_like(sd[q + "A.weight"], torch.nan),
           "layers.0.self_attn.to_q.lora_B.weight": sd[q + "B.weight"].clone()}  # fmt: skip
    write("not_finite_und", {**sd, **und})
    # on both towers, the GEN part not finite: prefill (the UND tower's stage) must not keep the UND part
    both, both_meta = _load(root / "both")
    gen_key = next(k for k in both if "add_k_proj.lora_B" in k)
    write("not_finite_gen_both", {**both, gen_key: torch.full_like(both[gen_key], torch.inf)}, both_meta)
    # finite in the file, not once B is scaled by lora_alpha / r = 2 (fp32's max is ~3.4e38)
    b_key = a_key.replace("lora_A", "lora_B")
    write("overflow", {**sd, b_key: torch.full_like(sd[b_key], 3e38)})
    write("dora", sd, {**meta, METADATA_KEY: json.dumps({**json.loads(meta[METADATA_KEY]), "use_dora": True})})
    (root / "pickled").mkdir()
    torch.save(sd, root / "pickled" / "pytorch_lora_weights.bin")


@pytest.fixture(scope="module")
def loras(nano_ckpt, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_lora(nano_ckpt, root / "gen", rank=4, targets=("gen",), alpha=8, seed=1)  # lora_alpha / r = 2
    make_lora(nano_ckpt, root / "both", rank=6, targets=("gen", "und"), seed=2, std=0.2)
    make_lora(nano_ckpt, root / "attn", rank=3, targets=("add_q_proj", "add_v_proj", "to_add_out"), seed=4, std=0.3)
    make_lora(nano_ckpt, root / "mlp", rank=5, targets=("mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj"), seed=5)
    make_lora(nano_ckpt, root / "big_rank", rank=16, targets=("gen",), seed=6)
    bad_adapters(root, root / "gen")
    return root


@pytest.fixture(scope="module")
def gen(nano_ckpt, loras) -> Generator:
    return Generator(Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", lora_dir=str(loras),
                                max_loras=3, max_lora_rank=8))  # fmt: skip


@pytest.fixture(scope="module")
def pipe(nano_ckpt):
    return reference_pipeline(nano_ckpt)


def with_adapter(pipe, folder: Path, scale: float, run):
    """`run()` with diffusers' transformer holding the adapter at `scale`, then the adapter removed."""
    pipe.transformer.load_lora_adapter(str(folder), prefix=None, weight_name=WEIGHTS, adapter_name="under_test")
    pipe.transformer.set_adapters("under_test", weights=scale)
    try:
        return run()
    finally:
        pipe.transformer.delete_adapters("under_test")


def test_generation_tower_adapter_through_the_cli_matches_diffusers(nano_ckpt, loras, pipe, tmp_path):
    out = tmp_path / "v.pt"
    args = ["--checkpoint", str(nano_ckpt), "--prompt", PROMPT, "--out", str(out), "--lora", str(loras / "gen")]
    for k, v in T2V.items():
        args += [{"num_frames": "--num-frames", "guidance_scale": "--guidance"}.get(k, f"--{k}"), str(v)]
    assert main(args) == 0
    ref = with_adapter(pipe, loras / "gen", 1.0, lambda: run_reference(pipe, PROMPT, T2V))
    assert rel_l2(torch.load(out), ref) <= 1e-4


def test_both_towers_adapter_at_half_scale_i2v_matches_diffusers(gen, loras, pipe, test_image):
    """The UND tower's part changes the text K/V (prefill applies it); scale 0.5; an i2v request."""
    params = {**T2V, "seed": 5}
    ours = gen.latents(PROMPT, {**params, "lora": {"name": "both", "scale": 0.5}}, test_image)
    ref = with_adapter(pipe, loras / "both", 0.5, lambda: run_reference(pipe, PROMPT, params, test_image))
    assert rel_l2(ours, ref) <= 1e-4, rel_l2(ours, ref)


def test_action_request_adapter_matches_diffusers(action_ckpt, tmp_path):
    """A policy request with sound: vision latents, actions and the waveform."""
    from tests.test_action import CASES, cli_args, inputs_of, reference

    make_lora(action_ckpt, tmp_path / "loras" / "robot", rank=4, targets=("gen", "und"), seed=7, std=0.2)
    case = CASES[-1]  # policy, an image, a 9-wide domain, with sound
    image, clip, raw = inputs_of(case)
    args = cli_args(action_ckpt, "configs/tiny.yaml", case, tmp_path, image, clip, raw, steps=2)
    args[args.index("--config") + 1] = _roomy_config(tmp_path)
    assert main([*args, "--lora", str(tmp_path / "loras" / "robot"), "--lora-scale", "0.8"]) == 0
    pipe = reference_pipeline(action_ckpt)
    ref_v, ref_a, ref_s = with_adapter(
        pipe, tmp_path / "loras" / "robot", 0.8, lambda: reference(pipe, case, image, clip, raw, steps=2)
    )
    assert rel_l2(torch.load(tmp_path / "v.pt"), ref_v) <= 1e-4
    assert rel_l2(torch.load(tmp_path / "a.pt"), ref_a) <= 1e-4
    assert rel_l2(torch.load(tmp_path / "s.pt"), ref_s) <= 1e-4


def _roomy_config(tmp_path: Path) -> str:
    import yaml

    raw = yaml.safe_load(open("configs/tiny.yaml"))
    raw["limits"].update(max_height=1280, max_width=1280)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    return str(tmp_path / "cfg.yaml")


def test_pack_of_adapters_equals_each_alone_bit_for_bit(gen):
    """base, A, B at two scales and A again (another seed, size and guidance) share every tick."""
    requests = [
        {**T2V},
        {**T2V, "seed": 4, "lora": {"name": "both"}},
        {**T2V, "seed": 5, "lora": {"name": "mlp", "scale": 1.0}},
        {**T2V, "seed": 6, "lora": {"name": "mlp", "scale": 0.5}},
        {**T2V, "seed": 7, "height": 64, "guidance_scale": 1.0, "lora": {"name": "both", "scale": 1.5}},
    ]
    prefilled = [gen.prefill.run(gen.prefill.validate(PROMPT, p, None), None) for p in requests]
    before = gen.engine.stats.max_requests_in_tick
    packed = [g.latents for g in gen.run_together(prefilled)]
    assert gen.engine.stats.max_requests_in_tick == max(before, len(requests))
    key, layout = next(reversed(gen.engine.step.layouts.items()))
    assert (
        key[-2:] == (2, False) and len(set(layout.packed.lora.used.tolist())) == 2
    )  # both, mlp: the dense delta's 2 slots
    alone = [gen.latents(PROMPT, p) for p in requests]
    for i, (a, b) in enumerate(zip(packed, alone)):
        assert torch.equal(a, b), f"request {i} differs from its solo run"
    assert not torch.equal(alone[2], alone[3]), "the scale had no effect"
    assert not torch.equal(gen.latents(PROMPT, {**T2V, "seed": 5}), alone[2]), "the adapter had no effect"


def test_three_adapters_rotating_through_two_slots(nano_ckpt, loras):
    """max_loras 2, adapters gen / attn / mlp in rotation, all submitted at once: a third adapter waits for a slot
    instead of evicting one a live request uses; every result equals its solo run."""
    g = Generator(Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", lora_dir=str(loras),
                             max_loras=2, max_lora_rank=8))  # fmt: skip
    names = ["gen", "attn", "mlp", "gen", "attn"]
    small = {**T2V, "num_frames": 1, "height": 32, "width": 32, "guidance_scale": 1.0}
    requests = [{**small, "steps": 2 + i % 2, "seed": i, "lora": {"name": n}} for i, n in enumerate(names)]
    prefilled = [g.prefill.run(g.prefill.validate(PROMPT, p, None), None) for p in requests]
    store = g.engine.loras
    seen: list[tuple[int, ...]] = []
    tick = g.engine.tick

    def watched_tick() -> int:  # every live request's slot still holds its adapter, each tick
        for job in g.engine.scheduler.live:
            assert store.names()[job.lora_slot] == job.params.lora.name
        seen.append(tuple(sorted(j.lora_slot for j in g.engine.scheduler.live)))
        return tick()

    g.engine.tick = watched_tick
    packed = [x.latents for x in g.run_together(prefilled)]
    g.engine.tick = tick
    assert store.loads >= 4, "three adapters through two slots must reload"
    assert max(len(s) for s in seen) == 2 and all(len(set(s)) == len(s) for s in seen if s)
    for i, p in enumerate(requests):
        assert torch.equal(packed[i], g.latents(PROMPT, p)), f"request {i} ({names[i]}) differs from its solo run"
    assert all(n == 0 for n in store.pins)


BAD = [  # (parameters.lora, field)
    ("gen", "lora"),
    ([], "lora"),
    ({"scale": 1.0}, "lora.name"),
    ({"name": 3}, "lora.name"),
    ({"name": "../gen"}, "lora.name"),
    ({"name": ".."}, "lora.name"),
    ({"name": "/tmp"}, "lora.name"),
    ({"name": "no_such_adapter"}, "lora.name"),
    ({"name": "gen", "scale": float("nan")}, "lora.scale"),
    ({"name": "gen", "scale": "1"}, "lora.scale"),
    ({"name": "gen", "scale": 1e9}, "lora.scale"),
    ({"name": "gen", "rank": 4}, "lora.rank"),
    ({"name": "pickled"}, "lora"),
    ({"name": "wrong_shape"}, "lora"),
    ({"name": "wrong_key"}, "lora"),
    ({"name": "half_pair"}, "lora"),
    ({"name": "not_finite"}, "lora"),
    ({"name": "not_finite_und"}, "lora"),
    ({"name": "not_finite_gen_both"}, "lora"),
    ({"name": "overflow"}, "lora"),
    ({"name": "dora"}, "lora"),
    ({"name": "big_rank"}, "lora"),
]


def test_bad_adapters_and_choices_name_their_field(gen):
    small = {**T2V, "steps": 1, "num_frames": 1, "height": 32, "width": 32}
    for value, name in BAD:
        with pytest.raises(RequestError) as e:
            gen.generate(PROMPT, {**small, "lora": value})
        assert e.value.field == name, (value, str(e.value))
        assert str(e.value).startswith(name + ":")
    malformed = {"wrong_shape", "wrong_key", "half_pair", "not_finite", "not_finite_und", "not_finite_gen_both",
                 "overflow", "dora", "big_rank"}  # fmt: skip
    for store in (gen.prefill.loras, gen.engine.loras):  # nothing malformed was kept, nor remembered as good
        assert not malformed & set(store.names().values())
        assert not malformed & {name for name, _ in store.known}
    gen.generate(PROMPT, {**small, "lora": {"name": "gen"}})  # and the next one is served


def test_config_refuses_what_adapters_are_not_served_with(tmp_path, loras):
    import yaml

    for extra, words in [
        ({"parallel": {"cfg": 2}}, "lora_dir: adapters need a single-GPU denoise"),
        ({"lora_dir": str(tmp_path / "missing")}, "lora_dir:"),
        ({"max_loras": 0}, "max_loras:"),
        ({"max_lora_rank": "8"}, "max_lora_rank:"),
    ]:
        path = tmp_path / "d.yaml"
        path.write_text(yaml.safe_dump({"lora_dir": str(loras), **extra}))
        with pytest.raises(ValueError, match=words):
            Deployment.load(path)


def test_grouped_delta_equals_each_group_alone():
    """The segmented delta: each group of rows through its own slot and scale, as a loop over groups computes it
    (the CPU's grouped GEMMs exactly, CUDA's dense form to rounding); an empty group and scale 0 (no adapter) add
    exact zeros."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(24, 16, bias=False)
    lin.register_buffer("lora_A", torch.randn(3, 8, 24, generator=g))
    lin.register_buffer("lora_B", torch.randn(3, 8, 16, generator=g))
    x = torch.randn(256, 24, generator=g)
    # (start, end, slot, scale): an empty group, then one without an adapter
    groups = [(0, 64, 2, 1.0), (64, 64, 1, 3.0), (64, 128, 0, 0.0), (128, 192, 1, 0.5), (192, 256, 2, -2.0)]
    rows = AdapterRows(
        torch.tensor([s for _, _, s, _ in groups]),
        torch.tensor([c for *_, c in groups], dtype=torch.float32),
        torch.tensor([e for _, e, _, _ in groups], dtype=torch.int32),
    )
    y = torch.randn(256, 16, generator=g)
    out, dense = grouped_delta(y, x, lin, rows), dense_delta(y, x, lin, rows)
    # the dense form through only the slots the rows read (a layout's `used`), in any order: the same sums
    read = dense_delta(y, x, lin, dataclasses.replace(rows, used=torch.tensor([2, 1])))
    assert rel_l2(read, out) < 1e-6
    for start, end, slot, scale in groups:
        want = y[start:end] + (x[start:end] @ (lin.lora_A[slot] * scale).t()) @ lin.lora_B[slot]
        assert torch.equal(out[start:end], want)
    assert rel_l2(dense, out) < 1e-6
    assert torch.equal(out[64:128], y[64:128]) and torch.equal(dense[64:128], y[64:128])  # scale 0: y itself


def test_merged_and_prefill_forms_equal_the_groups():
    """A pack whose every row reads one slot at one scale: the weight-merged linear (CUDA's and compiled) equals the
    groups' delta to rounding; prefill's one group through its slot directly (`AdapterRows.single`) likewise, and
    scale 0 there is the base linear exactly."""
    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(24, 16)
    lin.register_buffer("lora_A", torch.randn(3, 8, 24, generator=g))
    lin.register_buffer("lora_B", torch.randn(3, 8, 16, generator=g))
    x = torch.randn(128, 24, generator=g)
    rows = AdapterRows(torch.tensor([2, 2, 2]), torch.tensor([0.7, 0.7, 0.7]),
                       torch.tensor([64, 128, 128], dtype=torch.int32), torch.tensor([2]), merged=True)  # fmt: skip
    want = grouped_delta(lin(x), x, lin, rows)
    assert rel_l2(merged_linear(lin, x, rows), want) < 1e-6
    assert rel_l2(adapted(lin, x, 0, AdapterRows.single(2, 0.7, 128, "cpu")), want) < 1e-6
    assert torch.equal(adapted(lin, x, 0, AdapterRows.single(2, 0.0, 128, "cpu")), lin(x))


def test_an_overflowing_slot_stays_in_its_own_rows():
    """fp16: a slot whose x·A overflows leaves every other row bit for bit as it was — rows of other slots, and
    rows without an adapter exactly y (the dense form selects other slots' columns away, never multiplies an inf by
    0); the grouped form likewise."""
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(24, 16, bias=False)
    lin.register_buffer("lora_A", torch.randn(3, 8, 24, generator=g).half())
    lin.register_buffer("lora_B", torch.randn(3, 8, 16, generator=g).half())
    x, y = (torch.randn(64, 24, generator=g).abs() + 0.1).half(), torch.randn(64, 16, generator=g).half()
    # rows 16-32 read slot 1; rows 32-48 no adapter (slot 0, scale 0); rows 48-64 slot 0 at scale -1
    rows = AdapterRows(torch.tensor([2, 1, 0, 0]), torch.tensor([1.0, 0.5, 0.0, -1.0]),
                       torch.tensor([16, 32, 48, 64], dtype=torch.int32))  # fmt: skip
    before = [delta(y, x, lin, rows) for delta in (grouped_delta, dense_delta)]
    lin.lora_A[1] = 6e4  # x·A ≥ 6e4 · 2.4, past fp16's 65504
    for delta, was in zip((grouped_delta, dense_delta), before):
        out = delta(y, x, lin, rows)
        assert not torch.isfinite(out[16:32]).any(), delta.__name__  # the overflow, in its own rows
        assert torch.equal(out[:16], was[:16]) and torch.equal(out[32:], was[32:]), delta.__name__
        assert torch.equal(out[32:48], y[32:48]), delta.__name__


def test_weights_that_overflow_the_pool_dtype_are_refused(nano_ckpt, loras, tmp_path):
    """Values are checked as a slot would hold them: B times lora_alpha / r, in the pool's dtype (an inf in any
    resident B would turn every row of a dense-delta pack NaN), and in every tower, whichever the stage keeps."""
    from cosmos3_core.lora_store import read_adapter
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.lora import adaptable_shapes

    shapes = adaptable_shapes(Checkpoint.open(nano_ckpt).config)

    def read(folder: Path, dtype: torch.dtype, keep: frozenset[str] | None = None):
        return read_adapter(folder.name, folder / WEIGHTS, shapes, 8, dtype, keep)

    with pytest.raises(RequestError, match=r"overflows float32 \(max 3.403e\+38\) .* lora_alpha / r = 2"):
        read(loras / "overflow", torch.float32)  # finite in the file; B · 2 is not
    with pytest.raises(RequestError, match="not all finite"):
        read(loras / "not_finite_gen_both", torch.float32, frozenset({"und"}))  # prefill's read: GEN checked too
    sd, meta = _load(loras / "gen")  # lora_alpha / r = 2
    b_key = next(k for k in sd if k.endswith("lora_B.weight"))
    a_key = next(k for k in sd if k.endswith("lora_A.weight"))
    for name, tensors in [("b_fp16", {**sd, b_key: torch.full_like(sd[b_key], 4e4)}),  # fp16 once; 8e4 scaled
                          ("a_fp16", {**sd, a_key: torch.full_like(sd[a_key], 1e5)})]:  # fmt: skip
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / WEIGHTS, metadata=meta)
        with pytest.raises(RequestError, match="overflows float16"):
            read(tmp_path / name, torch.float16)
        adapter = read(tmp_path / name, torch.float32)  # what fp32 holds
        assert all(a.dtype == b.dtype == torch.float32 for a, b in adapter.modules.values())
    adapter = read(loras / "both", torch.bfloat16, frozenset({"gen"}))  # kept: the GEN modules, in the pool's dtype
    assert {shapes[m][0] for m in adapter.modules} == {"gen"} and adapter.towers == {"gen", "und"}
    assert all(a.dtype == b.dtype == torch.bfloat16 for a, b in adapter.modules.values())


class _BucketedSdpa(SdpaAttention):
    """SDPA whose packs may run in bucketed layouts: on the CPU (nothing captured) a bucket's padding rows and spare
    segment slots run eagerly — the geometry a FlashInfer bucket's capture replays on the GPU."""

    bucketable = True


def test_bucketed_layout_with_adapters_equals_exact(gen):
    """Two mixes in one bucket (its adapter groups' ends rewritten with the geometry, spare slots empty): each
    request as in an exact layout."""
    engine = gen.engine
    exact = engine.step
    engine.step = DenoiseStep(engine.model, engine.pool, attention=_BucketedSdpa(engine.pool), cuda_graphs=False,
                              graph_buckets=(1024,))  # fmt: skip
    try:
        one = {**T2V, "steps": 1}
        mixes = [
            [{**one, "seed": 4, "lora": {"name": "gen"}}, {**one, "seed": 8}],
            [{**one, "seed": 6, "height": 64, "lora": {"name": "mlp", "scale": 0.5}}, {**one, "seed": 4}],
        ]
        for mix in mixes:
            packed = gen.run_together([gen.prefill.run(gen.prefill.validate(PROMPT, p, None), None) for p in mix])
            assert next(reversed(engine.step.layouts))[0][0] == "bucket"
            engine.step, bucketed = exact, engine.step
            for p, r in zip(mix, packed):
                assert rel_l2(r.latents, gen.latents(PROMPT, p)) <= 1e-6
            engine.step = bucketed
        assert len(engine.step.layouts) == 1  # one bucket served both mixes (SDPA's key: the same prefixes)
    finally:
        engine.step = exact


def test_compiled_kernels_with_adapters_equal_eager(nano_ckpt, loras, gen):
    """`compile: true`: the compiled GEN kernels take the pack's adapters (compiled, the delta is the dense form)."""
    compiled = Generator(Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", compile=True,
                                    lora_dir=str(loras), max_loras=3, max_lora_rank=8))  # fmt: skip
    params = {**T2V, "seed": 11, "lora": {"name": "both", "scale": 0.5}}
    assert rel_l2(compiled.latents(PROMPT, params), gen.latents(PROMPT, params)) < 1e-5
    # a request alone: its layout merges the adapter into the weights; a pack with a base request beside it cannot
    merged = [layout.packed.lora.merged for layout in compiled.engine.step.layouts.values()]
    assert merged == [True], merged

    # packs of one adapter, then of two (a wider dense delta) at the same size: the same compiled graphs, so no
    # compile while serving when a second adapter joins
    def together(pair: list[dict]) -> list:
        return compiled.run_together(
            [compiled.prefill.run(compiled.prefill.validate(PROMPT, p, None), None) for p in pair]
        )

    one, two = [params, {**T2V, "seed": 12}], [params, {**T2V, "seed": 12, "lora": {"name": "mlp"}}]
    together(one)
    graphs = counters["stats"]["unique_graphs"]
    packed = together(two)
    assert counters["stats"]["unique_graphs"] == graphs
    assert not any(layout.packed.lora.merged for layout in list(compiled.engine.step.layouts.values())[1:])
    for p, r in zip(two, packed):
        assert rel_l2(r.latents, gen.latents(PROMPT, p)) < 1e-5


@pytest.mark.parametrize("precision", ["checkpoint", "fp8"])
def test_warmup_with_an_adapter_compiles_every_adapter_path(nano_ckpt, loras, precision):
    """`compile: true` with a warmup request naming an adapter: served afterwards, a request alone (its adapter
    merged into the 16-bit weights) and packs of one and of two adapters beside a base request (the dense delta)
    compile nothing more. In FP8 (no merge: E4M3 weights) a 1-step request runs W8A8 (the policy's 1-step rule), so
    the same packs run W8A8 alone and mixed with W8A16 rows, with adapters and without."""
    warm = [{**T2V, "lora": {"name": "gen"}}]
    compiled = Generator(Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", compile=True,
                                    lora_dir=str(loras), max_loras=3, max_lora_rank=8, warmup_requests=warm,
                                    precision=precision))  # fmt: skip
    size = {**T2V, "num_frames": 9, "seed": 5}  # other row counts than the warmup's
    one = {**size, "steps": 1}
    packs = [[{**one, "lora": {"name": "both"}}], [{**size, "lora": {"name": "both"}}, one],
             [{**one, "lora": {"name": "both"}}, {**size, "lora": {"name": "mlp", "scale": 0.5}}, size]]  # fmt: skip
    with torch._dynamo.config.patch(error_on_recompile=True):
        for pack in packs:
            compiled.run_together(
                [compiled.prefill.run(compiled.prefill.validate(PROMPT, p, None), None) for p in pack]
            )


def test_fp8_base_with_adapters(nano_ckpt, loras, tmp_path):
    """`precision: fp8`: the adapter's delta, in the activation dtype, over the FP8 linears. W8A16 (2 steps, inside
    the official first / last windows) equals the adapter over a 16-bit checkpoint of the dequantized weights (what
    W8A16 computes); a pack of W8A16 and W8A8 rows with adapters equals each request alone, bit for bit."""
    from safetensors.torch import load_file

    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.fp8 import Fp8Linear, dequantize
    from cosmos3_core.model.layers import GEN, UND

    shutil.copytree(nano_ckpt, tmp_path / "dequantized")
    weights = tmp_path / "dequantized" / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    fp8 = Checkpoint.open(nano_ckpt, "fp8").load_transformer({UND, GEN}, "cpu", torch.float32)
    for name, m in fp8.named_modules():
        if isinstance(m, Fp8Linear):
            state[name + ".weight"] = dequantize(m.weight, m.weight_scale, torch.float32)
    save_file(state, weights)

    def generator(ckpt: Path, **kw) -> Generator:
        return Generator(Deployment(checkpoint=str(ckpt), device="cpu", dtype="float32", lora_dir=str(loras),
                                    max_loras=3, max_lora_rank=8, **kw))  # fmt: skip

    ours = generator(nano_ckpt, precision="fp8", fp8_policy={"reasoner": "a16"})
    params = {**T2V, "lora": {"name": "both", "scale": 0.5}}
    ref = generator(tmp_path / "dequantized").latents(PROMPT, params)
    assert rel_l2(ours.latents(PROMPT, params), ref) <= 1e-5
    mixed = [{**T2V, "steps": 7, "lora": {"name": "both"}}, {**T2V, "steps": 4, "seed": 5, "lora": {"name": "mlp"}}]
    packed = ours.run_together([ours.prefill.run(ours.prefill.validate(PROMPT, p, None), None) for p in mixed])
    assert ours.engine.stats.max_requests_in_tick == 2
    for p, r in zip(mixed, packed):  # the 4th tick: the 7-step request's W8A8 row beside the other's W8A16 row
        assert torch.equal(r.latents, ours.latents(PROMPT, p))
