"""Rollout-vs-trainer importance ratio and truncated IS (Yao et al. 2025) in the policy loss."""
import math

import pytest
import torch

from flowrl.algorithms.config import AlgorithmConfig
from flowrl.algorithms.losses import ROLLOUT_IS, ppo_clip_loss, rollout_is_ratio
from flowrl.ops.update import make_policy_loss_fn

LN = math.log


def test_ratio_is_old_over_rollout_and_one_where_masked():
    old = torch.tensor([[LN(0.5), LN(0.2), LN(0.9)]])
    rollout = torch.tensor([[LN(0.25), LN(0.4), float("nan")]])  # garbage at a masked position
    mask = torch.tensor([[True, True, False]])
    r = rollout_is_ratio(old, rollout, mask)
    torch.testing.assert_close(r, torch.tensor([[2.0, 0.5, 1.0]]))


def test_registry_none_and_tis():
    ratio = torch.tensor([[0.5, 2.0, 5.0]])
    assert ROLLOUT_IS["none"](ratio, 2.0) is None
    torch.testing.assert_close(ROLLOUT_IS["tis"](ratio, 2.0), torch.tensor([[0.5, 2.0, 2.0]]))


@pytest.mark.parametrize("field,value", [("rollout_is", "ois"), ("rollout_is_cap", 0.5)])
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"algorithm.{field}"):
        AlgorithmConfig(**{field: value})


def _mb():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return {"response_mask": mask,
            "old_logprobs": torch.tensor([[LN(0.5), LN(0.2), 0.0], [LN(0.3), LN(0.6), LN(0.1)]]),
            "rollout_logprobs": torch.tensor([[LN(0.25), LN(0.4), 0.0], [LN(0.1), LN(0.6), LN(0.1)]]),
            "advantages": torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]])}


@pytest.mark.parametrize("mode,weights", [
    ("none", [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
    # ratios old/rollout: [[2, 0.5, ·], [3, 1, 1]] truncated at C = 1.5
    ("tis", [[1.5, 0.5, 0.0], [1.5, 1.0, 1.0]]),
])
def test_tis_weights_each_token_loss(mode, weights):
    mb = _mb()
    logprobs = (mb["old_logprobs"] + 0.1).requires_grad_()  # ratio π_θ/π_old = e^0.1
    algo = AlgorithmConfig(rollout_is=mode, rollout_is_cap=1.5)
    loss_fn = make_policy_loss_fn(algo, "ppo_clip", num_tokens=5.0, num_seqs=2.0, max_response_len=3)
    loss, _ = loss_fn(mb, logprobs, None)
    per_tok, _ = ppo_clip_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["response_mask"],
                               clip_ratio_low=0.2, clip_ratio_high=0.2)
    want = (per_tok * torch.tensor(weights)).sum() / 5.0
    torch.testing.assert_close(loss, want)


def test_update_op_logs_the_ratio_mean_and_max():
    from flowrl.engines.base import SamplingConfig
    from flowrl.ops.context import StageContext
    from flowrl.ops.update import PolicyUpdateConfig, update_policy

    class Engine:  # records nothing; the metric is computed before any train step
        def train_step(self, mb, loss_fn, **kw):
            return {}

    mb = _mb()
    ctx = StageContext(stage="update", step=1, engine=Engine(),
                       resources={"algorithm": AlgorithmConfig(), "sampling": SamplingConfig()})
    B, R = mb["response_mask"].shape
    update_policy(ctx, PolicyUpdateConfig(), prompt_ids=torch.ones(B, 2, dtype=torch.long),
                  prompt_mask=torch.ones(B, 2, dtype=torch.bool),
                  response_ids=torch.ones(B, R, dtype=torch.long), **mb)
    # ratios old/rollout over the 5 valid tokens: 2, 0.5, 3, 1, 1
    assert ctx.metrics["rollout/is_ratio_mean"] == pytest.approx(7.5 / 5, rel=1e-6)
    assert ctx.metrics["rollout/is_ratio_max"] == pytest.approx(3.0, rel=1e-6)


def test_tis_without_rollout_logprobs_is_an_error():
    mb = _mb()
    del mb["rollout_logprobs"]
    loss_fn = make_policy_loss_fn(AlgorithmConfig(rollout_is="tis"), "ppo_clip", num_tokens=5.0,
                                  num_seqs=2.0, max_response_len=3)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        loss_fn(mb, mb["old_logprobs"].clone(), None)
