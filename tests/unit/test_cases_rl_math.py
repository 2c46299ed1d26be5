"""The reference cases of /work/shared/cases/rl_math.md (C01–C03, C05–C08, C11), each against the
real flowrl functions, plus a generalisation that covers the whole kind of fault."""
import math

import pytest
import torch

from flowrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, gae, grpo_advantages, rloo_advantages
from flowrl.algorithms.config import AlgorithmConfig
from flowrl.algorithms.kl import kl_penalty
from flowrl.algorithms.logprobs import entropy_from_logits, token_logprobs
from flowrl.algorithms.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    loss_denominators,
    ppo_clip_loss,
)
from flowrl.algorithms.masks import response_mask
from flowrl.algorithms.variants import validate_estimator


def ones_mask(b, r=3):
    return torch.ones(b, r, dtype=torch.bool)


# ---------------------------------------------------------------- C01
def test_c01_zero_variance_group_is_exactly_zero():
    adv = grpo_advantages(torch.tensor([0.5] * 4), torch.zeros(4, dtype=torch.long), ones_mask(4), eps=1e-6)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv, torch.zeros(4, 3))


@pytest.mark.parametrize("value", [0.1, 0.3, 1 / 3, 0.95, 1e4 + 0.1, -7.77])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "rloo_std"])
def test_c01_any_constant_group_is_exactly_zero(value, estimator):
    # constants whose float mean is not exact (0.1 * 3 / 3 != 0.1) must still give exactly 0
    n = 7
    r = torch.full((n,), value, dtype=torch.float32)
    adv, _ = ADVANTAGE_ESTIMATORS[estimator](rewards=r, group_id=torch.zeros(n, dtype=torch.long),
                                             response_mask=ones_mask(n), cfg=AlgorithmConfig())
    assert torch.equal(adv, torch.zeros(n, 3))


def test_c01_leave_one_out_constant_set_skips_normalisation():
    r = torch.tensor([0, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95], dtype=torch.float32)
    adv = rloo_advantages(r, torch.zeros(8, dtype=torch.long), ones_mask(8), norm_by_std=True, eps=1e-6)
    assert adv[0, 0].item() == pytest.approx(-0.95, abs=1e-7)
    # the others: LOO set {0, .95 x6}: mean .95*6/7, sample std of that set
    loo = torch.tensor([0] + [0.95] * 6, dtype=torch.float64)
    expect = (0.95 - loo.mean()) / (loo.std() + 1e-6)
    torch.testing.assert_close(adv[1:, 0].double(), expect.expand(7), rtol=1e-6, atol=1e-6)


def test_c01_leave_one_out_constant_set_with_large_offset():
    # naive E[x²]−E[x]² gives garbage here; the outlier's LOO set is constant → plain difference
    r = torch.tensor([1000.0] + [1000.5] * 5)
    adv = rloo_advantages(r, torch.zeros(6, dtype=torch.long), ones_mask(6), norm_by_std=True)
    assert adv[0, 0].item() == pytest.approx(-0.5, abs=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "rloo_std", "reinforce_pp_baseline"])
def test_c01_group_estimator_rejects_n_equal_1(name):
    assert ADVANTAGE_ESTIMATORS[name].needs_groups
    with pytest.raises(ValueError, match="algorithm.n"):
        validate_estimator(name, 1)
    validate_estimator(name, 2)


@pytest.mark.parametrize("name", ["gae", "reinforce_pp"])
def test_c01_non_group_estimators_accept_n_equal_1(name):
    validate_estimator(name, 1)


# ---------------------------------------------------------------- C02
def _c02_batch():
    loss = torch.tensor([[4.0, 0, 0], [0.0, 0, 0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    return loss, mask


@pytest.mark.parametrize("splits", [[slice(0, 2)], [slice(0, 1), slice(1, 2)]])
def test_c02_token_mean_under_accumulation(splits):
    loss, mask = _c02_batch()
    nt, ns = loss_denominators(mask)
    tm = sum(aggregate_loss(loss[s], mask[s], "token-mean", num_tokens=nt, num_seqs=ns) for s in splits)
    sm = sum(aggregate_loss(loss[s], mask[s], "seq-mean-token-mean", num_tokens=nt, num_seqs=ns) for s in splits)
    assert tm.item() == pytest.approx(1.0, abs=0)
    assert sm.item() == pytest.approx(2.0, abs=0)


@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_c02_any_split_sums_to_the_minibatch_loss_and_gradient(mode, k):
    g = torch.Generator().manual_seed(0)
    B, R = 8, 6
    lengths = torch.randint(0, R + 1, (B,), generator=g)
    mask = torch.arange(R) < lengths[:, None]
    theta = torch.randn(B, R, generator=g, requires_grad=True)
    nt, ns = loss_denominators(mask)
    kw = dict(num_tokens=nt, num_seqs=ns, max_response_len=R)
    full = aggregate_loss(theta.square(), mask, mode, **kw)
    (gfull,) = torch.autograd.grad(full, theta)
    # micro-batches (or data-parallel ranks) with the global denominators
    parts = [aggregate_loss(theta[i::k].square(), mask[i::k], mode, **kw) for i in range(k)]
    total = sum(parts)
    (gacc,) = torch.autograd.grad(total, theta)
    torch.testing.assert_close(total, full, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gacc, gfull, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- C03 (+C04)
def test_c03_response_mask():
    ids = torch.tensor([[5, 6, 3, 0, 0], [5, 6, 7, 0, 0], [5, 6, 7, 8, 9], [5, 2, 6, 2, 0]])
    lengths = torch.tensor([3, 3, 5, 4])
    m = response_mask(ids, lengths, stop_token_ids=[2, 3])
    assert m.dtype == torch.bool
    assert m.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_c03_c04_mask_never_compares_with_pad_id():
    # pad id 0 inside real text is kept; pad == eos == 2 keeps the real EOS
    m = response_mask(torch.tensor([[5, 0, 6, 3, 0], [7, 8, 2, 2, 2]]), torch.tensor([4, 5]), stop_token_ids=[3, 2])
    assert m.int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]


# ---------------------------------------------------------------- C05
def test_c05_k3_saturated_value_and_finite_gradient():
    logp = torch.tensor([[-100.0]], requires_grad=True)
    kl = kl_penalty(logp, torch.zeros(1, 1), "k3", 10.0)
    kl.sum().backward()
    assert kl.item() == 10.0
    assert torch.isfinite(logp.grad).all() and logp.grad.item() == 0.0


def test_c05_k3_in_range_value_and_gradient_unchanged():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    kl = kl_penalty(logp, torch.zeros(1, 1), "k3", 10.0)
    kl.sum().backward()
    assert kl.item() == pytest.approx(math.e - 2, abs=1e-6)
    assert round(kl.item(), 6) == 0.718282
    assert logp.grad.item() == pytest.approx(-(math.e - 1), abs=1e-6)  # d/dlogp (e^Δ − Δ − 1)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_c05_no_overflow_anywhere(kind):
    logp = torch.linspace(-300, 300, 601).reshape(1, -1).requires_grad_(True)
    kl = kl_penalty(logp, torch.zeros_like(logp), kind, 10.0)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()
    if kind == "k3":
        assert (kl >= 0).all() and (kl <= 10).all()


# ---------------------------------------------------------------- C06
def test_c06_gae_ignores_masked_values():
    adv, ret = gae(torch.tensor([[0.0, 1, 0]]), torch.tensor([[0.0, 0, 100]]),
                   torch.tensor([[1, 1, 0]], dtype=torch.bool), gamma=1.0, lam=0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.95, 1.0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.95, 1.0, 0]]))


def _gae_ref(r, v, gamma, lam):
    adv, nxt_a, nxt_v = [0.0] * len(r), 0.0, 0.0
    for t in reversed(range(len(r))):
        nxt_a = r[t] + gamma * nxt_v - v[t] + gamma * lam * nxt_a
        nxt_v, adv[t] = v[t], nxt_a
    return adv


def test_c06_gae_any_padding_garbage_matches_unpadded_reference():
    g = torch.Generator().manual_seed(1)
    B, R = 5, 7
    lengths = torch.tensor([7, 3, 1, 0, 5])
    mask = torch.arange(R) < lengths[:, None]
    r, v = torch.randn(B, R, generator=g), torch.randn(B, R, generator=g)
    garbage = torch.full((B, R), float("nan"))
    adv, ret = gae(torch.where(mask, r, garbage), torch.where(mask, v, 1e9), mask, gamma=0.99, lam=0.9)
    for i in range(B):
        n = int(lengths[i])
        exp = torch.tensor(_gae_ref(r[i, :n].tolist(), v[i, :n].tolist(), 0.99, 0.9) + [0.0] * (R - n))
        torch.testing.assert_close(adv[i], exp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret[i], torch.where(mask[i], exp + v[i], 0.0), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- C07
@pytest.mark.parametrize("ratio,adv,expected,grad", [
    (10.0, -1.0, 3.0, 0.0), (0.1, 1.0, -0.1, -0.1), (1.1, 1.0, -1.1, -1.1), (0.5, -1.0, 0.8, 0.0)])
def test_c07_dual_clip_table(ratio, adv, expected, grad):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = ppo_clip_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1, dtype=torch.bool),
                                clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss.sum().backward()
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert logp.grad.item() == pytest.approx(grad, abs=1e-6)  # d(−A·r)/dlogp = −A·r when unclipped


def test_c07_dual_clip_never_touches_positive_advantages():
    logr = torch.log(torch.tensor([[0.01, 0.5, 1.0, 1.5, 10.0, 1e3]]))
    adv = torch.ones_like(logr) * 5.0
    m = torch.ones_like(logr, dtype=torch.bool)
    a, _ = ppo_clip_loss(logr, torch.zeros_like(logr), adv, m, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3)
    b, _ = ppo_clip_loss(logr, torch.zeros_like(logr), adv, m, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert torch.equal(a, b)
    # and for negative advantages the loss is bounded by c·|A|
    a, _ = ppo_clip_loss(logr, torch.zeros_like(logr), -adv, m, clip_ratio_low=0.2, clip_ratio_high=0.2,
                         clip_ratio_c=3)
    assert (a <= 15.0 + 1e-6).all() and a[0, -1].item() == pytest.approx(15.0)


# ---------------------------------------------------------------- C08
def test_c08_temperature_in_recomputed_logprobs():
    logits = torch.tensor([[[2.0, 0.0]]])
    label = torch.tensor([[0]])
    sampler = torch.log_softmax(torch.tensor([4.0, 0.0]), -1)[0]
    old = token_logprobs(logits, label, temperature=0.5)
    assert old.item() == pytest.approx(-0.018150, abs=1e-6)
    assert old.item() == pytest.approx(sampler.item(), abs=1e-6)  # fp32 rounding only
    _, stats = ppo_clip_loss(old, sampler.reshape(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool),
                             clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert stats["ratio"].item() == pytest.approx(1.0, abs=1e-6)
    assert token_logprobs(logits, label, temperature=1.0).item() == pytest.approx(-0.126928, abs=1e-6)
    assert entropy_from_logits(logits, temperature=0.5).item() == pytest.approx(0.090095, abs=1e-6)


@pytest.mark.parametrize("t", [0.3, 0.7, 1.0, 1.5])
def test_c08_any_temperature_matches_sampler_distribution(t):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 11, generator=g) * 3
    labels = torch.randint(0, 11, (2, 4), generator=g)
    dist = torch.distributions.Categorical(logits=logits / t)
    torch.testing.assert_close(token_logprobs(logits, labels, temperature=t), dist.log_prob(labels))
    torch.testing.assert_close(entropy_from_logits(logits, temperature=t), dist.entropy())


# ---------------------------------------------------------------- C11
def test_c11_identical_prompts_distinct_groups():
    adv = grpo_advantages(torch.tensor([0.0, 0, 1, 1]), torch.tensor([0, 0, 1, 1]), ones_mask(4))
    assert torch.equal(adv, torch.zeros(4, 3))


@pytest.mark.parametrize("layout", ["tiled", "interleaved"])
def test_c11_layout_does_not_matter(layout):
    # P1 rewards [1, 0], P2 rewards [0, 0]
    if layout == "tiled":
        gid, r = torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0, 0, 0])
    else:
        gid, r = torch.tensor([0, 1, 0, 1]), torch.tensor([1.0, 0, 0, 0])
    adv = grpo_advantages(r, gid, ones_mask(4))[:, 0]
    p1, p2 = adv[gid == 0], adv[gid == 1]
    exact = 0.5 / (math.sqrt(0.5) + 1e-6)  # (r − mean) / (std + eps), rounds to the case's 0.7071
    torch.testing.assert_close(p1, torch.tensor([exact, -exact]), rtol=0, atol=1e-7)
    assert [round(x, 4) for x in p1.tolist()] == [0.7071, -0.7071]
    assert torch.equal(p2, torch.zeros(2))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "rloo_std", "reinforce_pp_baseline"])
def test_c11_any_permutation_gives_the_same_per_sample_advantages(name):
    g = torch.Generator().manual_seed(3)
    B, R = 24, 5
    gid = torch.randint(100, 106, (B,), generator=g)          # arbitrary ids, unequal group sizes
    r = torch.randint(0, 3, (B,), generator=g).float() / 2
    r[5] = float("nan")
    mask = torch.arange(R) < torch.randint(0, R + 1, (B,), generator=g)[:, None]
    est, cfg = ADVANTAGE_ESTIMATORS[name], AlgorithmConfig()
    base, _ = est(rewards=r, group_id=gid, response_mask=mask, cfg=cfg)
    for seed in range(5):
        p = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
        adv, _ = est(rewards=r[p], group_id=gid[p], response_mask=mask[p], cfg=cfg)
        torch.testing.assert_close(adv, base[p], rtol=1e-6, atol=1e-6)
