"""SFT on teacher samples end to end on CPU: ``flowrl train graph=sft_teacher model=tiny
teacher=tiny trainer=smoke``: the student trains on exactly the tokens the teacher sampled that
step (by NLL), and the teacher is never trained, never given gradients and never synced."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config import compose
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import train

BASE = [
    "model=tiny",
    "trainer=smoke",
    "teacher=tiny",
    "graph=sft_teacher",
    "data.limit=64",
    "logger.progress=false",
    "logger.console=false",
    "logger.tensorboard=false",
    "trainer.eval.limit=2",
    "rollout.sampling.max_new_tokens=8",
    "trainer.eval.max_new_tokens=8",
]


@pytest.fixture
def spied(monkeypatch):
    """What the teacher sampled and what the actor trained on, per call; every weight sync's
    sink; the teacher's and the actor's initial weights."""
    from flowrl.runtime.step import resources

    seen: dict = {"sampled": [], "trained": [], "synced": []}
    real = resources.build_engines

    def spy(*a, **k):
        eng = real(*a, **k)
        teacher, actor = eng.teacher_rollout, eng.actor
        seen["teacher"], seen["actor"] = teacher, actor
        seen["teacher0"] = {n: p.detach().clone() for n, p in teacher.model.named_parameters()}
        seen["actor0"] = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
        generate, train_step = teacher.generate, actor.train_step

        def gen(*args, **kw):
            out = generate(*args, **kw)
            seen["sampled"].append((out.response_ids.clone(), out.response_mask.clone()))
            return out

        def step(batch, *args, **kw):
            seen["trained"].append((batch["response_ids"].clone(), batch["response_mask"].clone()))
            return train_step(batch, *args, **kw)

        teacher.generate, actor.train_step = gen, step
        return eng

    sink = resources.Engines.weight_sink

    def spy_sink(self, role):
        seen["synced"].append(role)
        return sink(self, role)

    monkeypatch.setattr(resources, "build_engines", spy)
    monkeypatch.setattr(resources.Engines, "weight_sink", spy_sink)
    return seen


def _rows(ids, mask):
    """The batch's rows as sorted (tokens under the mask) tuples: the update may reorder rows."""
    return sorted(tuple(r[m].tolist()) for r, m in zip(ids, mask))


def test_sft_trains_the_student_on_the_teachers_tokens(tmp_path, spied):
    summary = train(compose(BASE + [f"trainer.output_dir={tmp_path}"]))
    m = read_metrics(tmp_path)
    assert sorted(m) == [0, 1, 2]  # eval before, two steps
    assert (
        len(spied["sampled"]) == 2 and len(spied["trained"]) == 2
    )  # one sample, one update a step
    for (s_ids, s_mask), (t_ids, t_mask) in zip(spied["sampled"], spied["trained"]):
        assert _rows(t_ids, t_mask) == _rows(s_ids, s_mask)  # the teacher's tokens, all of them
        assert int(t_mask.sum()) == int(s_mask.sum()) > 0
    for step in (1, 2):
        row = m[step]
        assert row["actor/optimizer_steps"] >= 1 and row["actor/grad_norm"] > 0
        # a random 49,152-token model's NLL is near ln 49152 = 10.8 nats per token
        assert 9.0 < row["actor/nll"] < 12.0 and row["actor/sft_loss"] == pytest.approx(
            row["actor/nll"]
        )
        assert "teacher/response/length_mean" in row and "response/length_mean" in row
    teacher, actor = spied["teacher"], spied["actor"]
    for n, p in teacher.model.named_parameters():
        assert p.grad is None, n  # no backward ever reached the teacher
        assert torch.equal(p.detach(), spied["teacher0"][n]), n
    assert [
        n
        for n, p in actor.model.named_parameters()
        if not torch.equal(p.detach(), spied["actor0"][n])
    ]  # the student did train
    assert spied["synced"] == ["rollout", "rollout"]  # into the student's sampler only
    assert summary["history"][-1]["step"] == 2
    plan = (tmp_path / "plan.txt").read_text()
    assert "teacher_rollout served by a hf generation engine on its own frozen copy" in plan
    state = json.loads(
        (tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").read_text()
    )
    assert state["trained_roles"] == ["actor"]  # the teacher is never checkpointed
