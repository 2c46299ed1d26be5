"""GPU tier: ``flowrl train launcher.mps=true`` with vLLM engine processes, as a user runs it.

The job starts a CUDA MPS daemon of its own (``runtime/control/mps.py``): the trainer and both
engine processes must join it (the job logs the daemon's server and client list after the engines
are built), the run must train as it does without MPS (finite metrics, the rollout-vs-trainer
mismatch within the tier's bound: weights reach the engines by CUDA IPC between MPS clients), and
the daemon must be gone once the job has exited. Skipped where the driver has no MPS tool.
"""
from __future__ import annotations

import math
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from test_train_gpu import MEAN_TOL, TINY, VLLM, cli, has_vllm, read_metrics

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not has_vllm(), reason="needs vLLM"),
              pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None,
                                 reason="needs nvidia-cuda-mps-control (NVIDIA's driver utilities)")]


def test_train_with_the_jobs_own_mps_daemon(tmp_path):
    run = tmp_path / "run"
    r = cli("train", *TINY, *VLLM, "rollout.vllm.engine_procs=2", "launcher.mps=true",
            f"hydra.run.dir={run}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    pipe = re.search(r"resolved launcher\.mps=true \(asked for; this job's daemon: "
                     r"CUDA_MPS_PIPE_DIRECTORY=(\S+)\)", out)
    assert pipe, out[-3000:]
    served = re.search(r"CUDA MPS: server (\d+) serves (\d+) process\(es\) of this job", out)
    assert served, out[-3000:]
    assert int(served[2]) >= 3  # the trainer and its two engine processes
    m = read_metrics(run)
    steps = [s for s in sorted(m) if s >= 1]
    assert steps == [1, 2]
    for s in steps:
        assert all(math.isfinite(v) for v in m[s].values() if isinstance(v, float)), (s, m[s])
    assert m[1]["rollout/logprob_mismatch"] < MEAN_TOL
    # the watcher quits the daemon and removes its directory once the job's process is gone
    root = Path(pipe[1]).parent
    deadline = time.monotonic() + 20
    while root.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not root.exists()
