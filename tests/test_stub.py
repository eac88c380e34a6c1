"""`triton/stub.py`: a Triton stub's interpreter reads text as ASCII (LC_CTYPE "C", no UTF-8 mode, whatever LANG and
PYTHONUTF8 say); `utf8_locale()` makes `open()` read UTF-8 again. Run where the `python3` command's own coercion is
off, as in the stub."""

from __future__ import annotations

import os
import subprocess
import sys

READ = "open({path!r}).read()"


def run_as_in_the_stub(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_a_utf8_file_reads_after_utf8_locale_and_not_before(tmp_path):
    path = tmp_path / "template.py.jinja"
    path.write_text("# a template's comment — not ASCII\n", encoding="utf-8")
    before = run_as_in_the_stub(READ.format(path=str(path)))
    assert before.returncode != 0 and "UnicodeDecodeError" in before.stderr  # the stub's condition, reproduced
    after = run_as_in_the_stub(
        "from cosmos3_core.triton.stub import utf8_locale\n"
        f"print(utf8_locale()); assert {READ.format(path=str(path))}.startswith('# a template')"
    )
    assert after.returncode == 0, after.stderr
    assert after.stdout.strip().lower().replace("-", "") == "utf8"
