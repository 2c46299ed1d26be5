"""On-policy distillation end to end on CPU: ``flowrl train model=tiny graph=distill
trainer=smoke teacher=tiny`` (and graph=grpo_distill) with a tiny random teacher: the run ends in
its report, logs the reverse KL, the student moves and the teacher never does (no gradients, no
optimizer, no weight sync)."""
from __future__ import annotations

import json

import pytest
import torch

from flowrl.config import compose
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import train

BASE = ["model=tiny", "trainer=smoke", "teacher=tiny", "data.limit=64", "logger.progress=false",
        "logger.console=false", "logger.tensorboard=false", "trainer.eval.limit=2",
        "rollout.sampling.max_new_tokens=8", "trainer.eval.max_new_tokens=8"]


@pytest.fixture
def engines_built(monkeypatch):
    """The Engines the job builds, and a copy of the teacher's and the actor's initial weights."""
    from flowrl.runtime.step import resources

    seen: dict = {}
    real = resources.build_engines

    def spy(*a, **k):
        eng = real(*a, **k)
        seen["teacher"], seen["actor"] = eng.teacher, eng.actor
        seen["teacher0"] = {n: p.detach().clone() for n, p in eng.teacher.model.named_parameters()}
        seen["actor0"] = {n: p.detach().clone() for n, p in eng.actor.model.named_parameters()}
        return eng

    sink = resources.Engines.weight_sink

    def spy_sink(self, role):  # every weight sync of the run asks for its sink here
        seen.setdefault("synced", []).append(role)
        return sink(self, role)

    monkeypatch.setattr(resources, "build_engines", spy)
    monkeypatch.setattr(resources.Engines, "weight_sink", spy_sink)
    return seen


@pytest.mark.parametrize("graph", ["distill", pytest.param("grpo_distill", marks=pytest.mark.slow)])
def test_distill_trains_the_student_and_never_the_teacher(tmp_path, engines_built, graph):
    summary = train(compose(BASE + [f"graph={graph}", f"trainer.output_dir={tmp_path}"]))
    m = read_metrics(tmp_path)
    assert sorted(m) == [0, 1, 2]  # eval before, two steps
    for step in (1, 2):
        row = m[step]
        assert row["actor/optimizer_steps"] >= 1 and row["actor/grad_norm"] > 0
        # two different random models: the reverse KL is not 0 (exact values: tests/unit/test_distill.py)
        assert row["distill/reverse_kl"] != 0.0 and "time/teacher_logprobs" in row
    assert summary["history"][-1]["step"] == 2 and (tmp_path / "summary.json").is_file()
    teacher, actor = engines_built["teacher"], engines_built["actor"]
    assert teacher.trainable is False and teacher.optimizer is None  # frozen: no optimizer at all
    for n, p in teacher.model.named_parameters():
        assert not p.requires_grad and p.grad is None, n
        assert torch.equal(p.detach(), engines_built["teacher0"][n]), n  # unchanged after 2 steps
    moved = [n for n, p in actor.model.named_parameters()
             if not torch.equal(p.detach(), engines_built["actor0"][n])]
    assert moved  # the student did train
    assert engines_built["synced"] == ["rollout", "rollout"]  # one sync per update, into rollout only
    plan = (tmp_path / "plan.txt").read_text()
    assert "teacher served by its own frozen copy of tiny random llama (seed 1)" in plan
    state = json.loads((tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["trained_roles"] == ["actor"]  # the teacher is never checkpointed
