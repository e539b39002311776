"""docs/adding_an_algorithm.md runs as written: its Python blocks, in order, are one module that
defines, registers, runs and checks an algorithm, also under sample-level DP (in a fresh
interpreter, so the example's registration does not leak into the other tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_an_algorithm.md"


def test_the_walkthrough_runs_and_its_checks_pass(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 6, "the walkthrough lost its code blocks"
    # the example runs under sample_dp too: privately on both executors, and a variant with an
    # uncounted gradient is refused (docs/privacy.md)
    assert any('"sample_dp"' in b and "PrivacyRefused" in b for b in blocks)
    script = tmp_path / "walkthrough.py"
    script.write_text("\n".join(blocks) + "\nprint('WALKTHROUGH OK')\n")
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "WALKTHROUGH OK" in done.stdout
