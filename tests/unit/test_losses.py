import math

import pytest
import torch

from flowrl.algorithms.config import AlgorithmConfig
from flowrl.algorithms.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate_loss,
    entropy_bonus,
    gspo_loss,
    loss_denominators,
    mask_truncated,
    ppo_clip_loss,
    value_loss,
)

NAN, INF = float("nan"), float("inf")


def _garbage_batch():
    g = torch.Generator().manual_seed(0)
    B, R = 4, 5
    mask = torch.arange(R) < torch.tensor([5, 3, 1, 0])[:, None]
    logp = torch.randn(B, R, generator=g) * 0.1 - 1
    old = logp + torch.randn(B, R, generator=g) * 0.3
    adv = torch.randn(B, R, generator=g)
    # garbage at masked positions
    logp = torch.where(mask, logp, torch.tensor(INF))
    old = torch.where(mask, old, torch.tensor(NAN))
    adv = torch.where(mask, adv, torch.tensor(NAN))
    return logp, old, adv, mask


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", sorted(LOSS_AGGREGATIONS))
def test_nan_at_masked_positions_never_reaches_loss_or_grad(name, mode):
    logp, old, adv, mask = _garbage_batch()
    logp = logp.requires_grad_(True)
    cfg = AlgorithmConfig(clip_ratio_c=3.0, clip_ratio_high=0.28)
    loss, stats = POLICY_LOSSES[name](logp, old, adv, mask, clip_ratio_low=cfg.clip_ratio_low,
                                      clip_ratio_high=cfg.clip_ratio_high,
                                      clip_ratio_c=cfg.clip_ratio_c if name != "gspo" else None)
    assert torch.isfinite(loss).all() and (loss[~mask] == 0).all()
    for k, v in stats.items():
        assert v.shape == mask.shape and torch.isfinite(v).all() and (v[~mask] == 0).all(), k
    nt, ns = loss_denominators(mask)
    total = aggregate_loss(loss, mask, mode, num_tokens=nt, num_seqs=ns, max_response_len=5)
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()


def test_ppo_clip_decoupled_low_high_and_stats():
    logr = torch.log(torch.tensor([[0.7, 0.9, 1.25, 1.35, 1.25, 0.7]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0, -1.0, 1.0]])
    m = torch.ones_like(adv, dtype=torch.bool)
    loss, st = ppo_clip_loss(logr, torch.zeros_like(logr), adv, m, clip_ratio_low=0.2, clip_ratio_high=0.28)
    # A<0,r=.7: max(.7,.8)=.8 clipped | A<0,.9: .9 | A>0,1.25: -1.25 (inside high 1.28) |
    # A>0,1.35: max(-1.35,-1.28)=-1.28 clipped | A<0,1.25: max(1.25, 1.2)=1.25 | A>0,.7: max(-.7,-.8)=-.7
    torch.testing.assert_close(loss, torch.tensor([[0.8, 0.9, -1.25, -1.28, 1.25, -0.7]]))
    assert st["clipfrac"].tolist() == [[1, 0, 0, 1, 0, 0]]
    torch.testing.assert_close(st["ratio"], logr.exp())
    torch.testing.assert_close(st["approx_kl"], -logr)


def test_ppo_on_policy_gradient_is_minus_advantage():
    logp = torch.randn(2, 3).requires_grad_(True)
    adv = torch.randn(2, 3)
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, torch.ones(2, 3, dtype=torch.bool),
                            clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -adv)


def test_ppo_rejects_bad_dual_clip():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool),
                      clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=0.5)


def test_gspo_sequence_ratio_and_gradient():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.6, 9.0], [-0.5, -0.5, -0.5]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    loss, st = gspo_loss(logp, old, adv, mask, clip_ratio_low=0.5, clip_ratio_high=0.5)
    s0 = math.exp(((-1.0 + 1.2) + (-2.0 + 1.6)) / 2)  # exp(mean log-ratio) = exp(-0.1)
    torch.testing.assert_close(st["ratio"], torch.tensor([[s0, s0, 0], [1.0, 1.0, 1.0]]))
    torch.testing.assert_close(loss, torch.tensor([[-s0, -s0, 0], [2.0, 2.0, 2.0]]))
    nt, ns = loss_denominators(mask)
    aggregate_loss(loss, mask, "seq-mean-token-mean", num_tokens=nt, num_seqs=ns).backward()
    # d/dlogp_t of mean_t(−A·s) = −A·s/|o| per token; the seq-mean divides by 2 sequences
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 4, -s0 / 4, 0], [1 / 3, 1 / 3, 1 / 3]]))


def test_gspo_clips_on_the_sequence_ratio():
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, st = gspo_loss(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), mask,
                         clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    assert st["clipfrac"].tolist() == [[1.0, 1.0]]
    torch.testing.assert_close(loss, torch.full((1, 2), -(1 + 4e-4)))


def test_aggregation_modes_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    nt, ns = loss_denominators(mask)
    assert (nt, ns) == (4.0, 2.0)
    agg = lambda mode: aggregate_loss(loss, mask, mode, num_tokens=nt, num_seqs=ns, max_response_len=4).item()  # noqa
    assert agg("token-mean") == pytest.approx(10 / 4)
    assert agg("seq-mean-token-mean") == pytest.approx((2 + 4) / 2)
    assert agg("seq-mean-token-sum") == pytest.approx(10 / 2)
    assert agg("seq-mean-token-sum-norm") == pytest.approx(10 / (2 * 4))
    with pytest.raises(ValueError, match="max_response_len"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm", num_tokens=nt, num_seqs=ns)
    with pytest.raises(ValueError, match="unknown"):
        aggregate_loss(loss, mask, "mean", num_tokens=nt, num_seqs=ns)
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "token-mean", num_tokens=-1, num_seqs=ns)


def test_empty_minibatch_gives_zero_not_nan():
    loss = torch.ones(2, 2, requires_grad=True)
    mask = torch.zeros(2, 2, dtype=torch.bool)
    for mode in LOSS_AGGREGATIONS:
        out = aggregate_loss(loss, mask, mode, num_tokens=0, num_seqs=0, max_response_len=2)
        assert out.item() == 0.0


def test_mask_truncated_drops_from_numerator_and_denominator():
    loss = torch.tensor([[1.0, 1.0], [5.0, 5.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    m = mask_truncated(mask, torch.tensor([False, True]))
    assert m.tolist() == [[True, True], [False, False]]
    nt, ns = loss_denominators(m)
    assert (nt, ns) == (2.0, 1.0)
    for mode in LOSS_AGGREGATIONS:
        assert aggregate_loss(loss, m, mode, num_tokens=nt, num_seqs=ns, max_response_len=2).item() == \
            pytest.approx({"seq-mean-token-sum": 2.0}.get(mode, 1.0))


def test_value_loss_clipped_and_unclipped():
    v = torch.tensor([[1.0, 0.0, 2.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 1.9, NAN]])
    ret = torch.tensor([[0.0, 1.0, 3.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, st = value_loss(v, old, ret, mask, clip_range_value=0.2)
    # tok0: (1-0)^2=1 vs (0+.2-0)^2=.04 → .5 ; tok1: 1 vs 1 → .5 ; tok2: 1 vs (2.1-3)^2=.81 → .5
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.5, 0.5, 0.0]]))
    # tok2: the clipped error (0.9²) is smaller, so the unclipped term is used → not clipped
    assert st["vf_clipfrac"].tolist() == [[0.0, 0.0, 0.0, 0.0]]
    loss.sum().backward()
    assert torch.isfinite(v.grad).all() and v.grad[0, 3] == 0
    # V moved from 0 straight to the return 1: the clipped V (0.2) has the larger error → clipped
    loss, st = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]),
                          torch.ones(1, 1, dtype=torch.bool), clip_range_value=0.2)
    assert loss.item() == pytest.approx(0.5 * 0.8 ** 2) and st["vf_clipfrac"].item() == 1.0
    loss, _ = value_loss(torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.tensor([[1.0]]),
                         torch.ones(1, 1, dtype=torch.bool), clip_range_value=None)
    assert loss.item() == 0.5
    with pytest.raises(ValueError, match="clip_range_value"):
        value_loss(v, old, ret, mask, clip_range_value=0.0)


def test_entropy_bonus_only_valid_tokens():
    ent = torch.tensor([[1.0, 3.0, NAN], [2.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    nt, ns = loss_denominators(mask)
    assert entropy_bonus(ent, mask, "token-mean", num_tokens=nt, num_seqs=ns).item() == pytest.approx(2.0)


def test_registry_convention_and_gspo_rejects_dual_clip():
    assert set(POLICY_LOSSES) == {"ppo_clip", "gspo", "vanilla"}
    assert POLICY_LOSSES["ppo_clip"] is ppo_clip_loss and POLICY_LOSSES["gspo"] is gspo_loss
    z, m = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="gspo"):
        gspo_loss(z, z, z, m, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)


@pytest.mark.parametrize("field, value, match", [
    ("clip_ratio_low", 2.0, r"algorithm.clip_ratio_low must be in \[0, 1\) \(the ratio's lower "
                            r"clip is 1 - clip_ratio_low\), got 2.0"),
    ("clip_ratio_low", 1.0, r"clip_ratio_low must be in \[0, 1\)"),
    ("clip_ratio_high", -0.1, r"algorithm.clip_ratio_high must be in \[0, 10\), got -0.1"),
])
def test_a_clip_range_that_clips_nothing_is_refused(field, value, match):
    """clip_ratio_low=2 trained with a lower clip of -1 (no clip at all), silently (fresh-user)."""
    from flowrl.algorithms.config import AlgorithmConfig

    with pytest.raises(ValueError, match=match):
        AlgorithmConfig(**{field: value})
    assert AlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28).clip_ratio_high == 0.28
