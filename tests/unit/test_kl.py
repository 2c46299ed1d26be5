import math

import pytest
import torch

from flowrl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_controller,
    kl_penalty,
)


def test_estimator_values():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    d = ref - logp  # [-0.5, 1.0, 0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1", None), -d)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2", None), 0.5 * d ** 2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3", None), d.exp() - d - 1)
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(logp, ref, "k4", None)


def test_k3_unbiased_on_samples():
    # E_{x~p}[k3] = KL(p||q) for two categoricals
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    x = torch.multinomial(p, 200000, replacement=True, generator=g)
    est = kl_penalty(p.log()[x][None], q.log()[x][None], "k3", None).mean()
    true = (p * (p / q).log()).sum()
    assert est.item() == pytest.approx(true.item(), abs=5e-3)


def test_k3_negative_saturation_and_clamp_none():
    logp = torch.tensor([[100.0]], requires_grad=True)  # Δ = −100 → clamped to −10
    kl = kl_penalty(logp, torch.zeros(1, 1), "k3", 10.0)
    kl.sum().backward()
    assert kl.item() == pytest.approx(math.exp(-10) + 9) and logp.grad.item() == 0.0
    assert kl_penalty(torch.tensor([[-3.0]]), torch.zeros(1, 1), "k3", clamp=None).item() == pytest.approx(
        math.exp(3) - 4)


def test_masked_garbage_gives_zero_and_finite_grad():
    logp = torch.tensor([[-1.0, float("nan"), float("-inf")]], requires_grad=True)
    ref = torch.tensor([[-1.5, 0.0, float("nan")]])
    mask = torch.tensor([[True, False, False]])
    for kind in KL_ESTIMATORS:
        logp.grad = None
        kl = kl_penalty(logp, ref, kind, 10.0, response_mask=mask)
        kl.sum().backward()
        assert torch.isfinite(kl).all() and (kl[~mask] == 0).all()
        assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()


def test_apply_kl_penalty():
    tr = torch.tensor([[0.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, 5.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    out, kl = apply_kl_penalty(tr, logp, ref, mask, kl_coef=0.1, kl_type="k1", clamp=10.0)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -0.5, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[-0.05, 1.05, 0.0]]))
    assert not out.requires_grad
    with pytest.raises(ValueError):
        apply_kl_penalty(tr, logp, ref, mask, kl_coef=-1.0, kl_type="k1", clamp=10.0)


def test_controllers():
    fixed = FixedKLController(0.05)
    assert fixed.update(123.0, 64) == 0.05
    ada = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # KL far above target: error clipped at +0.2
    assert ada.update(60.0, 1000) == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    # KL = 3 (half the target): error −0.5 clipped to −0.2
    before = ada.value
    assert ada.update(3.0, 500) == pytest.approx(before * (1 - 0.2 * 0.05))
    before = ada.value
    assert ada.update(6.6, 100) == pytest.approx(before * (1 + 0.1 * 0.01))
    assert isinstance(kl_controller(0.1), FixedKLController)
    assert isinstance(kl_controller(0.1, target=6.0, horizon=100), AdaptiveKLController)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=1)
    with pytest.raises(ValueError):
        FixedKLController(-1.0)
