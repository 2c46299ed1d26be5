"""Distillation under placement=partitioned on 2 CPU ranks (gloo): the teacher beside the sampler
(``+placement.roles.teacher=rollout``) scores every batch on the rollout pool; its logprobs travel
to the train pool with the batch; the student trains on them; no weights ever go to the teacher.
About 2 minutes on 2 shared cores: the slow tier."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.runtime.io.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_teacher_on_the_rollout_pool(tmp_path):
    cmd = [sys.executable, "-m", "flowrl.cli", "train", "launcher.nproc=2", "placement=partitioned",
           "model=tiny", "graph=distill", "trainer=smoke", "teacher=tiny",
           "+placement.roles.teacher=rollout", "logger.progress=false", "trainer.eval.limit=2",
           "data.limit=64", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = read_metrics(tmp_path)
    for step in (1, 2):
        row = m[step]
        assert row["distill/reverse_kl"] != 0.0 and row["actor/grad_norm"] > 0
        # the rollout pool's store released the teacher's stage: it ran there (the pool split
        # itself: tests/unit/test_distill.py test_partitioned_teacher_lives_in_its_pool)
        assert "store/freed_bytes/teacher_logprobs/rollout" in row and "time/teacher_logprobs" in row
        assert row["placement/version_lag"] == 0.0
