import math

import pytest
import torch

from flowrl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    place_on_last_token,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten,
)
from flowrl.algorithms.config import AlgorithmConfig
from flowrl.algorithms.variants import validate_estimator

NAN = float("nan")


def mask_from_lengths(lengths, R):
    return torch.arange(R) < torch.as_tensor(lengths)[:, None]


def test_grpo_values_bessel_std_eps_and_dtype():
    r = torch.tensor([1.0, 0.0, 0.0, 2.0])
    mask = mask_from_lengths([3, 1, 2, 0], 3)
    mask[3, 0] = True
    adv = grpo_advantages(r, torch.zeros(4, dtype=torch.long), mask, eps=0.1)
    std = r.double().std()  # Bessel
    exp = (r.double() - r.double().mean()) / (std + 0.1)
    assert adv.dtype == torch.float32 and adv.shape == (4, 3)
    torch.testing.assert_close(adv[:, 0].double(), exp, rtol=1e-6, atol=1e-7)
    assert (adv[~mask] == 0).all() and torch.equal(adv[0], adv[0, :1].expand(3))


def test_grpo_singleton_group_and_no_std():
    r = torch.tensor([1.0, 3.0, 5.0])
    adv = grpo_advantages(r, torch.tensor([0, 0, 9]), torch.ones(3, 2, dtype=torch.bool), norm_by_std=False)
    assert adv[:, 0].tolist() == [-1.0, 1.0, 0.0]
    torch.testing.assert_close(dr_grpo_advantages(r, torch.tensor([0, 0, 9]), torch.ones(3, 2, dtype=torch.bool)),
                               adv)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "rloo_std", "reinforce_pp_baseline"])
def test_unscorable_samples_leave_siblings_unchanged(name):
    """NaN reward or zero valid tokens: excluded from group stats, advantage 0 everywhere."""
    est, cfg = ADVANTAGE_ESTIMATORS[name], AlgorithmConfig()
    R = 4
    clean_r = torch.tensor([1.0, 0.0, 0.5, 2.0])
    clean_gid = torch.tensor([3, 3, 3, 8])
    clean_mask = mask_from_lengths([4, 2, 3, 1], R)
    # add a NaN-reward sample and an empty response to group 3, and an empty one to group 8
    r = torch.cat([clean_r, torch.tensor([NAN, 7.0, 9.0])])
    gid = torch.cat([clean_gid, torch.tensor([3, 3, 8])])
    mask = torch.cat([clean_mask, mask_from_lengths([4, 0, 0], R)])
    base, _ = est(rewards=clean_r, group_id=clean_gid, response_mask=clean_mask, cfg=cfg)
    adv, _ = est(rewards=r, group_id=gid, response_mask=mask, cfg=cfg)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[4:], torch.zeros(3, R))
    if name == "reinforce_pp_baseline":  # batch whitening: same scorable set → same stats
        torch.testing.assert_close(adv[:4], base, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(adv[:4], base)


def test_group_with_one_scorable_sample_is_zero():
    r = torch.tensor([1.0, NAN, NAN])
    adv = grpo_advantages(r, torch.zeros(3, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool))
    assert torch.equal(adv, torch.zeros(3, 2))
    assert torch.equal(rloo_advantages(r, torch.zeros(3, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool)),
                       torch.zeros(3, 2))


def test_grpo_stable_with_large_offset():
    r = torch.tensor([1e4, 1e4 + 1, 1e4, 1e4 + 1])
    adv = grpo_advantages(r, torch.zeros(4, dtype=torch.long), torch.ones(4, 1, dtype=torch.bool), eps=0)
    x = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-x, x, -x, x]))


def test_rloo_plain_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0])
    adv = rloo_advantages(r, torch.tensor([0, 0, 0, 0, 5]), torch.ones(5, 1, dtype=torch.bool))
    # r_i − mean of the other three
    assert adv[:, 0].tolist() == pytest.approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 0.0])
    # equals n/(n−1)·(r − mean)
    torch.testing.assert_close(adv[:4, 0], 4 / 3 * (r[:4] - r[:4].mean()))


def test_rloo_std_values():
    r = torch.tensor([0.0, 1.0, 3.0])
    adv = rloo_advantages(r, torch.zeros(3, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool),
                          norm_by_std=True, eps=0.0)
    exp = [(0 - 2) / math.sqrt(2), (1 - 1.5) / math.sqrt(4.5), (3 - 0.5) / math.sqrt(0.5)]
    assert adv[:, 0].tolist() == pytest.approx(exp, rel=1e-6)


def test_discounted_returns_and_last_token_placement():
    mask = mask_from_lengths([3, 1, 0], 4)
    tr = place_on_last_token(torch.tensor([2.0, 5.0, NAN]), mask)
    assert tr.tolist() == [[0, 0, 2, 0], [5, 0, 0, 0], [0, 0, 0, 0]]
    tr[0, 0] = -1.0
    ret = discounted_returns(tr, mask, gamma=0.5)
    assert ret.tolist() == [[-1 + 0.5 * 0.5 * 2, 0.5 * 2, 2, 0], [5, 0, 0, 0], [0, 0, 0, 0]]


def test_reinforce_pp_whitens_return_to_go_over_the_batch():
    mask = mask_from_lengths([3, 2], 3)
    tr = torch.tensor([[0.1, -0.2, 1.0], [0.0, 0.5, 9.0]])
    adv, ret = reinforce_pp_advantages(tr, mask, gamma=1.0, eps=0.0)
    exp_ret = torch.tensor([[0.9, 0.8, 1.0], [0.5, 0.5, 0.0]])
    torch.testing.assert_close(ret, exp_ret)
    v = exp_ret[mask].double()
    torch.testing.assert_close(adv[mask].double(), (v - v.mean()) / v.std(), rtol=1e-5, atol=1e-6)
    assert adv[1, 2] == 0


def test_reinforce_pp_baseline_is_group_centred_then_whitened():
    r = torch.tensor([1.0, 0.0, 3.0, 1.0])
    gid = torch.tensor([0, 0, 1, 1])
    mask = mask_from_lengths([2, 1, 1, 2], 2)
    adv, ret = reinforce_pp_baseline_advantages(r, gid, mask, eps=0.0)
    # centred: [.5, -.5, 1, -1] as return-to-go on every valid token (γ = 1)
    exp_ret = torch.tensor([[0.5, 0.5], [-0.5, 0], [1.0, 0], [-1.0, -1.0]])
    torch.testing.assert_close(ret, exp_ret)
    v = exp_ret[mask].double()
    torch.testing.assert_close(adv[mask].double(), (v - v.mean()) / v.std(), rtol=1e-5, atol=1e-6)


def test_whiten_constant_and_masked():
    x = torch.tensor([[3.0, 3.0, NAN]])
    m = torch.tensor([[True, True, False]])
    assert torch.equal(whiten(x, m), torch.zeros(1, 3))
    assert torch.equal(whiten(x, m, shift_mean=False), torch.tensor([[3.0, 3.0, 0.0]]))


def test_gae_gamma_lambda_values():
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.5, 1.0, 1.5]]), mask, gamma=0.9, lam=0.8)
    d2 = 2 - 1.5
    d1 = 0 + 0.9 * 1.5 - 1.0
    d0 = 1 + 0.9 * 1.0 - 0.5
    a2, a1 = d2, d1 + 0.72 * d2
    a0 = d0 + 0.72 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 1.0, a2 + 1.5]]))


def test_registry_calling_convention_and_flags():
    cfg = AlgorithmConfig(n=2)
    B, R = 4, 3
    kw = dict(rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]), group_id=torch.tensor([0, 0, 1, 1]),
              response_mask=torch.ones(B, R, dtype=torch.bool), token_rewards=torch.rand(B, R),
              values=torch.rand(B, R), old_logprobs=-torch.rand(B, R),
              teacher_logprobs=-torch.rand(B, R), cfg=cfg)  # distill reads the last two
    assert {"grpo", "dr_grpo", "rloo", "rloo_std", "reinforce_pp", "reinforce_pp_baseline", "gae"} <= set(
        ADVANTAGE_ESTIMATORS)
    for name, est in ADVANTAGE_ESTIMATORS.items():
        adv, ret = est(**kw)
        assert adv.shape == ret.shape == (B, R) and adv.dtype == ret.dtype == torch.float32, name
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
    assert ADVANTAGE_ESTIMATORS["gae"].needs_values
    with pytest.raises(ValueError, match="values"):
        ADVANTAGE_ESTIMATORS["gae"](**{**kw, "values": None})
    with pytest.raises(ValueError, match="group_id"):
        ADVANTAGE_ESTIMATORS["grpo"](**{**kw, "group_id": None})
    with pytest.raises(ValueError, match="unknown"):
        validate_estimator("nope", 4)
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long), torch.ones(3, 1, dtype=torch.bool))


def test_registry_grpo_follows_config():
    kw = dict(rewards=torch.tensor([1.0, 0.0]), group_id=torch.tensor([0, 0]),
              response_mask=torch.ones(2, 1, dtype=torch.bool))
    # Dr.GRPO's centring without the std is its own estimator (not a config flag)
    a, _ = ADVANTAGE_ESTIMATORS["dr_grpo"](**kw, cfg=AlgorithmConfig())
    assert a[:, 0].tolist() == [0.5, -0.5]
    a, _ = ADVANTAGE_ESTIMATORS["grpo"](**kw, cfg=AlgorithmConfig(adv_eps=0.0))
    assert a[:, 0].tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)])


def test_policy_loss_is_a_param_of_the_update_stage_checked_by_name():
    from flowrl.ops.registry import get_op

    assert get_op("update.policy").make_config({"policy_loss": "gspo"}, stage="update").policy_loss == "gspo"
    with pytest.raises(ValueError, match="stage 'update': params: policy_loss must be one of"):
        get_op("update.policy").make_config({"policy_loss": "x"}, stage="update")


def test_config_validation_names_fields():
    for kw, field in [({"gamma": 1.5}, "algorithm.gamma"), ({"lam": -0.1}, "algorithm.lam"),
                      ({"clip_range_value": 0}, "algorithm.clip_range_value"),
                      ({"kl_target": 0}, "algorithm.kl_target"), ({"kl_horizon": 0}, "algorithm.kl_horizon"),
                      ({"vf_coef": -1}, "algorithm.vf_coef"), ({"kl_clamp": 0}, "algorithm.kl_clamp")]:
        with pytest.raises(ValueError, match=field):
            AlgorithmConfig(**kw)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_empty_batch_and_all_masked(name):
    cfg = AlgorithmConfig()
    for B in (0, 3):
        kw = dict(rewards=torch.ones(B), group_id=torch.zeros(B, dtype=torch.long),
                  response_mask=torch.zeros(B, 4, dtype=torch.bool), token_rewards=torch.ones(B, 4),
                  values=torch.ones(B, 4), old_logprobs=-torch.ones(B, 4),
                  teacher_logprobs=torch.zeros(B, 4), cfg=cfg)
        adv, ret = ADVANTAGE_ESTIMATORS[name](**kw)
        assert adv.shape == ret.shape == (B, 4) and torch.equal(adv, torch.zeros(B, 4))


def test_rewards_near_float32_max_give_exact_advantages_or_one_clear_error():
    """Rewards of ±3e38 (float32 holds up to 3.4e38): the statistics are float64, so a bounded
    estimator is exact; an unbounded one whose true value float32 cannot hold says so instead of
    returning inf (then NaN in the loss)."""
    r = torch.tensor([3e38, -3e38, 3e38, -3e38])
    gid, mask = torch.zeros(4, dtype=torch.long), torch.ones(4, 2, dtype=torch.bool)
    # r3: float32(3e38), the rewards' magnitude
    # GRPO: mean 0, Bessel std sqrt(4 r3² / 3) → A = ±sqrt(3)/2 (eps 1e-6 is nothing beside 3.5e38)
    adv = grpo_advantages(r, gid, mask)
    assert adv[:, 0].tolist() == [torch.tensor(x).float().item() for x in
                                  (math.sqrt(3) / 2, -math.sqrt(3) / 2) * 2]
    # Dr.GRPO: A = r − 0 = r, exactly representable
    assert torch.equal(dr_grpo_advantages(r, gid, mask), r[:, None].expand(4, 2))
    # RLOO with the leave-one-out std: A_0 = (r3 − (−r3/3)) / std(−r3, r3, −r3) = (4/3 r3) /
    # (r3 · sqrt(4/3)) = 2/sqrt(3)
    adv = rloo_advantages(r, gid, mask, norm_by_std=True)
    assert adv[:, 0].tolist() == [torch.tensor(x).float().item() for x in
                                  (2 / math.sqrt(3), -2 / math.sqrt(3)) * 2]
    # plain RLOO: A_0 = r3 + r3/3 = 4e38 > 3.4e38: refused (the old code returned inf)
    with pytest.raises(ValueError, match=r"advantages reach 4e\+38, beyond float32's 3.4e\+38"):
        rloo_advantages(r, gid, mask)
    # ... and exact where the value fits: [3, 3, 3, 1]e38 → A = 3 − 7/3 = 2/3 e38, A_3 = −2e38
    r2 = torch.tensor([3e38, 3e38, 3e38, 1e38])
    x = r2.double()
    want = torch.stack([x[i] - (x.sum() - x[i]) / 3 for i in range(4)]).float()
    assert torch.equal(rloo_advantages(r2, gid, mask)[:, 0], want)
    assert want.tolist() == pytest.approx([2e38 / 3] * 3 + [-2e38], rel=1e-6)  # float32 inputs
    # REINFORCE++-baseline: r − mean = ±r3 on every token (γ = 1), whitened over 8 tokens: mean 0,
    # std sqrt(8 r3² / 7) → ±sqrt(7/8)
    adv, ret = reinforce_pp_baseline_advantages(r, gid, mask, eps=0.0)
    assert adv[:, 0].tolist() == [torch.tensor(x).float().item() for x in
                                  (math.sqrt(7 / 8), -math.sqrt(7 / 8)) * 2]
    assert torch.equal(ret, r[:, None].expand(4, 2))
    # [3, 3, 3, −3]e38: the return −3e38 − 1.5e38 = −4.5e38 float32 cannot hold (old: inf, NaN)
    with pytest.raises(ValueError, match=r"returns reach 4.5e\+38"):
        reinforce_pp_baseline_advantages(torch.tensor([3e38, 3e38, 3e38, -3e38]), gid, mask)


def test_advantage_stage_names_itself_when_rewards_overflow_float32():
    from flowrl.ops.context import StageContext
    from flowrl.ops.registry import get_op

    op = get_op("advantage.rloo").fn
    ctx = StageContext(stage="advantage", step=1, resources={"algorithm": AlgorithmConfig()})
    with pytest.raises(ValueError, match=r"^stage 'advantage' \(advantage.rloo\): advantages "
                                         r"reach 4e\+38"):
        op(ctx, None, rewards=torch.tensor([3e38, -3e38, 3e38, -3e38]),
           group_id=torch.zeros(4, dtype=torch.long), response_mask=torch.ones(4, 2, dtype=torch.bool))
