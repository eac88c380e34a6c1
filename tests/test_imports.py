"""`cosmos3_core`'s layers, read from the source: no import cycle, and no module imports one of a higher layer
(type-only imports included). A new module must be placed in LAYERS."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "cosmos3_core"

# low → high: model maths and plain data; rows; the packed step; the scheduler; the engine; stages and Triton glue
LAYERS: list[set[str]] = [
    {"__init__", "from_diffusers", "faults", "precompiled", "media", "inputs", "windows", "requests", "sessions", "sampling", "cache", "kv_pool", "model.__init__", "model.config",
     "model.prompts", "model.embodiments", "model.wan_decoder", "model.wan_weights", "model.fp8", "model.attend", "model.tiny",
     "model.random_checkpoint", "model.provision", "tools.__init__", "tools.make_fp8", "caches", "parallel.__init__", "parallel.config",
     "parallel.comm", "parallel.group", "errors", "safety", "model.lora", "tools.guardrail_snapshot"},
    {"model.layers", "model.rotary", "model.conditioning", "model.sound", "model.video_input", "model.action", "rows",
     "wire", "tools.make_tiny"},
    {"attention", "model.checkpoint", "lora_store"},
    {"model.towers"},
    {"graphs", "memory"},
    {"step"},
    {"parallel.ulysses", "parallel.vae"},
    {"parallel.denoise"},
    {"parallel.worker"},
    {"stages", "deployment"},
    {"scheduler"},
    {"engine"},
    {"generate"},
    {"triton.__init__", "triton.stub", "triton.state", "triton.admission", "triton.lifecycle", "triton.launcher",
     "triton.front", "triton.outcomes", "triton.io", "triton.gpu_memory", "triton.sink", "tools.warm", "tools.make_lora", "tools.plan"},
    {"triton.serve", "triton.door", "triton.prefill", "triton.denoise", "triton.decode"},
]  # fmt: skip
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PKG).with_suffix("").parts)


def imports_of(path: Path) -> set[str]:
    """Modules of the package that `path` imports, anywhere in it (function bodies and TYPE_CHECKING too)."""
    here = _module(path).split(".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level]
            names = [node.module] if node.module else [a.name for a in node.names]
            found |= {".".join([*base, *n.split(".")]) for n in names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cosmos3_core."):
            found.add(node.module.removeprefix("cosmos3_core."))
    return {m for m in found if m in RANK or m + ".__init__" in RANK}


def graph() -> dict[str, set[str]]:
    return {_module(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def test_every_module_has_a_layer():
    assert set(graph()) <= set(RANK), f"place these in LAYERS: {sorted(set(graph()) - set(RANK))}"


def test_no_import_goes_up_a_layer():
    upward = [(m, d) for m, deps in graph().items() if m in RANK for d in deps if RANK.get(d, 0) > RANK[m]]
    assert not upward, f"imports from a higher layer: {upward}"


def test_no_import_cycle():
    g, state, cycles = graph(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(g.get(m, ())):
            if state.get(d) == "open":
                cycles.append([*path[path.index(d) :], d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = "done"

    for m in g:
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_model_reaches_no_serving_layer():
    """model/ is the maths and the checkpoints: it imports model/ and plain data only. The towers take the step's
    attention as an argument (`model.attend.Attend`), not from attention.py; model/provision.py resolves the tiny
    default and `random:*` with model/'s own writers, not tools/'s."""
    plain = {m for m in LAYERS[0] if not m.startswith("tools.")}
    reach = [(m, d) for m, deps in graph().items() if m.startswith("model.")
             for d in deps if not d.startswith("model.") and d not in plain]  # fmt: skip
    assert not reach, f"model/ imports beyond model/ and plain data: {reach}"


def test_only_tools_import_tools():
    """tools/ are developer commands (make_tiny, make_fp8, warm) over the package; nothing the server or the CLI runs
    imports them (the deployment resolves its checkpoint through model/provision.py)."""
    users = [(m, d) for m, deps in graph().items() if not m.startswith("tools.")
             for d in deps if d.startswith("tools.")]  # fmt: skip
    assert not users, f"imports of tools/ from outside it: {users}"


# the modules that write checkpoints offline (random weights, the tiny model, FP8 conversion): no served part runs them
# beside a thread of its own
PLAIN_DIFFUSERS = {"from_diffusers", "model.random_checkpoint", "model.tiny", "tools.make_fp8"}


def test_served_code_imports_diffusers_only_through_its_lock():
    """diffusers' lazy package is not safe to import from two threads at once, and the denoise stub imports its
    sampler's class on a thread of its own: every other import of it goes through `from_diffusers`."""
    plain, at_top = [], []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if isinstance(node, ast.Call) and _called(node) in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                names += [arg.value] if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else []
            if any(n.split(".")[0] == "diffusers" for n in names) and _module(path) not in PLAIN_DIFFUSERS:
                plain.append(f"{_module(path)}:{node.lineno}")
        # a call at the module's top (or in a class body) runs while this module's import lock is held
        at_top += [f"{_module(path)}:{c.lineno}" for c in _outside_functions(tree)
                   if isinstance(c, ast.Call) and _called(c) in ("from_diffusers", "diffusers_imports")]  # fmt: skip
    assert not plain, f"imports of diffusers outside from_diffusers (cosmos3_core/from_diffusers.py): {plain}"
    assert not at_top, f"from_diffusers called at import time: {at_top}"


def test_the_scheduler_class_imports_what_its_from_config_needs_under_the_lock():
    """diffusers' scheduler imports its compatible schedulers' modules at its first from_config: `scheduler_class`
    runs that under the lock, so the engine's later from_config imports nothing beside another thread."""
    code = (
        "import sys; from cosmos3_core.sampling import scheduler_class; cls = scheduler_class(); "
        "before = set(sys.modules); cls.from_config({'flow_shift': 3.0}); print(sorted(set(sys.modules) - before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PKG.parent)
    assert out.stdout.strip() == "[]", f"from_config imported {out.stdout.strip()} outside the lock"


def _outside_functions(node: ast.AST) -> list[ast.AST]:
    """`node`'s descendants that run when it runs: function bodies left out (their decorators and defaults run)."""
    kids = []
    for c in ast.iter_child_nodes(node):
        if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kids += getattr(c, "decorator_list", []) + c.args.defaults + [d for d in c.args.kw_defaults if d]
        else:
            kids.append(c)
    return kids + [d for c in kids for d in _outside_functions(c)]


def _called(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


# stdlib only, and only such modules of the package: the supervisor's front and launcher (a supervisor that imports
# torch starts slowly and holds its memory), the door's state and tickets, and the pure lifecycle (unit-tested without
# a server, so no pb_utils). The plain modules they use import nothing else at their top (caches.py's flashinfer
# import is inside the one function the supervisor never calls).
STDLIB_ONLY = {"triton.stub", "triton.state", "triton.admission", "triton.lifecycle", "triton.front", "triton.launcher"}
PLAIN = {"errors", "caches", "parallel.config", "parallel.__init__"}


def _beyond_stdlib(nodes) -> list[str]:
    import sys

    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] not in sys.stdlib_module_names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] != "cosmos3_core":
            out += [node.module] if node.module.split(".")[0] not in sys.stdlib_module_names else []
    return out


def test_supervisor_state_and_lifecycle_import_the_stdlib_only():
    bad = []
    for module in sorted(STDLIB_ONLY | PLAIN):
        path = PKG / (module.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        bad += [(module, m) for m in _beyond_stdlib(ast.walk(tree) if module in STDLIB_ONLY else tree.body)]
        bad += [(module, d) for d in imports_of(path) if d not in STDLIB_ONLY | PLAIN]
    assert not bad, f"beyond the stdlib: {bad}"
