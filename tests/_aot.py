"""Ahead-of-time compiles inside a test run: the CPU suite runs Triton's interpreter
(``TRITON_INTERPRET=1``, tests/conftest.py), whose kernels the AOT compiler cannot take, so a
test hands a script to a subprocess without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_compiled(script: str, cases: Any) -> Any:
    """Run ``script`` (Python source; ``sys.argv[1]`` is ``cases`` as JSON) in a subprocess
    without the interpreter, from the repository root; returns the JSON of its last stdout line.
    Fails the test with the subprocess's stderr when it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True,
        env=env, cwd=root, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
