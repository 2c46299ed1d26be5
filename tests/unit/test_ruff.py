"""ruff (rule set and reasons: pyproject.toml [tool.ruff]) finds nothing in the code, tests,
benchmarks and examples."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ruff_check_is_clean():
    from ruff.__main__ import find_ruff_bin  # in the test extras: pip install -e .[test]

    out = subprocess.run([find_ruff_bin(), "check", "--no-cache", "flowrl", "tests", "benchmarks",
                          "examples"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:] + \
        f"\nfix: {sys.executable} -m ruff check --fix flowrl tests benchmarks examples"
