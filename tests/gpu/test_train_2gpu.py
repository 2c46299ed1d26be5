"""Two-GPU tier (issue 18): ``flowrl train launcher.nproc=2`` as a user runs it, for the GRPO, PPO
and GenRM graphs under every placement (colocated; partitioned at staleness 0 and 1; auto), with
``rollout=hf`` and ``rollout=vllm``, plus a resume of a 2-rank checkpoint onto 1 rank and back.
Opt-in: ``pytest -m gpu tests/gpu/test_train_2gpu.py`` on a machine with >= 2 CUDA devices (the
``nvidia-h200-x2`` kind); skipped otherwise. Results go to ``benchmarks/results/gpu_tier_2gpu.md``.

Asserted per run: exit 0, finite metrics on every step, the rollout-vs-trainer mismatch under the
bf16 bound of the one-GPU tier (tests/gpu/test_train_gpu.py), ``placement/version_lag <= k`` under
partitioned placements, a checkpoint, and no process of the run left behind.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train_gpu import MEAN_TOL, TINY, VLLM, has_vllm, read_metrics

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PLACEMENTS = {
    "colocated": ["placement=colocated"],
    "partitioned_k0": ["placement=partitioned", "placement.staleness=0"],
    "partitioned_k1": ["placement=partitioned", "placement.staleness=1"],
    "auto": ["placement=auto", "trainer.total_steps=3"],
}
GRAPHS = {"grpo": [], "ppo": ["trainer.critic_lr=1e-3"], "genrm_grpo": []}
BACKENDS = {"hf": ["rollout=hf"],
            "vllm": [*VLLM, "rollout.vllm.enforce_eager=true"]}


def flowrl(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    # NCCL's NVLink multicast stays off on the lent machines (KINDS.md)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    return subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def leftover_processes(run_dir: Path) -> list[str]:
    """Processes still running whose command line names this run's directory."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if str(run_dir) in cmd:
            out.append(cmd[:200])
    return out


def check_run(run: Path, staleness: int | None) -> dict[int, dict]:
    m = read_metrics(run)
    steps = [s for s in sorted(m) if s >= 1]
    assert steps, "no step was logged"
    for s in steps:
        row = m[s]
        for k, v in row.items():
            if isinstance(v, float):
                assert math.isfinite(v), (s, k, v)
        if "rollout/logprob_mismatch" in row:
            assert row["rollout/logprob_mismatch"] < MEAN_TOL, (s, row["rollout/logprob_mismatch"])
        if staleness is not None and "placement/version_lag" in row:
            assert row["placement/version_lag"] <= staleness, s
    assert any((run / "checkpoints").glob("step_*/trainer_state.json"))
    assert not leftover_processes(run)
    return m


@pytest.mark.parametrize("backend", [
    "hf", pytest.param("vllm", marks=[pytest.mark.vllm,
                                      pytest.mark.skipif(not has_vllm(), reason="needs vLLM")])])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("graph", sorted(GRAPHS))
def test_two_ranks(tmp_path, graph, placement, backend):
    run = tmp_path / "run"
    res = flowrl("train", "launcher.nproc=2", *TINY, f"hydra.run.dir={run}", f"graph={graph}",
                 *GRAPHS[graph], *PLACEMENTS[placement], *BACKENDS[backend])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    k = {"partitioned_k0": 0, "partitioned_k1": 1}.get(placement)
    check_run(run, k)
    if placement == "auto":
        choice = json.loads((run / "placement_auto.json").read_text())
        assert choice  # auto says what it chose and what it predicted


def test_resume_two_ranks_onto_one_and_back(tmp_path):
    run = tmp_path / "run"
    base = [*TINY, f"hydra.run.dir={run}", "rollout=hf"]
    first = flowrl("train", "launcher.nproc=2", *base)
    assert first.returncode == 0, first.stderr[-3000:]
    one = flowrl("train", *base, "trainer.total_steps=3", "trainer.resume=true")
    assert one.returncode == 0, one.stderr[-3000:]
    assert "continuing at step 3" in one.stdout + one.stderr
    back = flowrl("train", "launcher.nproc=2", *base, "trainer.total_steps=4", "trainer.resume=true")
    assert back.returncode == 0, back.stderr[-3000:]
    m = check_run(run, None)
    assert [s for s in sorted(m) if s >= 1][:4] == [1, 2, 3, 4]
