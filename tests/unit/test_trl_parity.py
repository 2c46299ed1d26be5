"""Parity of flowrl's GRPO math with TRL's ``GRPOTrainer`` (tested against trl 1.16.0).

TRL's own code paths are called, not re-typed: a ``GRPOTrainer`` is created with ``object.__new__``
(bypassing ``__init__``, which would load a model and a dataset) and given only the attributes its
methods read. A stub model returns the per-token logprobs we choose (a parameter, so gradients can be
compared) through TRL's ``_get_per_token_logps_and_entropies``; ``_generate`` and
``_calculate_rewards`` are stubbed so ``_generate_and_score_completions`` runs TRL's real advantage
code on our rewards; ``_compute_loss`` computes TRL's real loss.

Mapping (flowrl ← TRL):
  advantages  grpo_advantages(eps=1e-4)  ← scale_rewards="group" (TRL's eps is a fixed 1e-4)
              dr_grpo_advantages         ← scale_rewards="none"
  loss        ppo_clip_loss [+ kl_coef · k3] then aggregate_loss with
              grpo    → "seq-mean-token-mean"
              bnpo    → "token-mean"  (one micro-batch; see below)
              dr_grpo → "seq-mean-token-sum-norm", max_response_len = max_completion_length
              dapo    → "token-mean" with the global token count
              grpo + importance_sampling_level="sequence" (TRL's GSPO) → gspo_loss + seq-mean-token-mean

Definitional differences (documented and tested below):
  * Groups: TRL groups by position (``view(-1, num_generations)``: all n samples of a prompt
    contiguous); flowrl groups by ``group_id`` in any order (case C11).
  * Unscorable: TRL treats only NaN rewards as unscorable; flowrl also excludes samples with no
    valid token (e.g. after ``mask_truncated``) from group statistics. TRL's mask_truncated_completions
    zeroes the loss mask but keeps the truncated samples in the group mean/std.
  * eps: TRL adds a fixed 1e-4 to the std; flowrl's is ``algorithm.adv_eps`` (default 1e-6).
    Zero-variance groups give exactly 0 in both; singleton groups give 0 in both (TRL via NaN → 0).
  * bnpo under gradient accumulation: TRL divides each micro-batch by its OWN token count and then by
    the number of accumulation steps (the "2.0" answer of case C02); flowrl's token-mean uses the
    global token count (1.0), which is what TRL's ``dapo`` does.
  * grpo / dr_grpo: TRL divides by the micro-batch's number of sequences, including sequences with no
    valid token; flowrl's ``loss_denominators`` counts only sequences with >= 1 valid token (so a
    masked-out truncated completion leaves the denominator). Identical when no sequence is empty.
  * KL: TRL's k3 is unclamped; flowrl clamps Δ to ±kl_clamp (10) before exp — identical for |Δ| < 2.5.
"""
import types
from collections import defaultdict, deque

import pytest
import torch

pytest.importorskip("trl")
from accelerate import Accelerator  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from flowrl.algorithms.advantages import dr_grpo_advantages, grpo_advantages  # noqa: E402
from flowrl.algorithms.kl import kl_penalty  # noqa: E402
from flowrl.algorithms.losses import aggregate_loss, gspo_loss, loss_denominators, ppo_clip_loss  # noqa: E402

TOL = dict(rtol=0, atol=1e-6)
NAN = float("nan")


class StubModel(torch.nn.Module):
    """Returns chosen completion logprobs; row i of the batch is identified by its prompt token i."""

    is_gradient_checkpointing = False

    def __init__(self, logps: torch.Tensor):
        super().__init__()
        self.theta = torch.nn.Parameter(logps.clone())

    def forward(self, input_ids, attention_mask, labels=None, **_):
        rows, C = input_ids[:, 0], self.theta.shape[1]
        lp = torch.cat([torch.zeros(len(rows), input_ids.shape[1] - C), self.theta[rows]], 1)
        return types.SimpleNamespace(log_probs=lp, entropy=torch.zeros_like(lp))


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def make_trainer(accelerator, *, rewards, lengths, n, logps, loss_type="grpo", scale_rewards="group",
                 beta=0.0, eps_low=0.2, eps_high=0.28, ga=1, is_level="token", ref_logps=None):
    B, C = logps.shape
    t = object.__new__(GRPOTrainer)
    t.accelerator, t.model = accelerator, StubModel(logps).train()
    t.ref_model = None if ref_logps is None else StubModel(ref_logps).eval()  # TRL computes ref logps with it
    t.args = types.SimpleNamespace(per_device_train_batch_size=B, steps_per_generation=ga, gradient_accumulation_steps=ga,
                                   gradient_checkpointing_kwargs=None, use_bias_correction_kl=False, delta=None)
    t.environment_factories = t.tools = t.environments = None
    comp = [[5 + j for j in range(int(L))] for L in lengths]
    t._generate = lambda prompts: ([[i] for i in range(B)], comp, None, ["c"] * B, None, {}, None, None)
    t._calculate_rewards = lambda *a: rewards[:, None].clone()
    t._tokenizer = types.SimpleNamespace(pad_token_id=0)
    t.pad_to_multiple_of, t.mask_truncated_completions, t.num_iterations, t.use_vllm = None, False, 1, False
    t.beta, t.num_generations, t.scale_rewards = beta, n, scale_rewards
    t.multi_objective_aggregation, t.reward_weights, t.reward_func_names = "sum_then_normalize", torch.ones(1), ["r"]
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._logs = {"prompt": deque(), "completion": deque(), "rewards": defaultdict(deque), "advantages": deque(),
               "extra": defaultdict(deque), "images": deque()}
    t._pending_extra_logs, t._pending_metrics, t.log_multimodal = {}, {}, False
    t.top_entropy_quantile, t.off_policy_mask_threshold, t.importance_sampling_level = 1.0, None, is_level
    t.loss_type, t.epsilon_low, t.epsilon_high = loss_type, eps_low, eps_high
    t.current_gradient_accumulation_steps, t.max_completion_length = ga, C
    t._entropy_bonus_enabled = t.aux_loss_enabled = False
    return t


def batch(seed, B=8, C=5):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (B,), generator=g).float() / 2
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    lengths[0] = C  # the padded completion width is C
    logps = -torch.rand(B, C, generator=g) * 2
    old = logps + torch.randn(B, C, generator=g) * 0.3  # ratios well inside and outside the clip range
    ref = logps + torch.randn(B, C, generator=g) * 0.3
    return rewards, lengths, logps, old, ref


def trl_advantages(accelerator, rewards, lengths, n, scale_rewards, C=5):
    t = make_trainer(accelerator, rewards=rewards, lengths=lengths, n=n, logps=torch.zeros(len(rewards), C),
                     scale_rewards=scale_rewards)
    out = t._generate_and_score_completions([{"prompt": "p"}] * len(rewards))
    return t, out


@pytest.mark.parametrize("seed", range(4))
def test_grpo_advantages_match_trl(accelerator, seed):
    rewards, lengths, *_ = batch(seed)
    rewards[1] = NAN                         # unscorable inside a group
    rewards[4:6] = 0.5                       # a zero-variance group
    _, out = trl_advantages(accelerator, rewards, lengths, n=2, scale_rewards="group")
    gid = torch.arange(8) // 2
    ours = grpo_advantages(rewards, gid, out["completion_mask"].bool(), eps=1e-4)
    torch.testing.assert_close(ours, out["advantages"][:, None] * out["completion_mask"], **TOL)
    assert torch.equal(ours[4:6], torch.zeros(2, 5)) and torch.equal(ours[0:2], torch.zeros(2, 5))
    # flowrl also gets it right when the same rows arrive in any order (TRL requires contiguous groups)
    p = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(grpo_advantages(rewards[p], gid[p], out["completion_mask"].bool()[p], eps=1e-4),
                               ours[p], **TOL)


@pytest.mark.parametrize("seed", range(2))
def test_dr_grpo_advantages_match_trl(accelerator, seed):
    rewards, lengths, *_ = batch(seed)
    rewards[3] = NAN
    _, out = trl_advantages(accelerator, rewards, lengths, n=4, scale_rewards="none")
    ours = dr_grpo_advantages(rewards, torch.arange(8) // 4, out["completion_mask"].bool())
    torch.testing.assert_close(ours, out["advantages"][:, None] * out["completion_mask"], **TOL)


AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
       "dapo": "token-mean"}


def flowrl_loss(logps, old, ref, adv, mask, loss_type, beta, *, rows=slice(None), gspo=False, totals=None):
    """flowrl's loss on ``rows`` of the batch with the global denominators ``totals`` (all rows by default)."""
    nt, ns = totals or loss_denominators(mask)
    lp, m = logps[rows], mask[rows]
    fn = gspo_loss if gspo else ppo_clip_loss
    per_tok, _ = fn(lp, old[rows], adv[rows], m, clip_ratio_low=0.2, clip_ratio_high=0.28)
    if beta:
        per_tok = per_tok + beta * kl_penalty(lp, ref[rows], "k3", 10.0, response_mask=m)
    return aggregate_loss(per_tok, m, AGG[loss_type], num_tokens=nt, num_seqs=ns, max_response_len=mask.shape[1])


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_loss_and_gradient_match_trl(accelerator, loss_type, beta):
    rewards, lengths, logps, old, ref = batch(11)
    t = make_trainer(accelerator, rewards=rewards, lengths=lengths, n=4, logps=logps, loss_type=loss_type, beta=beta,
                     ref_logps=ref)
    out = t._generate_and_score_completions([{"prompt": "p"}] * 8)
    out["old_per_token_logps"] = old
    mask = out["completion_mask"].bool()
    trl_loss = t._compute_loss(t.model, out)
    trl_loss.backward()
    theta = logps.clone().requires_grad_(True)
    adv = grpo_advantages(rewards, torch.arange(8) // 4, mask, eps=1e-4)
    ours = flowrl_loss(theta, old, ref, adv, mask, loss_type, beta)
    ours.backward()
    assert abs(ours.item()) > 1e-3  # a non-trivial comparison: some tokens clipped, some not
    _, st = ppo_clip_loss(logps, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert 0 < st["clipfrac"][mask].mean() < 1
    torch.testing.assert_close(ours, trl_loss.detach(), **TOL)
    torch.testing.assert_close(theta.grad, t.model.theta.grad, **TOL)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_loss_under_gradient_accumulation_matches_trl(accelerator, loss_type):
    """Two micro-batches of 4: TRL's summed micro-batch losses equal flowrl's with global denominators."""
    rewards, lengths, logps, old, ref = batch(5)
    t = make_trainer(accelerator, rewards=rewards, lengths=lengths, n=4, logps=logps, loss_type=loss_type,
                     beta=0.04, ga=2, ref_logps=ref)
    out = t._generate_and_score_completions([{"prompt": "p"}] * 8)
    out["old_per_token_logps"] = old
    mask = out["completion_mask"].bool()
    theta = logps.clone().requires_grad_(True)
    adv = grpo_advantages(rewards, torch.arange(8) // 4, mask, eps=1e-4)
    trl_total, ours_total = 0.0, 0.0
    for rows in (slice(0, 4), slice(4, 8)):
        mb = {k: (v[rows] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in out.items()}
        trl_total = trl_total + t._compute_loss(t.model, mb)
        ours_total = ours_total + flowrl_loss(theta, old, ref, adv, mask, loss_type, 0.04, rows=rows)
    trl_total.backward()
    ours_total.backward()
    torch.testing.assert_close(ours_total, trl_total.detach(), **TOL)
    torch.testing.assert_close(theta.grad, t.model.theta.grad, **TOL)


def test_bnpo_differs_from_global_token_mean_under_accumulation(accelerator):
    """Case C02 through TRL: bnpo gives the per-micro-batch average (2.0); flowrl token-mean and TRL dapo 1.0."""
    lengths = torch.tensor([1, 3])
    logps = torch.zeros(2, 3)
    old = torch.zeros(2, 3)
    adv_tok = torch.tensor([-4.0, 0.0])  # on-policy: per-token loss = −A → [4] and [0, 0, 0]
    results = {}
    for loss_type in ("bnpo", "dapo"):
        t = make_trainer(accelerator, rewards=torch.zeros(2), lengths=lengths, n=2, logps=logps,
                         loss_type=loss_type, ga=2)
        out = t._generate_and_score_completions([{"prompt": "p"}] * 2)
        out["old_per_token_logps"], out["advantages"] = old, adv_tok
        results[loss_type] = sum(
            t._compute_loss(t.model, {k: (v[r] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in out.items()})
            for r in (slice(0, 1), slice(1, 2))).item()
    mask = torch.arange(3) < lengths[:, None]
    per_tok, _ = ppo_clip_loss(logps, old, adv_tok[:, None].expand(2, 3), mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    nt, ns = loss_denominators(mask)
    ours = sum(aggregate_loss(per_tok[r], mask[r], "token-mean", num_tokens=nt, num_seqs=ns)
               for r in (slice(0, 1), slice(1, 2))).item()
    assert results["bnpo"] == pytest.approx(2.0) and results["dapo"] == pytest.approx(1.0)
    assert ours == pytest.approx(1.0)


def test_gspo_matches_trl_sequence_level(accelerator):
    """TRL's GSPO (loss_type="grpo", importance_sampling_level="sequence") vs flowrl gspo_loss."""
    rewards, lengths, logps, old, ref = batch(7)
    t = make_trainer(accelerator, rewards=rewards, lengths=lengths, n=4, logps=logps, is_level="sequence",
                     eps_low=3e-2, eps_high=4e-2)
    out = t._generate_and_score_completions([{"prompt": "p"}] * 8)
    out["old_per_token_logps"] = old
    mask = out["completion_mask"].bool()
    trl_loss = t._compute_loss(t.model, out)
    trl_loss.backward()
    theta = logps.clone().requires_grad_(True)
    adv = grpo_advantages(rewards, torch.arange(8) // 4, mask, eps=1e-4)
    nt, ns = loss_denominators(mask)
    per_tok, st = gspo_loss(theta, old, adv, mask, clip_ratio_low=3e-2, clip_ratio_high=4e-2)
    ours = aggregate_loss(per_tok, mask, "seq-mean-token-mean", num_tokens=nt, num_seqs=ns)
    ours.backward()
    assert 0 < st["clipfrac"][mask].mean() < 1  # some sequences clipped, some not
    torch.testing.assert_close(ours, trl_loss.detach(), **TOL)
    torch.testing.assert_close(theta.grad, t.model.theta.grad, **TOL)
