"""Run-health guards (issue 27): skipped optimizer steps counted and budgeted, constant rewards
reported, unscorable / empty responses counted, a failed (empty) generation never scored 0."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.errors import RunStopped
from flowrl.runtime.control.health import RunHealth

REPO = Path(__file__).resolve().parents[2]


def _health(**kw) -> RunHealth:
    args = dict(max_skipped_steps=10, max_skipped_frac=0.5, constant_reward_steps=3, total_steps=20)
    return RunHealth(**{**args, **kw})


def _step(skipped: float, steps: int = 1, std: float = 0.1) -> dict:
    return {"actor/skipped": skipped, "actor/optimizer_steps": float(steps), "reward/std": std,
            "reward/mean": 0.25}


def test_skipped_steps_are_counted_cumulatively_over_roles_and_mini_batches():
    h = _health()
    rows = []
    for s, m in enumerate([_step(0.0, 2), _step(0.5, 2), {**_step(1.0, 1), "critic/skipped": 1.0,
                                                          "critic/optimizer_steps": 1.0}], 1):
        h.update(s, m)
        rows.append((m["train/skipped_steps"], m["train/optimizer_steps"]))
    assert rows == [(0.0, 2.0), (1.0, 4.0), (3.0, 6.0)]


def test_more_skipped_steps_than_the_budget_stop_the_run_naming_the_setting():
    h = _health(max_skipped_steps=2, max_skipped_frac=1.0)
    h.update(1, _step(1.0))
    h.update(2, _step(1.0))
    with pytest.raises(RunStopped) as e:
        h.update(3, _step(1.0))
    assert str(e.value).startswith("step 3: 3 optimizer steps skipped (non-finite loss or grad "
                                   "norm), more than trainer.max_skipped_steps=2")


def test_steps_with_no_scorable_sample_stop_the_run_at_the_budget():
    """A reward function that raises on every sample: the run trained on nothing and finished
    with exit status 0 (fresh-user report); now the third such step in a row stops it, and a
    partly scorable step resets the count."""
    h = _health(max_unscorable_steps=3)
    nan = float("nan")
    for s, frac in enumerate([1.0, 1.0, 0.5, 1.0, 1.0], 1):
        m = {**_step(0.0, std=nan), "reward/mean": nan, "train/unscorable_frac": frac}
        h.update(s, m)
        assert m["train/unscorable_steps"] == [1.0, 2.0, 0.0, 1.0, 2.0][s - 1]
    with pytest.raises(RunStopped) as e:
        h.update(6, {**_step(0.0), "train/unscorable_frac": 1.0})
    assert str(e.value).startswith("step 6: no sample could be scored on the last 3 steps "
                                   "(train/unscorable_frac = 1")
    assert "trainer.max_unscorable_steps=3" in str(e.value)
    off = _health(max_unscorable_steps=0)  # 0 = never stop
    for s in range(1, 6):
        off.update(s, {**_step(0.0), "train/unscorable_frac": 1.0})


def test_an_unreadable_judge_is_named_as_the_cause_of_unscorable_steps():
    """graph=genrm_grpo with a judge whose answers hold no score: nothing raised, yet the stop
    message said the reward function raised or timed out (fresh-user report)."""
    h = _health(max_unscorable_steps=2)
    judge = {"train/unscorable_frac": 1.0, "reward/genrm/unparseable_frac": 1.0}
    h.update(1, {**_step(0.0), **judge})
    with pytest.raises(RunStopped) as e:
        h.update(2, {**_step(0.0), **judge})
    assert str(e.value) == (
        "step 2: no sample could be scored on the last 2 steps (train/unscorable_frac = 1: the "
        "judge's answer could not be read as a score for any of them, "
        "reward/genrm/unparseable_frac = 1), so the run trains on no reward "
        "(trainer.max_unscorable_steps=2). Fix the judge (its model, prompt or answer length), or "
        "raise trainer.max_unscorable_steps")


def test_the_skipped_fraction_is_judged_from_the_fourth_step():
    h = _health()
    for s in (1, 2, 3):  # 3 of 3 skipped: not judged yet
        h.update(s, _step(1.0))
    with pytest.raises(RunStopped) as e:
        h.update(4, _step(0.0))  # 3 of 4 = 0.75 > 0.5
    assert "3 of 4 optimizer steps skipped" in str(e.value)
    assert "fraction 0.75 above trainer.max_skipped_frac=0.5" in str(e.value)


def test_a_short_run_that_skipped_everything_fails_at_its_last_step():
    h = _health(total_steps=2)
    h.update(1, _step(1.0))
    with pytest.raises(RunStopped, match="2 of 2 optimizer steps skipped"):
        h.update(2, _step(1.0))


def test_one_nan_step_in_six_is_within_the_default_budget():
    h = _health()
    for s in range(1, 7):
        h.update(s, _step(1.0 if s == 6 else 0.0))
    assert h.skipped == 1 and h.optimizer_steps == 6


def test_a_resume_continues_the_counts_from_the_history():
    h = _health(max_skipped_steps=3, max_skipped_frac=1.0)
    h2 = RunHealth(3, 1.0, 3, 20, [{"step": 1}, {"step": 2, "train/skipped_steps": 3.0,
                                                 "train/optimizer_steps": 2.0,
                                                 "reward/constant_steps": 2.0}])
    m = _step(0.0, std=0.0)
    h2.update(3, m)
    assert (m["train/skipped_steps"], m["train/optimizer_steps"], m["reward/constant_steps"]) == \
        (3.0, 3.0, 3.0)
    with pytest.raises(RunStopped):
        h2.update(4, _step(1.0))
    h.update(1, _step(0.0))
    assert h.skipped == 0


def test_constant_rewards_are_counted_and_warned_every_n_steps(caplog):
    h = _health(constant_reward_steps=2)
    counts = []
    with caplog.at_level(logging.WARNING, logger="flowrl.runtime.control.health"):
        for s, std in enumerate([0.0, 0.0, 0.0, 0.3, 0.0, 0.0], 1):
            m = _step(0.0, std=std)
            h.update(s, m)
            counts.append(m["reward/constant_steps"])
    assert counts == [1.0, 2.0, 3.0, 0.0, 1.0, 2.0]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert warned[0].startswith("step 2: every scorable reward of the last 2 steps was the same "
                                "(reward/mean=0.25, reward/std=0)")
    # another rank than 0 (speak=False) counts alike and says nothing: the metrics are reduced,
    # so rank 0's line is every rank's
    caplog.clear()
    quiet = _health(constant_reward_steps=2, speak=False)
    with caplog.at_level(logging.WARNING, logger="flowrl.runtime.control.health"):
        quiet_counts = []
        for s, std in enumerate([0.0, 0.0, 0.0, 0.3, 0.0, 0.0], 1):
            m = _step(0.0, std=std)
            quiet.update(s, m)
            quiet_counts.append(m["reward/constant_steps"])
    assert quiet_counts == counts and caplog.records == []


def test_a_step_without_a_scorable_reward_leaves_the_constant_count_alone():
    h = _health(constant_reward_steps=2)
    counts = []
    for s, mean in enumerate([0.25, float("nan"), 0.25], 1):  # step 2: every reward unscorable
        m = {**_step(0.0, std=0.0), "reward/mean": mean}
        h.update(s, m)
        counts.append(m.get("reward/constant_steps"))
    # old code: [1.0, 2.0, 3.0] (reward/std is 0 when nothing is scorable)
    assert counts == [1.0, None, 2.0]


def test_the_health_counters_are_in_the_console_line_only_when_not_zero(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from flowrl.config import LoggerConfig
    from flowrl.runtime.io import metrics as M

    out = io.StringIO()
    monkeypatch.setattr(M, "Console", lambda **kw: Console(file=out, **kw))
    cfg = LoggerConfig(progress=False, jsonl=False, tensorboard=False)
    zero = {"train/skipped_steps": 0.0, "train/unscorable_frac": 0.0,
            "rollout/empty_response_frac": 0.0, "reward/constant_steps": 0.0}
    with M.MetricsLogger(tmp_path, cfg, 2) as log:
        log.log(1, {"reward/mean": 0.5, **zero})
        log.log(2, {"reward/mean": 0.5, "train/skipped_steps": 2.0, "train/unscorable_frac": 0.25,
                    "rollout/empty_response_frac": 0.125, "reward/constant_steps": 3.0})
    assert out.getvalue().splitlines() == [
        "step    1 reward=0.500",
        "step    2 reward=0.500 skipped=2 unscorable=0.25 empty=0.12 const_reward=3"]


class _Ctx:
    """The StageContext surface the reward helpers use."""

    stage = "reward"

    def __init__(self):
        self.logged: dict = {}

    def log(self, **kw):
        self.logged.update({k: float(v) for k, v in kw.items()})


def test_an_empty_generation_is_unscorable_not_zero_and_counted():
    from flowrl.ops.reward import log_reward_stats, mark_empty_unscorable

    ctx = _Ctx()
    mask = torch.tensor([[True, True], [False, False], [True, False], [False, False]])
    r = mark_empty_unscorable(ctx, torch.tensor([1.0, 0.0, 0.0, 0.0]), mask)
    assert r[0].item() == 1.0 and r[2].item() == 0.0 and r[1].isnan() and r[3].isnan()
    log_reward_stats(ctx, r)
    assert ctx.logged["reward/empty"] == 2.0
    assert ctx.logged["train/unscorable_frac"] == 0.5
    assert ctx.logged["reward/mean"] == 0.5


@pytest.mark.slow
def test_a_run_that_skips_every_step_stops_with_one_line_and_exit_1(tmp_path):
    """Dr.GRPO with rewards ±3e38: the advantages overflow float32, every optimizer step is
    skipped; before the guard the run printed warnings and exited 0 having trained nothing."""
    import yaml

    (tmp_path / "huge_reward.py").write_text(
        "def huge(response_text, fields, metadata):\n"
        "    return 3e38 if metadata['index'] % 2 else -3e38\n")
    g = yaml.safe_load((REPO / "graphs/dr_grpo.yaml").read_text())
    reward = next(s for s in g["stages"] if s["name"] == "reward")
    reward.update(op="reward.function", params={"path": "huge_reward:huge"})
    reward["inputs"]["group_id"] = "sample.group_id"
    graph = tmp_path / "graph.yaml"
    graph.write_text(yaml.safe_dump(g, sort_keys=False))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl.train", "model=tiny", "trainer=smoke", "data.limit=16",
         f"graph.path={graph}", "logger.progress=false", "logger.tensorboard=false",
         "trainer.eval.before=false", "trainer.eval.after=false", "trainer.total_steps=6",
         f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{tmp_path}:{REPO}"})
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("flowrl train: stopped: step 4: 4 of 4 optimizer steps skipped "
                           "(non-finite loss or grad norm), a fraction 1.00 above "
                           "trainer.max_skipped_frac=0.5"), last
    assert "trainer.resume=true" in last or "trainer.overwrite=true" in last
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("train/skipped_steps") for r in rows if "train/skipped_steps" in r] == \
        [1.0, 2.0, 3.0, 4.0]


def test_a_run_that_never_scored_a_sample_says_so_at_its_end(caplog):
    """Shorter than the stop budget, it finished with reward=nan and exit status 0, unsaid."""
    import logging

    judge = {"train/unscorable_frac": 1.0, "reward/genrm/unparseable_frac": 1.0}
    h = _health(max_unscorable_steps=3, total_steps=2)
    with caplog.at_level(logging.WARNING):
        h.update(1, {**_step(0.0), **judge})
        assert not caplog.records
        h.update(2, {**_step(0.0), **judge})
    assert [r.getMessage() for r in caplog.records] == [
        "no sample of the run's 2 steps could be scored (the judge's answer could not be read as "
        "a score for any of them, reward/genrm/unparseable_frac = 1): it trained on no reward"]
    caplog.clear()
    partly = _health(max_unscorable_steps=3, total_steps=2)
    with caplog.at_level(logging.WARNING):
        partly.update(1, {**_step(0.0), "train/unscorable_frac": 0.5})
        partly.update(2, {**_step(0.0), "train/unscorable_frac": 1.0})
    assert not caplog.records
