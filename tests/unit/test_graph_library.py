"""The algorithm graph library: graphs/*.yaml in canonical form, one graph=<name> option per file
that composes and compiles (no model loaded), one advantage op per estimator, the in-reward KL op."""
import math
import warnings
from pathlib import Path

import pytest
import torch

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages
from flowrl.algorithms.config import AlgorithmConfig
from flowrl.cli import main
from flowrl.config import compose
from flowrl.graph import Graph, UnusedOutputWarning, validate_graph
from flowrl.ops.context import StageContext
from flowrl.ops.registry import OPS, NoConfig, get_op, load_builtin_ops

REPO = Path(__file__).resolve().parents[2]
NEW_GRAPHS = ["ppo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo"]
ALL_GRAPHS = ["grpo", *NEW_GRAPHS]


def cfg_for(*overrides):
    return compose([*overrides, "trainer.output_dir=/tmp/flowrl-plan-only"])


@pytest.mark.parametrize("name", NEW_GRAPHS)
def test_graph_file_round_trips(name):
    text = (REPO / "graphs" / f"{name}.yaml").read_text()
    assert Graph.from_yaml(text).to_yaml() == text  # round-trips


@pytest.mark.parametrize("name", ALL_GRAPHS)
def test_graph_files_open_with_command_and_validate(name):
    text = (REPO / "graphs" / f"{name}.yaml").read_text()
    head = [l for l in text.splitlines() if l.startswith("#")]
    assert any(f"flowrl train graph={name}" in l for l in head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnusedOutputWarning)
        validate_graph(Graph.load(REPO / "graphs" / f"{name}.yaml"))
    # REINFORCE++'s return-to-go has no consumer in a critic-free graph: its advantage stage's
    # `outputs` list leaves it out on purpose, so no graph warns
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("name", ALL_GRAPHS)
def test_graph_option_is_the_file_and_its_algorithm_block(name):
    from flowrl.config import graph_options

    assert not (REPO / "conf" / "graph").exists()  # one source per graph: graphs/<name>.yaml
    g = Graph.load(REPO / "graphs" / f"{name}.yaml")
    node = {"graph": {"path": f"graphs/{name}.yaml"}}
    assert graph_options()[name] == ({**node, "algorithm": g.algorithm} if g.algorithm else node)


EXPECTED_ALGO = {
    "grpo": {"loss_agg_mode": "token-mean", "kl_in_reward": False},
    "dr_grpo": {"loss_agg_mode": "seq-mean-token-sum-norm"},
    "dapo": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean",
             "mask_truncated": True, "kl_coef": 0.0},
    "rloo": {"loss_agg_mode": "token-mean"},
    "reinforce_pp": {"kl_in_reward": True, "kl_coef": 0.01, "kl_type": "k1"},
    "gspo": {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
             "loss_agg_mode": "seq-mean-token-mean"},
    "ppo": {"kl_in_reward": True, "kl_coef": 0.01, "kl_type": "k1", "lam": 0.95, "vf_coef": 0.5},
}
EXPECTED_OPS = {"grpo": "advantage.grpo", "dr_grpo": "advantage.dr_grpo", "dapo": "advantage.grpo",
                "rloo": "advantage.rloo", "reinforce_pp": "advantage.reinforce_pp",
                "gspo": "advantage.grpo", "ppo": "advantage.gae"}


@pytest.mark.parametrize("name", ALL_GRAPHS)
def test_graph_config_composes_and_compiles(name):
    from flowrl.train import prepare

    spec = prepare(cfg_for(f"graph={name}"))
    cfg, plan = spec.config, spec.plan  # default model/data; no model is loaded
    assert cfg.graph.path == f"graphs/{name}.yaml" and plan.graph.name == name
    for k, v in EXPECTED_ALGO[name].items():
        assert getattr(cfg.algorithm, k) == v, k
    assert [c.stage.op for c in plan.stages if c.stage.op.startswith("advantage.")] == [EXPECTED_OPS[name]]
    # the policy loss is chosen by the update stage's param (its registered name), nowhere else
    update = next(c for c in plan.stages if c.stage.op == "update.policy")
    assert update.config.policy_loss == ("gspo" if name == "gspo" else "ppo_clip")
    # a command-line override still beats the graph config
    cfg2 = prepare(cfg_for(f"graph={name}", "algorithm.loss_agg_mode=seq-mean-token-sum")).config
    assert cfg2.algorithm.loss_agg_mode == "seq-mean-token-sum"


def test_ppo_plan_has_critic_swaps_and_ref_with_kl(capsys):
    assert main(["plan", "graph=ppo", "trainer.output_dir=/tmp/x"]) == 0
    out = capsys.readouterr().out
    assert "roles with a model: rollout, ref, actor, critic" in out
    assert "onload  critic" in out and "offload critic" in out
    for stage in ("values", "token_rewards", "advantage", "update_critic", "update"):
        assert f"run     {stage} " in out
    plan = __import__("flowrl.train", fromlist=["prepare"]).prepare(
        cfg_for("graph=ppo", "algorithm.kl_coef=0")).plan
    assert plan.pruned == ["ref_logprobs"] and "ref" not in plan.roles


def test_group_estimator_with_n1_is_a_cli_error_before_any_model(capsys, monkeypatch):
    assert main(["plan", "graph=rloo", "algorithm.n=1", "trainer.output_dir=/tmp/x"]) == 2
    err = capsys.readouterr().err
    assert "stage 'advantage'" in err and "algorithm.n must be >= 2" in err and "'rloo'" in err
    import flowrl.train as train_mod

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("flowrl.runtime.step.resources.build_engines", boom)
    monkeypatch.setattr("flowrl.models.loading.load_tokenizer", boom)
    with pytest.raises(ValueError, match="algorithm.n must be >= 2"):
        train_mod.train(cfg_for("graph=dr_grpo", "algorithm.n=1", "model=tiny"))
    monkeypatch.undo()  # `flowrl plan` reads the tokenizer (the prompts' length), never a model
    # estimators without groups accept n = 1
    assert main(["plan", "graph=reinforce_pp", "algorithm.n=1", "trainer.output_dir=/tmp/x"]) == 0
    assert main(["plan", "graph=ppo", "algorithm.n=1", "trainer.output_dir=/tmp/x"]) == 0


def test_kl_in_reward_without_token_rewards_stage_is_rejected():
    from flowrl.train import prepare

    with pytest.raises(ValueError, match="no 'reward.token_rewards' stage"):
        prepare(cfg_for("graph=grpo", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1"))
    prepare(cfg_for("graph=grpo", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0"))  # nothing to drop


# ----------------------------------------------------------------------------- advantage ops

def test_one_advantage_op_per_estimator_with_returns_from_the_attribute():
    load_builtin_ops()
    names = {k.split(".", 1)[1] for k in OPS if k.startswith("advantage.")}
    assert names == set(ADVANTAGE_ESTIMATORS)
    for name, est in ADVANTAGE_ESTIMATORS.items():
        spec = get_op(f"advantage.{name}")
        assert spec.outputs == (("advantages", "returns") if est.produces_returns else ("advantages",))
        if est.needs_logprobs:  # distillation reads logprobs, not rewards (tests/unit/test_distill.py)
            continue
        assert spec.inputs[:3] == ("rewards", "group_id", "response_mask")
        assert set(spec.all_inputs) == {"rewards", "group_id", "response_mask", "token_rewards", "values"}
    assert {n for n, e in ADVANTAGE_ESTIMATORS.items() if e.produces_returns} == \
        {"gae", "reinforce_pp", "reinforce_pp_baseline"}
    assert get_op("advantage.gae").inputs == ("rewards", "group_id", "response_mask", "token_rewards", "values")


def ctx(algo=None, **resources):
    return StageContext(stage="advantage", step=1,
                        resources={"algorithm": algo or AlgorithmConfig(), **resources})


def test_grpo_op_values_and_metrics_unchanged():
    rewards = torch.tensor([1.0, 0.0, float("nan"), 0.5])
    gid = torch.tensor([7, 7, 7, 7])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    c = ctx()
    out = get_op("advantage.grpo").fn(c, NoConfig(), rewards=rewards, group_id=gid, response_mask=mask)
    assert set(out) == {"advantages"}
    torch.testing.assert_close(out["advantages"], grpo_advantages(rewards, gid, mask), rtol=0, atol=0)
    a = 0.5 / (0.5 + 1e-6)  # scorable rewards [1, 0, 0.5]: mean 0.5, sample std 0.5
    torch.testing.assert_close(out["advantages"][:2], torch.tensor([[a, a, 0], [-a, 0, 0]]))
    assert c.metrics["advantage/zero_frac"] == 0.5  # the NaN sample and the one at the mean
    assert c.metrics["advantage/mean"] == pytest.approx(0.0, abs=1e-6)
    assert c.metrics["advantage/abs_mean"] == pytest.approx(a / 2, rel=1e-6)


def test_gae_op_case_c06_with_returns():
    algo = AlgorithmConfig(gamma=1.0, lam=0.95, whiten_advantages=False)
    c = ctx(algo)
    out = get_op("advantage.gae").fn(
        c, NoConfig(), rewards=torch.tensor([1.0]), group_id=torch.tensor([0]),
        response_mask=torch.tensor([[True, True, False]]),
        token_rewards=torch.tensor([[0.0, 1.0, 0.0]]), values=torch.tensor([[0.0, 0.0, 100.0]]))
    torch.testing.assert_close(out["advantages"], torch.tensor([[0.95, 1.0, 0.0]]))
    torch.testing.assert_close(out["returns"], torch.tensor([[0.95, 1.0, 0.0]]))
    assert c.metrics["returns/mean"] == pytest.approx(0.975)


def test_reinforce_pp_op_return_to_go():
    algo = AlgorithmConfig(gamma=0.5)
    c = ctx(algo)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = get_op("advantage.reinforce_pp").fn(c, NoConfig(), rewards=torch.tensor([1.0, 2.0]),
                                              group_id=torch.tensor([0, 1]), response_mask=mask)
    # reward on the last valid token, discounted backwards by γ = 0.5
    torch.testing.assert_close(out["returns"], torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    x = torch.tensor([0.25, 0.5, 1.0, 1.0, 2.0], dtype=torch.float64)  # whitened over valid tokens
    w = ((x - x.mean()) / (x.std() + 1e-6)).float()
    torch.testing.assert_close(out["advantages"], torch.tensor([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]))


# ----------------------------------------------------------------------------- in-reward KL

REW = torch.tensor([1.0, float("nan"), 0.5])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
OLD = torch.tensor([[-1.0, -2.0, -1.0, 9.0], [-1.0, -1.0, 9.0, 9.0], [-0.5, 9.0, 9.0, 9.0]])
REF = torch.tensor([[-1.5, -2.0, -0.5, 0.0], [-1.0, -2.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])


def run_token_rewards(algo, **res):
    c = StageContext(stage="token_rewards", step=1, resources={"algorithm": algo, **res})
    out = get_op("reward.token_rewards").fn(c, NoConfig(), rewards=REW, response_mask=MASK,
                                            old_logprobs=OLD, ref_logprobs=REF)
    return out["token_rewards"], c


def test_token_rewards_k1_penalty_exact():
    tr, c = run_token_rewards(AlgorithmConfig(kl_in_reward=True, kl_coef=0.1, kl_type="k1"))
    # k1 = old − ref: [.5, 0, −.5], [0, 1], [.5]; reward on the last valid token (NaN → 0)
    torch.testing.assert_close(tr, torch.tensor([[-0.05, 0.0, 1.05, 0.0], [0.0, -0.1, 0.0, 0.0],
                                                 [0.45, 0.0, 0.0, 0.0]]))
    assert c.metrics["kl/coef"] == pytest.approx(0.1)
    assert c.metrics["kl/in_reward"] == pytest.approx(0.5)  # mean of per-sequence sums [0, 1, .5]
    assert c.metrics["reward/kl_penalty_mean"] == pytest.approx(0.05)
    assert c.metrics["reward/token_sum_mean"] == pytest.approx(1.35 / 3)
    assert c.resources["kl_controller"].value == 0.1  # fixed controller (no kl_target)


def test_token_rewards_without_kl_in_reward_only_places_the_reward():
    tr, c = run_token_rewards(AlgorithmConfig(kl_in_reward=False, kl_coef=0.1))
    torch.testing.assert_close(tr, torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 0], [0.5, 0, 0, 0]]))
    assert "kl/coef" not in c.metrics and "kl_controller" not in c.resources


def test_adaptive_controller_updates_once_per_batch_and_state_round_trips():
    from flowrl.ops.token_rewards import controller_state, load_controller_state, make_kl_controller

    algo = AlgorithmConfig(kl_in_reward=True, kl_coef=0.1, kl_type="k1", kl_target=0.25, kl_horizon=10)
    ctrl = make_kl_controller(algo)
    _, c = run_token_rewards(algo, kl_controller=ctrl)
    assert c.metrics["kl/coef"] == pytest.approx(0.1)  # β used for this batch
    # e = clip(0.5 / 0.25 − 1, ±0.2) = 0.2; β ← 0.1 · (1 + 0.2 · 3 / 10)
    assert ctrl.value == pytest.approx(0.106)
    fresh = make_kl_controller(algo)
    load_controller_state(fresh, controller_state(ctrl))
    assert fresh.value == ctrl.value
    _, c2 = run_token_rewards(algo, kl_controller=fresh)
    assert c2.metrics["kl/coef"] == pytest.approx(0.106)


def test_token_rewards_missing_ref_is_an_error_naming_the_stage():
    c = StageContext(stage="tr", step=1,
                     resources={"algorithm": AlgorithmConfig(kl_in_reward=True, kl_coef=0.1)})
    with pytest.raises(ValueError, match="stage 'tr'.*ref_logprobs"):
        get_op("reward.token_rewards").fn(c, NoConfig(), rewards=REW, response_mask=MASK,
                                          old_logprobs=OLD)


def test_kl_loss_term_off_when_kl_is_in_the_reward():
    from flowrl.ops.update import make_policy_loss_fn

    mb = {"response_mask": MASK, "old_logprobs": OLD, "advantages": torch.ones(3, 4),
          "ref_logprobs": REF}
    for in_reward, has_kl in ((False, True), (True, False)):
        algo = AlgorithmConfig(kl_coef=0.5, kl_in_reward=in_reward)
        fn = make_policy_loss_fn(algo, "ppo_clip", num_tokens=6.0, num_seqs=3.0, max_response_len=4)
        loss, m = fn(mb, OLD.clone(), None)
        assert ("actor/kl_loss" in m) == has_kl
        assert math.isfinite(loss.item())
        assert m["actor/ratio_abs_dev_sum"] == 0.0  # logprobs == old_logprobs: ratio exactly 1
