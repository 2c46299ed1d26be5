"""placement=auto at run time: profile colocated steps, choose, continue from the checkpoint.

The end-to-end test forces the post-profile choice to a partitioned split (on a tiny CPU model the
cost model always keeps colocated), so the real switch runs: a colocated checkpoint of 2 FSDP ranks
resumed by a train pool [0] + rollout pool [1] with the same global batch."""
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from flowrl.runtime.control import auto

REPO = Path(__file__).resolve().parents[2]
ARGS = ["model=tiny", "trainer=smoke", "data.limit=64", "logger.progress=false",
        "logger.tensorboard=false", "trainer.eval.before=false", "trainer.eval.after=false",
        "placement=auto", "trainer.total_steps=4", "placement.auto.profile_steps=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_switch_to_partitioned_keeps_global_batch_and_weights_in_sync(tmp_path):
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "distributed" / "auto_worker.py"), *ARGS,
                           f"trainer.output_dir={tmp_path}"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["data/prompts"] for r in steps] == [4, 4, 4, 4]  # 2 ranks x 2, then 1 rank x 4
    assert [r.get("placement/version_lag") for r in steps] == [None, None, 0, 0]
    # the rollout pool's copy got the profiled actor's weights (a stale copy would be far off)
    assert all(r["rollout/logprob_mismatch"] < 1e-4 for r in steps)
    decision = json.loads((tmp_path / auto.DECISION_FILE).read_text())
    assert decision["mode"] == "partitioned" and decision["prompts_per_step"] == 4
    assert decision["notes"][0] == ("auto: refined from 1 measured colocated step(s) (steps 2-2 "
                                    "of the profile; step 1 is warm-up)")
    # the refit's P is step 2's padded prompt width (it kept the data.max_prompt_tokens bound)
    p = int(steps[1]["data/prompt_length_max"])
    assert 0 < p < 256 and f"P={p}, R=" in " ".join(decision["notes"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [h["step"] for h in summary["history"]] == [1, 2, 3, 4]
    line = summary["placement_auto"]["line"]
    assert line.startswith("placement=auto chose partitioned {'train': [0], 'rollout': [1]}: "
                           "predicted step ")
    assert summary["placement_auto"]["measured_step_s"] == pytest.approx(steps[-1]["perf/step_s"])
    assert line in proc.stdout
    # each phase says what it is; the profile's end does not read like the run's (its closing
    # "checkpoint: ..." line came after step 2)
    assert ("placement=auto: profiling steps 1-2 of 4 colocated; then the cost model chooses the "
            "placement of steps 3-4 from what they measured\n") in proc.stdout
    assert "placement=auto: steps 3-4 partitioned {'train': [0], 'rollout': [1]}\n" in proc.stdout
    assert proc.stdout.count("checkpoint: ") == 1
    assert f"checkpoint: {tmp_path}/checkpoints/step_000004" in proc.stdout
    assert proc.stdout.count("done: ") == 1 and "(step 3 finished at " in proc.stdout  # the run's end


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_a_job_no_longer_than_the_profile_keeps_its_final_eval(tmp_path):
    """total_steps <= profile_steps: the profile is the job, so its final eval runs and the
    console says there was nothing to choose (the eval was skipped without a word)."""
    args = [a for a in ARGS if not a.startswith("trainer.eval.after=")]
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "distributed" / "auto_worker.py"), *args,
                           "trainer.total_steps=2", "trainer.eval.limit=4",
                           f"trainer.output_dir={tmp_path}"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert ("placement=auto: the job's 2 steps fit in the profile (placement.auto.profile_steps=2): "
            "colocated throughout, nothing to choose\n") in proc.stdout
    assert len((tmp_path / "eval_after.jsonl").read_text().splitlines()) == 4
    assert "eval_after" in json.loads((tmp_path / "summary.json").read_text())
    assert not (tmp_path / auto.DECISION_FILE).exists()


def _cfg(prompts=3, backend="hf"):
    return SimpleNamespace(trainer=SimpleNamespace(prompts_per_step=prompts),
                           rollout=SimpleNamespace(backend=backend))


def test_decide_scales_prompts_to_keep_the_global_batch(monkeypatch):
    pools = {"train": SimpleNamespace(ranks=[0, 1]), "rollout": SimpleNamespace(ranks=[2, 3])}
    pp = SimpleNamespace(mode="partitioned", pools=pools, notes=["n"],
                         estimate=SimpleNamespace(step_s=2.5))
    monkeypatch.setattr("flowrl.compiler.cost.StageCosts.from_config", lambda *a, **k: None)
    monkeypatch.setattr("flowrl.compiler.cost.refine_and_choose", lambda *a, **k: pp)
    monkeypatch.setattr("flowrl.runtime.control.preflight.role_parallelism", lambda cfg: {})
    d = auto.decide(_cfg(3), None, 4, [{"perf/step_s": 1.0}])
    assert d == {"mode": "partitioned", "notes": ["n"], "predicted_step_s": 2.5,
                 "prompts_per_step": 6, "profile_steps": 1,
                 "pools": {"train": [0, 1], "rollout": [2, 3]}}
    pools["rollout"].ranks = [1, 2, 3]  # 12 prompts over 3 rollout ranks: 4 each
    pools["train"].ranks = [0]
    assert auto.decide(_cfg(3), None, 4, [{}])["prompts_per_step"] == 4
    d = auto.decide(_cfg(1), None, 4, [{}])  # 4 prompts do not split over 3 ranks
    assert d["mode"] == "colocated" and d["prompts_per_step"] == 1
    assert d["notes"][-1] == "kept colocated: 4 prompts per step do not split over 3 rollout ranks"
    d = auto.decide(_cfg(3, backend="vllm"), None, 4, [{}])  # vLLM runs partitioned too
    assert d["mode"] == "partitioned" and d["prompts_per_step"] == 4 and d["notes"] == ["n"]
    assert d["pools"] == {"train": [0], "rollout": [1, 2, 3]}


def test_read_step_metrics_merges_rows_and_skips_eval(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "eval/accuracy": 0.1}, {"step": 1, "perf/step_s": 2.0, "time/rollout": 1.0},
        {"step": 1, "perf/checkpoint_s": 0.5}, {"step": 2, "perf/step_s": 3.0, "x": None},
        {"step": 3, "perf/step_s": 4.0}]))
    rows = auto.read_step_metrics(tmp_path, 1, 2)
    assert rows == [{"step": 1, "perf/step_s": 2.0, "time/rollout": 1.0, "perf/checkpoint_s": 0.5},
                    {"step": 2, "perf/step_s": 3.0}]
