"""`flowrl train rollout=vllm placement=partitioned|auto launcher.nproc=2`: train pool [0], rollout pool
[1] whose vLLM runs in an engine process with a torch world of its own (engines/rollout/vllm_proc.py).

The tiny random model earns no reward; the entropy bonus and lr 0.01 make every update move the
weights, so ``rollout/logprob_mismatch`` (sampler vs trainer logprobs of the same tokens) tells
which weight version the rollout pool's vLLM sampled with: < 1e-4 for the trainer's version, above
1e-2 for one version older (the k = 1 run measures that side: 0.16-0.29 on this setup).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from flowrl.config import compose, to_train_config
from flowrl.models.loading import load_model
from flowrl.runtime.io.metrics import read_metrics

TOL = 1e-4  # fp32 rollout vs trainer logprobs, see test_vllm_engine.py
STALE = 1e-2  # one update behind, at lr 0.01
REPO = Path(__file__).resolve().parents[2]
ARGS = ["rollout=vllm", "model=tiny", "trainer=smoke", "data.limit=64",
        "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1",
        "rollout.vllm.kv_cache_memory_gb=0.25", "rollout.vllm.max_model_len=1024",
        "rollout.vllm.enforce_eager=true", "algorithm.entropy_coef=0.01",
        "trainer.engine.lr=0.01", "logger.progress=false", "logger.tensorboard=false",
        "trainer.eval.before=false", "trainer.eval.after=false",
        # these tests read rollout/logprob_mismatch every step (how a stale weight sync shows);
        # the vLLM default (sampled) measures steps 1, 9, 17, ... only
        "rollout.sampling.logprobs=all"]


def run_partitioned(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # capture_output waits for EOF on the pipes, which the spawned engine processes inherit:
    # returning at all (before the timeout) means none of them outlived the job
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", "launcher.nproc=2",
                           "placement=partitioned", *ARGS, f"trainer.output_dir={out}", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc


def model_bytes() -> int:
    cfg = to_train_config(compose(ARGS + ["trainer.output_dir=/tmp/unused"]))
    return sum(t.numel() * t.element_size() for t in load_model(cfg.model).state_dict().values())


def test_k0_rollout_pool_samples_with_the_broadcast_weights(tmp_path):
    run_partitioned(tmp_path, "trainer.total_steps=3", "placement.staleness=0")
    m = read_metrics(tmp_path)
    assert sorted(m) == [1, 2, 3]
    assert [m[s]["placement/version_lag"] for s in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert [m[s]["placement/rollout_version"] for s in (1, 2, 3)] == [0.0, 1.0, 2.0]
    for s in (1, 2, 3):
        assert m[s]["actor/grad_norm"] > 0  # the update moved the weights
        assert m[s]["rollout/logprob_mismatch"] < TOL, (s, m[s]["rollout/logprob_mismatch"])
        assert m[s]["rollout/logprob_mismatch_max"] < 10 * TOL
    # versions 1 and 2 are broadcast after steps 1 and 2 (step 3's would have no reader):
    # the whole fp32 model each time
    full = float(model_bytes())
    assert [m[s].get("perf/weight_sync_bytes/train") for s in (1, 2, 3)] == [full, full, None]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["version_lags"] == [0, 0, 0] and summary["placement"] == "partitioned"


def test_k1_lags_one_version_after_warmup(tmp_path):
    run_partitioned(tmp_path, "trainer.total_steps=4", "placement.staleness=1")
    m = read_metrics(tmp_path)
    assert [m[s]["placement/version_lag"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert [m[s]["placement/rollout_version"] for s in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 2.0]
    assert json.loads((tmp_path / "summary.json").read_text())["version_lags"] == [0, 1, 1, 1]
    assert m[1]["rollout/logprob_mismatch"] < TOL  # step 1: both pools hold version 0
    for s in (2, 3, 4):  # sampled one update behind the trainer: the metric sees it
        assert m[s]["rollout/logprob_mismatch"] > STALE, (s, m[s]["rollout/logprob_mismatch"])


def test_auto_profiles_vllm_then_switches_to_partitioned(tmp_path):
    # the profile's colocated vLLM runs in engine processes: an in-process one's shutdown would
    # destroy the job's process group before phase 2 (rank 1 then got no decision and crashed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "tests" / "distributed" / "auto_worker.py"), *ARGS, "placement=auto",
         "trainer.total_steps=4", "placement.auto.profile_steps=2", f"trainer.output_dir={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "placement=auto chose partitioned {'train': [0], 'rollout': [1]}" in proc.stdout
    m = read_metrics(tmp_path)
    assert [m[s].get("placement/version_lag") for s in (1, 2, 3, 4)] == [None, None, 0.0, 0.0]
    assert [m[s]["data/prompts"] for s in (1, 2, 3, 4)] == [4.0, 4.0, 4.0, 4.0]
    for s in (1, 2, 3, 4):  # phase 2's rollout pool got the profiled actor's weights
        assert m[s]["rollout/logprob_mismatch"] < TOL, (s, m[s]["rollout/logprob_mismatch"])
