"""The README's commands stay true, and no docs command rots unseen.

- Every line of the README's "Try every mode" block runs as written (the only change: `--url` of this test's server
  appended to a client call), as soon as the lines whose outputs (a redirected stdout too) it reads have written them (independent lines at
  once, as several users would send them: cheaper on 2 cores), in a scratch directory whose `.venv` is this
  interpreter's, against one server rendered from `configs/tiny.yaml` with the default tiny checkpoint — what
  `make serve` starts. Each must exit 0 and write every file it names (`--out`, `--audio-out`, `--actions-out`).
- Every fenced shell command in README.md and docs/*.md is one of those lines or carries a marker comment, on its own
  line or as its block's first line (then it covers the block): `# GPU-only`, `# not run by tests: <why>`, or
  `# run by <file>` where <file> contains the command.
- docs/requests.md's raw `tritonclient` example runs as written (its `URL` pointed at that server) and streams the
  progress events, a `done` event and the video.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = {"bash", "sh", "shell", "console"}
TRY_HEADING = "Try every mode"
FIRST_COMMANDS = ["make setup && (make serve &) && make demo", "make test"]  # CI runs the second (.ci/run)
# what the block must keep covering: one request per mode
MODES = {
    "t2i": "--num-frames 1",
    "i2v": "--image",
    "v2v": "--video",
    "sound": "--sound",
    "policy": "--action-mode policy",
    "forward dynamics": "--action-mode forward_dynamics",
    "inverse dynamics": "--action-mode inverse_dynamics",
    "SeaCache": "--cache",
    "chained AR": "--window-mode chained",
    "kv AR": "--window-mode kv",
    "a kept session": "--keep-session",
    "its continuation": "--continue",
}
COMMENT = re.compile(r"(?:^|\s)#\s")
# what a line writes (a flag's file, or its stdout redirected: a kept session's id) and reads (an input flag's file,
# or a file the shell reads for it: the id a continuation names)
OUTPUTS = re.compile(r"(?:--(?:out|audio-out|actions-out)|>)\s+(\S+)")
INPUTS = re.compile(r"(?:--(?:image|video|raw-actions)\s+|\$\(cat )([^\s)]+)")


def fenced_blocks(path: Path) -> list[tuple[str, list[str]]]:
    """A markdown file's shell blocks → [(the heading above it, its lines)]."""
    blocks, heading, lines, lang = [], "", None, None
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if lines is None:
                lang, lines = line[3:].strip().lower(), []
            else:
                if lang in SHELL_LANGS:
                    blocks.append((heading, lines))
                lines = None
        elif lines is not None:
            lines.append(line)
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    return blocks


def commands(lines: list[str]) -> list[str]:
    """Logical command lines: continuations (a trailing backslash) joined; blank and comment-only lines dropped."""
    out, pending = [], ""
    for line in lines:
        if pending:
            pending += " " + line.strip()
        elif line.strip() and not line.lstrip().startswith("#"):
            pending = line.strip()
        if pending and not pending.endswith("\\"):
            out.append(pending)
            pending = ""
        elif pending:
            pending = pending[:-1].rstrip()
    return out


def split_comment(command: str) -> tuple[str, str]:
    m = COMMENT.search(command)
    return (command[: m.start()].strip(), command[m.start() :].strip()) if m else (command.strip(), "")


def marker_problem(command: str, comment: str) -> str | None:
    """None when `comment` is a valid marker for `command`, else what is wrong."""
    if comment.startswith("# GPU-only"):
        return None
    if re.match(r"# not run by tests: \S", comment):
        return None
    m = re.match(r"# run by (\S+)", comment)
    if m:
        runner = ROOT / m.group(1).rstrip(".,;:)")
        if not runner.is_file():
            return f"`# run by {m.group(1)}`: no such file"
        if command not in runner.read_text():
            return f"`# run by {m.group(1)}`: that file does not contain {command!r}"
        return None
    return "no marker (`# GPU-only`, `# not run by tests: why`, or `# run by <file>`)"


def readme_try_block() -> list[str]:
    blocks = [lines for heading, lines in fenced_blocks(ROOT / "README.md") if heading == TRY_HEADING]
    assert len(blocks) == 1, f"README.md: one shell block under the heading {TRY_HEADING!r}; found {len(blocks)}"
    return commands(blocks[0])


def test_first_commands_and_every_mode():
    first = [split_comment(c)[0] for c in commands(fenced_blocks(ROOT / "README.md")[0][1])]
    assert first[:2] == FIRST_COMMANDS, f"README.md's first two commands must stay {FIRST_COMMANDS}; got {first[:2]}"
    lines = readme_try_block()
    missing = [mode for mode, flag in MODES.items() if not any(flag in line for line in lines)]
    assert not missing, f"README.md's {TRY_HEADING!r} lacks a command for {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_links_resolve():
    """Every relative link in README.md and docs/*.md names a file that exists, and its #anchor a heading there."""
    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, frag = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}: no such file")
            elif frag and dest.suffix == ".md":
                headings = [line.lstrip("#") for line in dest.read_text().splitlines() if re.match(r"#+ ", line)]
                if frag not in {slug(h) for h in headings}:
                    broken.append(f"{path.relative_to(ROOT)}: {target}: no such heading")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_command_is_run_or_marked():
    tried = set(readme_try_block())
    problems = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for _, lines in fenced_blocks(path):
            head = lines[0].strip() if lines else ""
            covered = head.startswith("#") and marker_problem("", head) is None and "# run by" not in head
            for line in commands(lines):
                command, comment = split_comment(line)
                if line in tried or covered:
                    continue
                problem = marker_problem(command, comment)
                if problem:
                    problems.append(f"{path.relative_to(ROOT)}: {command[:80]!r}: {problem}")
    assert not problems, "docs commands neither run by a test nor marked:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A server as `make serve` starts it (configs/tiny.yaml, its default checkpoint), on free ports."""
    from cosmos3_core.deployment import DEFAULT_CONFIG, Deployment
    from cosmos3_core.triton.launcher import server_env, stop_server, wait_until_ready
    from cosmos3_core.triton.serve import start

    proc, ports, _ = start(Deployment.load(DEFAULT_CONFIG), tmp_path_factory.mktemp("serve_readme"), server_env())
    try:
        wait_until_ready(ports[1], proc=proc, timeout_s=300)
        yield f"127.0.0.1:{ports[0]}"
    finally:
        stop_server(proc)


def prerequisites(lines: list[str]) -> list[set[int]]:
    """Per line, the earlier lines that write a file it reads (`--image`, `--video`, `--raw-actions`)."""
    writer: dict[str, int] = {}
    needs = []
    for i, line in enumerate(lines):
        needs.append({writer[r] for r in INPUTS.findall(split_comment(line)[0]) if r in writer})
        writer.update({out: i for out in OUTPUTS.findall(line)})
    return needs


@pytest.mark.served
def test_try_every_mode_runs_as_written(tiny_server, tmp_path):
    (tmp_path / ".venv").symlink_to(sys.prefix)  # this interpreter's venv: its python finds its packages
    (tmp_path / "out").mkdir()  # `make demo` made it (out/demo.mp4): a line's shell redirect writes into it
    lines = readme_try_block()
    needs, done, running = prerequisites(lines), set(), {}
    pending = set(range(len(lines)))
    deadline = time.monotonic() + 600
    try:
        while pending or running:
            for i in sorted(i for i in pending if needs[i] <= done):  # each line once the files it reads exist
                command = split_comment(lines[i])[0]
                run = f"{command} --url {tiny_server}" if " -m client " in command else lines[i]
                with open(tmp_path / f"{i}.stderr", "w") as err:
                    running[i] = subprocess.Popen(["bash", "-c", run], cwd=tmp_path, stderr=err)
                pending.discard(i)
            for i, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[i]
                stderr = (tmp_path / f"{i}.stderr").read_text()[-2000:]
                assert proc.returncode == 0, f"{lines[i]}\nexit {proc.returncode}:\n{stderr}"
                for out in OUTPUTS.findall(lines[i]):
                    path = tmp_path / out
                    assert path.is_file() and path.stat().st_size > 0, f"{lines[i]}\ndid not write {out}:\n{stderr}"
                done.add(i)
            assert time.monotonic() < deadline, f"still running after 600 s: {[lines[i] for i in running]}"
            time.sleep(0.05)
    finally:
        for proc in running.values():  # a failed line: the others end with it
            proc.kill()
            proc.wait()


@pytest.mark.served
def test_raw_tritonclient_example_runs_as_written(tiny_server):
    text = (ROOT / "docs" / "requests.md").read_text()
    m = re.search(r"^## A raw tritonclient stream$.*?^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/requests.md: a python block under '## A raw tritonclient stream'"
    code = m.group(1)
    assert 'URL = "127.0.0.1:8001"' in code
    code = code.replace('URL = "127.0.0.1:8001"', f"URL = {tiny_server!r}")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'type': 'progress'" in run.stdout and "'type': 'done'" in run.stdout, run.stdout[-2000:]
    assert "video (9, 128, 192, 3)" in run.stdout, run.stdout[-2000:]
