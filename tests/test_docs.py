"""The product speaks for itself, and its documented commands exist.

- No tracked text file names a work session, a round or an issue by number: a measurement is named by its date,
  commit, card and command, a decision by its reason (git history keeps the chronology).
- README.md stays within 120 lines, and BENCHMARKS.md within 400.
- Every `python -m MODULE` in README.md, BENCHMARKS.md and docs/*.md (fenced shell blocks and inline code) answers
  `--help` (one process imports them all: torch is loaded once), and every `make TARGET` there has a recipe (`make -n`).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from test_readme import commands, fenced_blocks, split_comment

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|"
    "fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
CHRONOLOGY = re.compile(
    rf"\b(?:\d+(?:st|nd|rd|th)|{ORDINALS})(?:[ -]|\s*\n\s*(?:#\s*)?)(?:session|round)s?\b"  # an ordinal, in digits or words, before "session" or "round"
    r"|\b(?:session|round|issue)s?\s+#?\d+",  # "issue", "session" or "round" before a number
    re.IGNORECASE,
)
INTERNAL = {"cosmos3_core.parallel.worker"}  # started by the server itself, with its arguments: not a user command
MODULE = re.compile(r"(?:^|[\s;&|(])(?:\S*python3?)\s+-m\s+([A-Za-z_][\w.]*)")
MAKE = re.compile(r"(?:^|[\s;&|(])make\s+((?:[A-Za-z_][\w-]*(?:\s+|$))+)")


def test_no_session_round_or_issue_numbers_in_tracked_files():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for m in CHRONOLOGY.finditer(text):  # over the whole text: a phrase may wrap onto the next line
            n = text.count("\n", 0, m.start()) + 1
            hits.append(f"{name}:{n}: {m.group(0)!r}: {text.splitlines()[n - 1].strip()[:120]}")
    assert not hits, "name the date, commit, card and command, or the reason, not the chronology:\n" + "\n".join(hits)


def test_readme_and_benchmarks_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120, "README.md: at most 120 lines"
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 400, "BENCHMARKS.md: at most 400 lines"


def documented() -> tuple[set[str], set[str]]:
    """Every module run with `python -m` and every make target in the docs: their fenced shell blocks and their
    inline code spans."""
    modules, targets = set(), set()
    for path in DOCS:
        found = [split_comment(line)[0] for _, lines in fenced_blocks(path) for line in commands(lines)]
        found += re.findall(r"`([^`\n]*(?:python3? -m|make) [^`\n]*)`", path.read_text())
        for command in found:
            modules.update(MODULE.findall(command))
            for m in MAKE.finditer(command):
                targets.update(w for w in m.group(1).split() if "=" not in w and w not in ("and", "or", "then"))
    return modules - INTERNAL, targets


HELP_ALL = """
import contextlib, io, runpy, sys
failed = []
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        failed.append(f"{module}: --help did not exit")
    except SystemExit as e:
        if e.code not in (0, None) or "usage" not in out.getvalue().lower():
            failed.append(f"{module}: --help exited {e.code}: {out.getvalue()[-300:]}")
    except BaseException as e:
        failed.append(f"{module}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_documented_python_module_answers_help():
    modules, _ = documented()
    assert {"client", "cosmos3_core.triton.serve", "cosmos3_core.generate"} <= modules
    run = subprocess.run([sys.executable, "-c", HELP_ALL, *sorted(modules)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, f"documented modules without a working --help:\n{run.stdout}\n{run.stderr[-2000:]}"


def test_every_documented_make_target_has_a_recipe():
    _, targets = documented()
    assert {"setup", "serve", "demo", "test"} <= targets
    bad = []
    for target in sorted(targets):
        run = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
        if run.returncode != 0:
            bad.append(f"make {shlex.quote(target)}: {run.stderr.strip()[-300:]}")
    assert not bad, "documented make targets that make cannot run:\n" + "\n".join(bad)


def test_the_requests_table_is_the_ensembles_inputs_and_outputs():
    """docs/requests.md's one table of inputs and outputs names each of the ensemble's tensors with its config's
    TYPE_* and dims, and nothing else."""
    config = (ROOT / "model_repository" / "cosmos3" / "config.pbtxt").read_text()
    tensors = re.findall(r'\{ name: "(\w+)" data_type: (TYPE_\w+) dims: \[ ([^\]]*) \]', config)
    assert len(tensors) == 9, tensors
    doc = (ROOT / "docs" / "requests.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (?:input|output)[^|]* \| (TYPE_\w+) \| \[ ([^\]]*) \] \|", doc, re.M)
    assert sorted(rows) == sorted((n, t, d.strip()) for n, t, d in tensors)


def test_every_bench_script_is_named_in_development_md():
    """bench/ holds what a maintainer runs, and docs/development.md says what each script measures and its command."""
    listed = subprocess.run(["git", "ls-files", "bench"], cwd=ROOT, capture_output=True, text=True, check=True)
    scripts = [n for n in listed.stdout.split() if n.endswith((".py", ".sh")) and not n.endswith("__init__.py")]
    doc = (ROOT / "docs" / "development.md").read_text()
    missing = [n for n in scripts if n not in doc and str(Path(n).parent) + "/" not in doc]
    assert not missing, f"docs/development.md names no entry for {missing}"
