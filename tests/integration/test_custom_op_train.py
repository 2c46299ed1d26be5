"""``flowrl train`` (the console script, as a user runs it) from ``examples/custom_op``: the
graph's ``imports`` registers its own op from the working directory and the op's metric is
logged at every step."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.runtime.io.metrics import read_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_op"
FLOWRL = Path(sys.executable).parent / "flowrl"  # the console script of this environment


@pytest.mark.skipif(not FLOWRL.is_file(), reason="flowrl's console script is not installed")
def test_train_the_example_graph_with_its_own_op(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the op's module must come from the working directory
    stray = EXAMPLE / "outputs"
    before = sorted(stray.rglob("train.log")) if stray.exists() else []
    proc = subprocess.run(
        [str(FLOWRL), "train", "graph.path=grpo_brevity.yaml", "model=tiny", "trainer=smoke",
         "trainer.total_steps=2", "data.limit=32", "trainer.eval.before=false",
         "trainer.eval.after=false", "logger.progress=false", "logger.tensorboard=false",
         f"trainer.output_dir={tmp_path}"],
        cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_metrics(tmp_path)
    assert sorted(m) == [1, 2]
    assert all(0.0 <= m[s]["reward/brevity/bonus_mean"] <= 0.1 for s in (1, 2))
    assert "run     brevity        op=reward.brevity" in (tmp_path / "plan.txt").read_text()
    # Hydra's files are the run's too: none left in the working directory's ./outputs
    assert (tmp_path / "train.log").is_file() and (tmp_path / ".hydra" / "config.yaml").is_file()
    assert (sorted(stray.rglob("train.log")) if stray.exists() else []) == before
