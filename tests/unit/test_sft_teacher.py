"""SFT on teacher samples (graphs/sft_teacher.yaml): the ``nll`` loss on hand-computed logits
(every loss_agg_mode, its gradient, masked garbage), the ``update.sft`` op on a tiny model, the
teacher_rollout role's plan (placement, never synced) and the checks made before any model loads.
The run end to end: tests/integration/test_sft_teacher_train.py."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from flowrl.algorithms.logprobs import token_logprobs
from flowrl.algorithms.losses import SFT_LOSSES, aggregate_loss, loss_denominators, nll_loss
from flowrl.cli import main
from flowrl.config import compose
from flowrl.ops.context import StageContext
from flowrl.ops.registry import get_op, load_builtin_ops
from flowrl.runtime.control.preflight import ConfigError

REPO = Path(__file__).resolve().parents[2]
LN2, LN10 = math.log(2.0), math.log(10.0)
# 2 rows x 3 positions x vocabulary 4. Row 0 has 2 valid tokens, row 1 one. Valid positions:
#   [0, 0] all-equal logits, label 1:            log p = log 1/4            -> NLL 2 ln 2
#   [0, 1] logits (ln 3, 0, 0, 0), label 0:      p = 3 / (3 + 3) = 1/2       -> NLL ln 2
#   [1, 0] logits (ln 7, 0, 0, 0), label 2:      p = 1 / (7 + 3) = 1/10      -> NLL ln 10
# Masked positions hold large finite logits: they must not count.
LOGITS = torch.tensor(
    [
        [[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0], [90.0, -40.0, 7.0, 1.0]],
        [[math.log(7.0), 0.0, 0.0, 0.0], [50.0, 50.0, -50.0, 0.0], [-80.0, 3.0, 60.0, 2.0]],
    ]
)
LABELS = torch.tensor([[1, 0, 3], [2, 1, 0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])
NLL = torch.tensor([[2 * LN2, LN2, 0.0], [LN10, 0.0, 0.0]])


def cfg_for(*overrides):
    return compose([*overrides, "trainer.output_dir=/tmp/flowrl-plan-only"])


def _agg(per_tok, mode):
    n_tok, n_seq = loss_denominators(MASK)
    return aggregate_loss(per_tok, MASK, mode, num_tokens=n_tok, num_seqs=n_seq, max_response_len=3)


# ----------------------------------------------------------------------------- the nll loss


def test_nll_of_hand_computed_logits_per_token():
    per_tok, stats = nll_loss(token_logprobs(LOGITS, LABELS), MASK)
    assert per_tok.dtype == torch.float32
    torch.testing.assert_close(per_tok, NLL, rtol=0, atol=1e-6)
    assert torch.equal(per_tok[~MASK], torch.zeros(3)) and torch.equal(stats["nll"], per_tok)
    assert SFT_LOSSES["nll"] is nll_loss  # registered by name, as the policy losses


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (3 * LN2 + LN10) / 3),  # 3 valid tokens
        ("seq-mean-token-mean", (1.5 * LN2 + LN10) / 2),  # row means (3 ln 2)/2 and ln 10
        ("seq-mean-token-sum", (3 * LN2 + LN10) / 2),  # row sums over 2 rows
        ("seq-mean-token-sum-norm", (3 * LN2 + LN10) / 6),  # / (2 rows x max length 3)
    ],
)
def test_loss_agg_mode_is_respected(mode, expected):
    per_tok, _ = nll_loss(token_logprobs(LOGITS, LABELS), MASK)
    assert float(_agg(per_tok, mode)) == pytest.approx(expected, rel=1e-6)


def test_gradient_is_softmax_minus_onehot_over_the_token_count():
    logits = LOGITS.clone().requires_grad_(True)
    per_tok, _ = nll_loss(token_logprobs(logits, LABELS), MASK)
    _agg(per_tok, "token-mean").backward()
    g = logits.grad
    expected_00 = (torch.full((4,), 0.25) - torch.eye(4)[1]) / 3
    expected_10 = (torch.tensor([0.7, 0.1, 0.1, 0.1]) - torch.eye(4)[2]) / 3
    torch.testing.assert_close(g[0, 0], expected_00, rtol=0, atol=1e-7)
    torch.testing.assert_close(g[1, 0], expected_10, rtol=0, atol=1e-7)
    assert torch.equal(g[~MASK], torch.zeros(3, 4))  # masked positions train nothing


def test_masked_garbage_reaches_neither_loss_nor_gradient():
    lp = torch.tensor(
        [[-1.5, -0.25, float("nan")], [-2.0, -float("inf"), float("inf")]], requires_grad=True
    )
    per_tok, _ = nll_loss(lp, MASK)
    assert torch.equal(per_tok, torch.tensor([[1.5, 0.25, 0.0], [2.0, 0.0, 0.0]]))
    _agg(per_tok, "token-mean").backward()
    third = 1.0 / 3.0
    assert torch.equal(lp.grad, torch.tensor([[-third, -third, 0.0], [-third, 0.0, 0.0]]))


def test_an_undeclared_sft_loss_is_refused():
    from flowrl.algorithms.losses import register_sft_loss
    from flowrl.ops.update import SFTUpdateConfig

    with pytest.raises(
        ValueError, match="SFT loss 'kl' is not declared in flowrl/algorithms/variants.py"
    ):
        register_sft_loss("kl")
    with pytest.raises(ValueError, match=r"loss must be one of \['nll'\], got 'mse'"):
        SFTUpdateConfig(loss="mse")
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        SFTUpdateConfig(temperature=0)


# ----------------------------------------------------------------------------- the update.sft op


def test_update_sft_trains_the_nll_of_the_given_tokens():
    """One optimizer step of ``update.sft`` on a tiny model: the loss it reports is the token-mean
    NLL of exactly the responses it was given (a direct forward at T = 1, the op's default),
    and the weights move."""
    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.engines.config import TrainEngineConfig
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.models.loading import ModelConfig, load_model
    from flowrl.ops.update import SFTUpdateConfig

    load_builtin_ops()
    spec = get_op("update.sft")
    assert spec.inputs == ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    assert spec.optional_inputs == ("truncated",) and spec.roles == ("actor",) and spec.trains
    model = load_model(
        ModelConfig(
            tiny={
                "model_type": "llama",
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "intermediate_size": 64,
            },
            seed=5,
        )
    )
    eng = LocalTrainEngine(model, TrainEngineConfig(lr=1e-3), trainable=True)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 49152, (2, 3), generator=g)
    prompt_mask = torch.tensor([[False, True, True], [True, True, True]])
    response_ids = torch.randint(3, 49152, (2, 4), generator=g)
    response_mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    ids = torch.cat([prompt_ids, response_ids], 1)
    attn = torch.cat([prompt_mask, response_mask], 1)
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, 2:-1], -1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    expected = float(-lp[response_mask].mean())  # token-mean over the 5 valid tokens
    ctx = StageContext(
        stage="update",
        step=1,
        engine=eng,
        generator=torch.Generator().manual_seed(1),
        resources={"algorithm": AlgorithmConfig(loss_agg_mode="token-mean")},
    )
    out = spec.fn(
        ctx,
        SFTUpdateConfig(),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
    )
    assert out == {}
    m = ctx.metrics
    assert m["actor/sft_loss"] == pytest.approx(expected, abs=1e-5)
    assert m["actor/nll"] == pytest.approx(expected, abs=1e-5)  # per-token mean NLL
    assert m["actor/optimizer_steps"] == 1 and m["actor/grad_norm"] > 0
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- graph and plan


def test_graph_file_opens_with_command_round_trips_and_validates_silently():
    from flowrl.graph import Graph, GraphWarning, validate_graph

    text = (REPO / "graphs" / "sft_teacher.yaml").read_text()
    head = [line for line in text.splitlines() if line.startswith("#")]
    assert any("flowrl train graph=sft_teacher teacher.path=" in line for line in head)
    assert any(
        "flowrl train model=tiny graph=sft_teacher trainer=smoke teacher=tiny" in line
        for line in head
    )
    assert Graph.from_yaml(text).to_yaml() == text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        assert validate_graph(Graph.from_yaml(text)) == []
    assert caught == []


def test_plan_the_teacher_samples_and_is_never_synced(no_model):
    from flowrl.train import prepare

    plan = prepare(cfg_for("model=tiny", "graph=sft_teacher", "teacher=tiny")).plan
    assert plan.roles == ["teacher_rollout", "rollout", "actor"]
    assert [(a.stage, a.role) for a in plan.actions if a.kind == "sync"] == [("update", "rollout")]
    upd = plan.graph["update"]
    assert upd.op == "update.sft" and upd.inputs["response_ids"] == "teacher_rollout.response_ids"
    assert upd.inputs["response_mask"] == "teacher_rollout.response_mask"
    assert plan.served_by["teacher_rollout"] == (
        "a hf generation engine on its own frozen copy of tiny random llama (seed 1) "
        "(samples the SFT targets; never synced)"
    )
    assert no_model == []


def test_partitioned_the_teacher_samples_on_the_rollout_pool(no_model):
    from flowrl.runtime.control.preflight import prepare_placement
    from flowrl.train import prepare

    spec = prepare(
        cfg_for(
            "model=tiny",
            "graph=sft_teacher",
            "teacher=tiny",
            "launcher.nproc=2",
            "placement=partitioned",
        )
    )
    pp = prepare_placement(spec.config, spec.plan, 2)
    assert pp.pools["rollout"].roles == ["teacher_rollout", "rollout"]
    assert pp.pools["train"].roles == ["actor"]
    assert "teacher_rollout.response_ids" in pp.transfers
    assert pp.weight_sync == [("actor", "rollout")]


def test_a_weight_sync_into_the_teacher_sampler_is_refused():
    from flowrl.graph import Graph, GraphError, validate_graph

    doc = (
        (REPO / "graphs" / "sft_teacher.yaml")
        .read_text()
        .replace("  to: rollout", "  to: teacher_rollout")
    )
    with pytest.raises(
        GraphError,
        match="stage 'teacher_rollout' \\(role teacher_rollout\\) does "
        "not serve role actor's weights",
    ):
        validate_graph(Graph.from_yaml(doc))


def test_plan_text_counts_the_teacher_sampler(capsys, no_model):
    assert (
        main(
            ["plan", "graph=sft_teacher", "model=tiny", "teacher=tiny", "trainer.output_dir=/tmp/x"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "roles with a model: teacher_rollout, rollout, actor" in out
    assert "onload  teacher_rollout (for teacher_rollout)" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("  pool all by role: "))
    assert line.startswith("  pool all by role: teacher_rollout ") and "warning" not in out
    assert no_model == []


def test_train_refuses_sft_teacher_without_a_teacher(no_model):
    from flowrl.train import train

    with pytest.raises(ConfigError) as e:
        train(cfg_for("model=tiny", "graph=sft_teacher"))
    assert str(e.value) == (
        "stage 'teacher_rollout' runs role teacher_rollout, but no teacher is "
        "set: give teacher.path=<HF model dir or flowrl export> (it must share "
        "the student's tokenizer), or teacher=tiny for a tiny random one"
    )
    assert no_model == []


def test_teacher_sampler_settings_keep_its_weights_and_its_own_process():
    """The teacher's generation engine takes ``rollout`` as it is, except what would lose or mix
    its weights: a level-2 vLLM sleep (nothing ever reloads them), an in-process engine beside
    the student's, the student's export folder."""
    import dataclasses

    from flowrl.config import RolloutConfig
    from flowrl.runtime.step.resources import teacher_rollout_config

    plain = RolloutConfig()
    assert teacher_rollout_config(plain) is plain
    student = dataclasses.replace(
        plain,
        backend="vllm",
        vllm=dataclasses.replace(
            plain.vllm, sleep_level=2, engine_procs=0, model_dir="/tmp/export/"
        ),
    )
    t = teacher_rollout_config(student)
    assert (t.vllm.sleep_level, t.vllm.engine_procs, t.vllm.model_dir) == (
        1,
        1,
        "/tmp/export_teacher",
    )
    assert (student.vllm.sleep_level, student.vllm.engine_procs) == (
        2,
        0,
    )  # the student's unchanged
    assert dataclasses.replace(t, vllm=student.vllm) == student  # nothing else differs


def test_the_teacher_sampler_is_no_weight_sink_and_is_closed():
    """A weight sync can never load into the teacher's sampler (only ``rollout``/``genrm`` take
    weights); the engine set hands it to its stage by role and closes it on the way out."""
    from flowrl.runtime.step.resources import Engines

    closed = []

    class Fake:
        def close(self):
            closed.append(self)

    teacher, student = Fake(), Fake()
    eng = Engines(teacher_rollout=teacher, rollout=student)  # type: ignore[arg-type]
    assert eng.get("teacher_rollout") is teacher and "teacher_rollout" in eng
    with pytest.raises(
        KeyError, match="no generation engine takes weights as role 'teacher_rollout'"
    ):
        eng.weight_sink("teacher_rollout")
    assert eng.weight_sink("rollout") is student
    eng.close()
    assert closed == [student, teacher] and eng.teacher_rollout is None and eng.by_role() == {}
