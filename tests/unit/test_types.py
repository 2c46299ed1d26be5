"""mypy (settings: pyproject.toml [tool.mypy]) finds no error in ``flowrl/``: the engines implement
the role Protocols of ``engines/base.py`` that the executor, the job and the ops are typed with."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_mypy_is_clean(tmp_path):
    # a fresh cache: a stale one from another checkout must not hide an error
    out = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-8000:] + \
        f"\nreproduce: {sys.executable} -m mypy"
