"""On-policy distillation: the per-token reverse-KL advantage (exact values), the teacher role's
plan (placement, swaps, never synced), its logprobs, and the checks made before any model loads
(no teacher, a vocabulary that differs)."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, reverse_kl_advantages
from flowrl.algorithms.config import AlgorithmConfig
from flowrl.cli import main
from flowrl.config import compose
from flowrl.ops.context import StageContext
from flowrl.ops.registry import NoConfig, get_op, load_builtin_ops
from flowrl.runtime.control.preflight import ConfigError

REPO = Path(__file__).resolve().parents[2]
NAN, INF = float("nan"), float("inf")
# 2 rows x 4 tokens; row 0 has 3 valid tokens, row 1 has 2. Values are dyadic, so the
# differences below are exact in float32. Masked positions hold garbage (NaN, inf, big numbers)
# that must not leak into anything.
STUDENT = torch.tensor([[-1.0, -2.0, -0.5, NAN], [-0.25, -3.0, INF, -9.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -0.5, 7.0], [-1.25, -0.5, -INF, NAN]])
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])
# hand-computed: teacher - student at valid positions = -(reverse KL per token), 0 elsewhere
EXPECTED = torch.tensor([[0.5, -0.5, 0.0, 0.0], [-1.0, 2.5, 0.0, 0.0]])


def cfg_for(*overrides):
    return compose([*overrides, "trainer.output_dir=/tmp/flowrl-plan-only"])


# ----------------------------------------------------------------------------- the advantage

def test_advantage_is_the_negative_per_token_reverse_kl():
    adv = reverse_kl_advantages(STUDENT, TEACHER, MASK)
    assert adv.dtype == torch.float32
    assert torch.equal(adv, EXPECTED)


def test_coef_clip_and_task_advantages():
    # clip the log-ratio to [-1, 1] first, then weight by 0.5, then add the task advantage
    task = torch.tensor([[1.0, 1.0, 1.0, 5.0], [-0.5, -0.5, 3.0, 3.0]])
    adv = reverse_kl_advantages(STUDENT, TEACHER, MASK, coef=0.5, clip=1.0, task_advantages=task)
    assert torch.equal(adv, torch.tensor([[1.25, 0.75, 1.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]))


def test_masked_positions_contribute_nothing():
    """Whatever the masked positions hold, the advantages and the policy-gradient loss's
    gradient there are exactly 0, and the valid positions' are unchanged."""
    from flowrl.algorithms.losses import ppo_clip_loss

    other_s, other_t = STUDENT.clone(), TEACHER.clone()
    other_s[~MASK], other_t[~MASK] = 123.0, -77.0
    a1 = reverse_kl_advantages(STUDENT, TEACHER, MASK)
    a2 = reverse_kl_advantages(other_s, other_t, MASK)
    assert torch.equal(a1, a2) and torch.equal(a1[~MASK], torch.zeros(3))
    logp = torch.zeros(2, 4, requires_grad=True)
    per_token, _ = ppo_clip_loss(logp, logp.detach(), a1, MASK, clip_ratio_low=0.2, clip_ratio_high=0.2)
    (per_token.sum() / MASK.sum()).backward()  # token-mean
    assert torch.equal(logp.grad[~MASK], torch.zeros(3))
    # token-mean over 5 valid tokens: d(-A·ratio)/d logp = -A / 5 at ratio 1 (unclipped)
    assert torch.allclose(logp.grad[MASK], -EXPECTED[MASK] / 5, rtol=0, atol=1e-7)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"all \(B, R\); got \(2, 4\), \(2, 3\), \(2, 4\)"):
        reverse_kl_advantages(STUDENT, TEACHER[:, :3], MASK)


def test_registered_by_name_with_its_own_inputs():
    load_builtin_ops()
    est = ADVANTAGE_ESTIMATORS["distill"]
    assert est.needs_logprobs and not est.needs_groups and not est.produces_returns
    spec = get_op("advantage.distill")
    assert spec.inputs == ("response_mask", "old_logprobs", "teacher_logprobs")
    assert spec.optional_inputs == ("advantages",) and spec.outputs == ("advantages",)
    assert "teacher" in get_op("logprobs").roles
    with pytest.raises(ValueError, match="needs old_logprobs and teacher_logprobs"):
        est(response_mask=MASK, old_logprobs=STUDENT, cfg=AlgorithmConfig())


def test_op_reads_algorithm_numbers_and_logs_the_reverse_kl():
    load_builtin_ops()
    algo = AlgorithmConfig(distill_coef=2.0, distill_clip=1.0)
    ctx = StageContext(stage="advantage", step=1, resources={"algorithm": algo})
    out = get_op("advantage.distill").fn(ctx, NoConfig(), response_mask=MASK, old_logprobs=STUDENT,
                                         teacher_logprobs=TEACHER, advantages=None)
    # clip to [-1, 1], times 2: [[1, -1, 0], [-2, 2]]
    assert torch.equal(out["advantages"], torch.tensor([[1.0, -1.0, 0.0, 0.0], [-2.0, 2.0, 0.0, 0.0]]))
    m = ctx.metrics
    # reverse KL per valid token = student - teacher: -0.5, 0.5, 0, 1, -2.5 -> mean -0.3
    assert m["distill/reverse_kl"] == pytest.approx(-0.3, abs=1e-7)
    assert m["distill/reverse_kl_seq"] == pytest.approx((0.0 + -1.5) / 2, abs=1e-7)
    assert m["distill/clip_frac"] == pytest.approx(1 / 5, abs=1e-7)  # only |-2.5| > 1


def test_algorithm_numbers_are_checked():
    with pytest.raises(ValueError, match="algorithm.distill_coef must be >= 0, got -1"):
        AlgorithmConfig(distill_coef=-1)
    with pytest.raises(ValueError, match="algorithm.distill_clip must be > 0 or null, got 0"):
        AlgorithmConfig(distill_clip=0)


# ----------------------------------------------------------------------------- graphs and plans

@pytest.mark.parametrize("name", ["distill", "grpo_distill"])
def test_graph_files_open_with_command_and_round_trip(name):
    from flowrl.graph import Graph

    text = (REPO / "graphs" / f"{name}.yaml").read_text()
    head = [line for line in text.splitlines() if line.startswith("#")]
    assert any(f"flowrl train graph={name} teacher.path=" in line for line in head)
    assert any(f"flowrl train model=tiny graph={name} trainer=smoke teacher=tiny" in line for line in head)
    assert Graph.from_yaml(text).to_yaml() == text


def _actions(plan):
    return [(a.kind, a.stage or a.role) for a in plan.actions]


def test_colocated_plan_swaps_the_teacher_and_never_syncs_it(no_model):
    from flowrl.train import prepare

    spec = prepare(cfg_for("model=tiny", "graph=distill", "teacher=tiny"))
    cfg, plan = spec.config, spec.plan
    assert plan.roles == ["rollout", "teacher", "actor"]
    assert _actions(plan) == [
        ("run", "sample"), ("offload", "actor"), ("onload", "rollout"), ("run", "rollout"),
        ("run", "reward"), ("offload", "rollout"), ("onload", "teacher"),
        ("run", "teacher_logprobs"), ("offload", "teacher"), ("onload", "actor"),
        ("run", "old_logprobs"), ("run", "advantage"), ("run", "update"), ("sync", "update")]
    assert [(a.stage, a.role) for a in plan.actions if a.kind == "sync"] == [("update", "rollout")]
    assert plan.served_by["teacher"] == ("its own frozen copy of tiny random llama (seed 1) "
                                         "(no optimizer, never synced)")
    assert cfg.teacher.seed == 1 and cfg.teacher.tiny["hidden_size"] == 128
    assert no_model == []


def test_grpo_distill_adds_the_task_advantage(no_model):
    from flowrl.train import prepare

    plan = prepare(cfg_for("model=tiny", "graph=grpo_distill", "teacher=tiny")).plan
    ops = {c.stage.name: c.stage.op for c in plan.stages}
    assert ops["task_advantage"] == "advantage.grpo" and ops["advantage"] == "advantage.distill"
    assert plan.graph["advantage"].inputs["advantages"] == "task_advantage.advantages"
    assert plan.graph["update"].inputs["advantages"] == "advantage.advantages"
    assert plan.pruned == ["ref_logprobs"]  # kl_coef 0


def test_partitioned_teacher_lives_in_its_pool(no_model):
    from flowrl.runtime.control.preflight import prepare_placement
    from flowrl.train import prepare

    base = ("model=tiny", "graph=distill", "teacher=tiny", "launcher.nproc=2", "placement=partitioned")
    spec = prepare(cfg_for(*base))
    cfg, plan = spec.config, spec.plan
    pp = prepare_placement(cfg, plan, 2)
    assert pp.pools["train"].roles == ["teacher", "actor"] and pp.pools["rollout"].roles == ["rollout"]
    assert pp.weight_sync == [("actor", "rollout")]
    spec = prepare(cfg_for(*base, "+placement.roles.teacher=rollout"))
    cfg, plan = spec.config, spec.plan
    pp = prepare_placement(cfg, plan, 2)
    assert pp.pools["rollout"].roles == ["rollout", "teacher"]
    assert "teacher_logprobs.logprobs" in pp.transfers  # scored beside the sampler, then sent
    assert pp.weight_sync == [("actor", "rollout")]


def test_a_weight_sync_into_the_teacher_is_refused():
    from flowrl.graph import Graph, GraphError, validate_graph

    doc = (REPO / "graphs" / "distill.yaml").read_text().replace("  to: rollout", "  to: teacher_logprobs")
    with pytest.raises(GraphError, match="stage 'teacher_logprobs' \\(role teacher\\) does not serve "
                                         "role actor's weights"):
        validate_graph(Graph.from_yaml(doc))


def test_plan_prints_the_teacher_without_one_set(capsys, no_model):
    assert main(["plan", "graph=distill", "trainer.output_dir=/tmp/x"]) == 0
    out = capsys.readouterr().out
    assert "roles with a model: rollout, teacher, actor" in out
    assert ("teacher served by no model yet: flowrl train needs teacher.path=<HF dir or flowrl "
            "export> (teacher=tiny: a tiny random one)") in out
    # the role column is as wide as the longest stage name (teacher_logprobs: 16)
    assert f"onload  {'teacher':<16} (for teacher_logprobs)" in out
    assert f"offload {'teacher':<16} (before old_logprobs)" in out
    assert no_model == []


def test_plan_counts_the_teacher_and_warns_of_no_unused_output(capsys, no_model):
    """``flowrl plan graph=distill``: no UnusedOutputWarning (the graph's ``outputs`` lists drop
    sample.group_id and reward.rewards on purpose), and the predicted memory lists the teacher
    in its pool with its own size (tiny teacher: 4 layers x hidden 128 + the 49,152 x 128
    embedding and head, fp32) beside the student's."""
    from flowrl.graph import UnusedOutputWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnusedOutputWarning)
        assert main(["plan", "graph=distill", "model=tiny", "teacher=tiny",
                     "trainer.output_dir=/tmp/x"]) == 0
    assert [w for w in caught if issubclass(w.category, UnusedOutputWarning)] == []
    out = capsys.readouterr().out
    assert "warning:" not in out and "consumed by no stage" not in out
    line = next(ln for ln in out.splitlines() if ln.startswith("  pool all by role: "))
    from flowrl.compiler.footprint import fmt_bytes
    from flowrl.train import prepare

    spec = prepare(cfg_for("model=tiny", "graph=distill", "teacher=tiny"))
    teacher_bytes = spec.config.teacher.size().weight_bytes
    # 4 x (attention 2 x 128^2 + 2 x 128 x 64, MLP 3 x 128 x 256, 2 norms) + embedding + head
    # + final norm, 4 bytes each (ModelConfig.size() counts the embedding and the LM head apart)
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128
    assert teacher_bytes == 4 * (4 * per_layer + 2 * 49152 * 128 + 128)
    assert f"teacher {fmt_bytes(teacher_bytes)}" in line and "actor " in line
    # partitioned: the teacher sits in the train pool, counted there
    assert main(["plan", "graph=distill", "model=tiny", "teacher=tiny", "launcher.nproc=2",
                 "placement=partitioned", "trainer.output_dir=/tmp/x"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("  pool train by role: "))
    assert line.startswith(f"  pool train by role: teacher {fmt_bytes(teacher_bytes)}, actor ")
    assert no_model == []


# ----------------------------------------------------------------------------- checks before loading

def test_train_refuses_a_distill_graph_without_a_teacher(no_model):
    from flowrl.train import train

    with pytest.raises(ConfigError) as e:
        train(cfg_for("model=tiny", "graph=distill"))
    assert str(e.value) == ("stage 'teacher_logprobs' runs role teacher, but no teacher is set: give "
                            "teacher.path=<HF model dir or flowrl export> (it must share the "
                            "student's tokenizer), or teacher=tiny for a tiny random one")
    assert no_model == []


def _teacher_dir(tmp_path: Path, vocab_size: int) -> Path:
    folder = tmp_path / "teacher"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}))
    return folder


def test_a_teacher_with_another_vocab_size_is_refused_before_loading(tmp_path, no_model):
    from flowrl.train import train

    folder = _teacher_dir(tmp_path, 32000)
    with pytest.raises(ConfigError) as e:
        train(cfg_for("model=tiny", "graph=distill", f"teacher.path={folder}"))
    assert str(e.value) == (
        f"teacher.path: vocab_size 32000 ({folder}/config.json) differs from the student's 49152 "
        "(the bundled SmolLM2 tokenizer): on-policy distillation scores the student's token ids "
        "under the teacher, so both must share one tokenizer and vocabulary")
    assert "\n" not in str(e.value) and no_model == []
    with pytest.raises(ConfigError, match=r"teacher.path: vocab_size 1000 \(tiny.vocab_size\) "
                                          r"differs from the student's 49152"):
        train(cfg_for("model=tiny", "graph=distill", "teacher=tiny", "+teacher.tiny.vocab_size=1000"))


def test_a_teacher_tokenizer_with_other_ids_is_refused(tmp_path, no_model):
    from flowrl.models.bundled import bundled_tokenizer_dir
    from flowrl.train import prepare

    folder = _teacher_dir(tmp_path, 49152)
    tok = json.loads((bundled_tokenizer_dir() / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = vocab["a"], vocab["b"]
    vocab["a"], vocab["b"] = b, a  # same size, two ids swapped
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=r"teacher.path: the tokenizer of .* differs from the "
                                          f"student's .*: token 'a' has id {b} there and {a} in the student's"):
        prepare(cfg_for("model=tiny", "graph=distill", f"teacher.path={folder}"))
    # the student's own tokenizer files: accepted
    for f in bundled_tokenizer_dir().iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    prepare(cfg_for("model=tiny", "graph=distill", f"teacher.path={folder}"))
    assert no_model == []


def test_teacher_fields_are_checked():
    from flowrl.models.teacher import TeacherConfig

    with pytest.raises(ValueError, match="teacher.path must be 'smollm2' or an existing local directory"):
        TeacherConfig(path="/no/such/dir")
    with pytest.raises(ValueError, match="teacher.lora: the teacher is frozen"):
        TeacherConfig(tiny={"model_type": "llama"}, lora={"rank": 4})
    assert not TeacherConfig().is_set and TeacherConfig(tiny={"model_type": "llama"}).is_set


# ----------------------------------------------------------------------------- teacher logprobs

def test_teacher_logprobs_of_the_sampled_tokens():
    """The ``logprobs`` op as role teacher: (B, R) float32 log π_teacher(y_t) at the sampling
    temperature, 0 where response_mask is False, equal to a direct forward of the teacher."""
    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.models.loading import load_model
    from flowrl.models.teacher import TeacherConfig

    load_builtin_ops()
    teacher = load_model(TeacherConfig(tiny={"model_type": "llama", "hidden_size": 32,
                                             "num_hidden_layers": 1, "num_attention_heads": 2,
                                             "num_key_value_heads": 1, "intermediate_size": 64},
                                       seed=3))
    eng = LocalTrainEngine(teacher, TrainEngineConfig(), trainable=False)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 49152, (2, 3), generator=g)
    prompt_mask = torch.tensor([[False, True, True], [True, True, True]])
    response_ids = torch.randint(3, 49152, (2, 4), generator=g)
    response_mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    temp = 0.7
    ctx = StageContext(stage="teacher_logprobs", step=1, engine=eng,
                       resources={"sampling": SamplingConfig(temperature=temp)})
    from flowrl.ops.logprobs import LogprobsConfig

    lp = get_op("logprobs").fn(ctx, LogprobsConfig(), prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                               response_ids=response_ids, response_mask=response_mask)["logprobs"]
    assert lp.shape == (2, 4) and lp.dtype == torch.float32
    assert torch.equal(lp[~response_mask], torch.zeros(2))
    ids = torch.cat([prompt_ids, response_ids], 1)
    attn = torch.cat([prompt_mask, response_mask], 1)
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = teacher(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    ref = torch.log_softmax(logits[:, 2:-1] / temp, -1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp[response_mask], ref[response_mask], rtol=0, atol=1e-5)
    assert all(not p.requires_grad for p in teacher.parameters())
    assert math.isfinite(float(lp.sum()))
