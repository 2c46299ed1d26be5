"""Policy update: PPO-style epochs × mini-batches over one rollout batch on the actor engine; the
supervised update (``update.sft``) on the same schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowrl.algorithms.variants import POLICY_LOSSES, SFT_LOSSES
from flowrl.ops.fields import PROMPT, RESPONSE, VISION, NoOutputs
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.engines.base import Trainable, TrainEngine
    from flowrl.ops.context import StageContext


@dataclass
class PolicyUpdateConfig:
    """policy_loss: the policy-gradient objective, a name of ``algorithms/variants.py``
    POLICY_LOSSES: ``ppo_clip`` (token-level ratio, PPO clip), ``gspo`` (GSPO's sequence-level
    ratio: the length-normalised sum of token log-ratios), ``vanilla`` (no ratio, REINFORCE-style).
    Its clip ranges and aggregation are the run's ``algorithm`` numbers."""

    policy_loss: str = "ppo_clip"

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {list(POLICY_LOSSES)}, "
                             f"got {self.policy_loss!r}")


@dataclass
class SFTUpdateConfig:
    """loss: the supervised objective, a name of ``algorithms/variants.py`` SFT_LOSSES: ``nll``
    (the negative log-likelihood of the given response tokens, aggregated by
    ``algorithm.loss_agg_mode``). temperature: the student's softmax temperature in that NLL
    (1: the model's own distribution, what SFT fits; the samples themselves came at
    ``rollout.sampling.temperature``)."""

    loss: str = "nll"
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.loss not in SFT_LOSSES:
            raise ValueError(f"loss must be one of {list(SFT_LOSSES)}, got {self.loss!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


_RANK_INVARIANT = ("grad_norm", "lr", "skipped")
_BATCH_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "old_logprobs",
               "advantages", "ref_logprobs", "rollout_logprobs", "pixel_values", "image_grid_thw")


def make_policy_loss_fn(algo: AlgorithmConfig, policy_loss: str, *, num_tokens: float,
                        num_seqs: float, max_response_len: int) -> Any:
    """Build the engine's LossFn for one mini-batch.

    The aggregation denominators (``num_tokens``, ``num_seqs``) are those of the whole mini-batch,
    so summing micro-batch losses gives the mini-batch loss however it is cut (case C02).
    loss = agg(policy) + kl_coef · agg(kl) − entropy_coef · agg(entropy); the KL term is off when
    ``algorithm.kl_in_reward`` is set (the penalty is then in the token rewards instead).
    """
    import torch

    from flowrl.algorithms.kl import kl_penalty
    from flowrl.algorithms.losses import POLICY_LOSSES as LOSS_FNS
    from flowrl.algorithms.losses import ROLLOUT_IS, aggregate_loss, rollout_is_ratio

    loss_impl = LOSS_FNS[policy_loss]

    def agg(x, mask):
        return aggregate_loss(x, mask, algo.loss_agg_mode, num_tokens=num_tokens,
                              num_seqs=num_seqs, max_response_len=max_response_len)

    def loss_fn(mb, logprobs, entropy):
        mask = mb["response_mask"]
        # without an old_logprobs stage the update is the one on-policy step of this batch: π_old
        # is the current policy, so its logprobs are this forward's (ratio exactly 1, gradient of
        # the ratio = ∇ log π); the op checks that only one optimizer step is taken
        old = mb.get("old_logprobs")
        old = logprobs.detach() if old is None else old
        per_tok, stats = loss_impl(logprobs, old, mb["advantages"], mask,
                                   clip_ratio_low=algo.clip_ratio_low,
                                   clip_ratio_high=algo.clip_ratio_high,
                                   clip_ratio_c=algo.clip_ratio_c)
        if mb.get("rollout_logprobs") is not None:  # sampler vs trainer policy (off-policy k >= 1)
            weight = ROLLOUT_IS[algo.rollout_is](rollout_is_ratio(old, mb["rollout_logprobs"], mask),
                                                 algo.rollout_is_cap)
            if weight is not None:
                per_tok = per_tok * weight
        elif algo.rollout_is != "none":
            raise ValueError(f"algorithm.rollout_is={algo.rollout_is} needs the batch's "
                             "rollout_logprobs: bind update.inputs.rollout_logprobs")
        pg = agg(per_tok, mask)
        loss = pg
        # metrics are token sums; the op divides by the mini-batch token count afterwards. They
        # stay detached device tensors: the engine reads them once per optimizer step (LossFn)
        metrics = {"actor/pg_loss": pg.detach(),
                   "actor/clipfrac_sum": torch.where(mask, stats["clipfrac"].float(), 0.0).sum(),
                   # mean |r − 1|: exactly 0 on the first on-policy mini-batch, > 0 once the
                   # weights moved (later mini-batches / epochs)
                   "actor/ratio_abs_dev_sum": torch.where(mask, (stats["ratio"] - 1.0).abs().detach(),
                                                          0.0).sum()}
        if mb.get("old_logprobs") is None and mb.get("rollout_logprobs") is not None:
            # the old-logprob stage would have logged this; here the first forward is that pass.
            # Over the measured tokens only (rollout.sampling.logprobs: NaN = not measured)
            rl = mb["rollout_logprobs"]
            measured = mask & ~torch.isnan(rl)
            metrics["rollout/logprob_mismatch_sum"] = torch.where(
                measured, (rl - logprobs.detach()).abs(), 0.0).sum()
            metrics["rollout/logprob_mismatch_count"] = measured.sum()
        if "approx_kl" in stats:  # KL(π_old‖π_θ), logged even without a reference model
            metrics["actor/ppo_kl_sum"] = torch.where(mask, stats["approx_kl"].detach(), 0.0).sum()
        # with algorithm.kl_in_reward the KL is already in the token rewards (reward.token_rewards):
        # a loss term as well would charge it twice
        if algo.kl_coef > 0 and not algo.kl_in_reward and mb.get("ref_logprobs") is not None:
            # the mask goes in *before* the estimator: garbage at masked positions must not
            # reach exp() (0 · NaN is still NaN in the backward pass)
            kl = kl_penalty(logprobs, mb["ref_logprobs"], algo.kl_type, clamp=algo.kl_clamp,
                            response_mask=mask)
            kl_loss = agg(kl, mask)
            loss = loss + algo.kl_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        if entropy is not None:
            ent = torch.where(mask, entropy, 0.0)
            metrics["actor/entropy_sum"] = ent.detach().sum()
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * agg(ent, mask)
        return loss, metrics

    return loss_fn


def global_mini_batch(ctx: StageContext, algo: AlgorithmConfig, local_batch: int) -> int:
    """Rows of this rank per optimizer step. ``algorithm.mini_batch_size`` counts sequences of the
    *global* batch; each rank takes its share. Raises ValueError when it does not divide."""
    if algo.mini_batch_size and algo.mini_batch_size % ctx.dist.world_size:
        raise ValueError(f"stage '{ctx.stage}': algorithm.mini_batch_size={algo.mini_batch_size} "
                         f"must be a multiple of the world size {ctx.dist.world_size}")
    return algo.mini_batch_size // ctx.dist.world_size if algo.mini_batch_size else local_batch


def run_minibatches(ctx: StageContext[Trainable], batch: dict, make_loss_fn, *, prefix: str,
                    **train_kwargs) -> dict[str, float]:
    """The PPO update schedule shared by the policy and the critic: ``algorithm.ppo_epochs``
    passes over ``batch`` in shuffled mini-batches, one ``ctx.engine.train_step`` each.

    ``make_loss_fn(num_tokens=, num_seqs=, max_response_len=)`` builds each mini-batch's LossFn
    from its *global* denominators (valid tokens and sequences all-reduced across data-parallel
    ranks), so the summed (not averaged) gradient equals one rank's on the global batch (C02).
    Returns metrics: keys ending in ``_sum`` become per-token means over everything trained on
    (or over their ``_count`` partner's total where the loss logs one: a metric measured on
    some tokens only; the count itself is not reported), the rest means over optimizer steps
    (bare engine keys get ``prefix/``), plus
    ``<prefix>/optimizer_steps``; the engine's ``perf/update/*`` timings (seconds) and
    micro-batch counts are this rank's totals over the whole update, as
    ``perf/<prefix>_update/*`` (``prepare_s``, ``fwd_bwd_s``, ``optimizer_s``, ``micro_batches``).
    """
    import torch

    from flowrl.algorithms.losses import loss_denominators
    from flowrl.ops.collectives import all_reduce_floats
    from flowrl.ops.rebalance import balance_rows

    algo = ctx.run.algorithm
    # before the shuffle: every rank then has the same B (and nearly the same tokens); the
    # old-logprob stage saw the same rows (same lengths → same assignment), so ratio 1 still holds
    bal = balance_rows(ctx, batch)
    batch = bal.batch
    B, R = batch["response_ids"].shape
    # the pool's group (partitioned: the train pool only; never the world, which holds the
    # rollout pool too); None without a process group
    group = ctx.dist.group
    mbs = global_mini_batch(ctx, algo, B)
    sums: dict[str, float] = {}
    steps, tokens_seen = 0, 0.0
    for _ in range(algo.ppo_epochs):
        # one mini-batch: keep the rollout order, so the micro-batches are those of the old-logprob
        # pass and the first ratio is exactly 1 (a shuffle would only change float summation order)
        perm = torch.randperm(B, generator=ctx.generator) if mbs < B else torch.arange(B)
        for start in range(0, B, mbs):
            idx = perm[start:start + mbs]
            mb = {k: v[idx] for k, v in batch.items()}
            num_tokens, num_seqs = loss_denominators(mb["response_mask"])
            num_tokens, num_seqs = all_reduce_floats([num_tokens, num_seqs], "sum", group)
            loss_fn = make_loss_fn(num_tokens=max(num_tokens, 1.0), num_seqs=max(num_seqs, 1.0),
                                   max_response_len=R)
            m = ctx.engine.train_step(mb, loss_fn, **train_kwargs)
            steps += 1
            tokens_seen += num_tokens
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
    # each rank's loss terms and token sums are its share of global quantities: add the shares;
    # grad_norm / lr / skipped come from the engine and are already the same on every rank
    shared = [k for k in sorted(sums) if k not in _RANK_INVARIANT and not k.startswith("perf/")]
    for k, v in zip(shared, all_reduce_floats([sums[k] for k in shared], "sum", group)):
        sums[k] = v
    out = {}
    for k, v in sums.items():
        if k.startswith("perf/"):  # this rank's engine timings and counts: totals of the update
            out[k.replace("perf/update/", f"perf/{prefix}_update/")] = v
        elif k.endswith("_count") and k[: -len("_count")] + "_sum" in sums:
            continue  # the denominator of its _sum partner
        elif k.endswith("_sum"):
            count = sums.get(k[: -len("_sum")] + "_count")
            if count is None:
                out[k[: -len("_sum")]] = v / max(tokens_seen, 1.0)
            elif count > 0:  # no measured token anywhere: no value (not a 0 that looks fine)
                out[k[: -len("_sum")]] = v / count
        else:
            out[k if "/" in k else f"{prefix}/{k}"] = v / max(steps, 1)
    out[f"{prefix}/optimizer_steps"] = steps
    out.update(bal.metrics)
    return out


@register_op("update.policy", inputs=PROMPT + RESPONSE + ("advantages",),
             optional_inputs=("old_logprobs", "ref_logprobs", "truncated", "rollout_logprobs")
             + VISION, config=PolicyUpdateConfig, roles=("actor",), trains=True)
def update_policy(ctx: StageContext[TrainEngine], cfg: PolicyUpdateConfig,
                  **inputs: Tensor | None) -> NoOutputs:
    """Policy update: epochs x mini-batches of the policy loss.

    ``algorithm.ppo_epochs`` passes over the rollout batch in shuffled mini-batches of
    ``algorithm.mini_batch_size`` sequences, one optimizer step each, with the policy loss the
    stage's ``policy_loss`` param names (``PolicyUpdateConfig``: ppo_clip, gspo, vanilla). old_logprobs are computed
    once per rollout batch (by the upstream stage), not per epoch. Without old_logprobs (the stage
    pruned by ``algorithm.recompute_old_logprobs=false``) exactly one optimizer step is allowed and
    π_old is the current policy. Logs loss terms, KL, entropy, clip fraction, grad norm and lr
    (means over optimizer steps).

    Raises:
        ValueError: no old_logprobs but more than one optimizer step per rollout batch; or
            ``algorithm.rollout_is`` set while some rows' ``rollout_logprobs`` were not measured
            (NaN: ``rollout.sampling.logprobs`` sampled or none).
    """
    import torch

    algo = ctx.run.algorithm
    temp = ctx.run.sampling.temperature
    batch = {k: v for k, v in inputs.items() if v is not None and k in _BATCH_KEYS}
    truncated = inputs.get("truncated")
    if algo.mask_truncated and truncated is not None:
        # overlong completions leave both the loss numerator and its denominator
        batch["response_mask"] = batch["response_mask"] & ~truncated.unsqueeze(-1)
    B = batch["response_ids"].shape[0]
    mbs = global_mini_batch(ctx, algo, B)
    if "old_logprobs" not in batch and (algo.ppo_epochs > 1 or mbs < B):
        raise ValueError(f"stage '{ctx.stage}': inputs.old_logprobs is unbound but this update takes "
                         f"{algo.ppo_epochs * -(-B // mbs)} optimizer steps; later steps need the "
                         "old policy's logprobs (set algorithm.recompute_old_logprobs=true)")
    if algo.rollout_is != "none" and "rollout_logprobs" in batch and bool(
            (batch["response_mask"].bool() & torch.isnan(batch["rollout_logprobs"])).any()):
        raise ValueError(f"stage '{ctx.stage}': algorithm.rollout_is={algo.rollout_is} weighs "
                         "every token by its rollout logprob, but the rollout engine measured "
                         "only some rows (rollout.sampling.logprobs must be all or auto)")
    if "old_logprobs" in batch and "rollout_logprobs" in batch:
        # rollout-vs-trainer importance ratio π_old/π_rollout over this rank's measured tokens
        from flowrl.algorithms.losses import rollout_is_ratio

        mask = batch["response_mask"].bool()
        measured = mask & ~torch.isnan(batch["rollout_logprobs"])  # NaN: not measured
        ratio = rollout_is_ratio(batch["old_logprobs"], batch["rollout_logprobs"], measured)[measured]
        if ratio.numel():
            ctx.log(**{"rollout/is_ratio_mean": ratio.mean(), "rollout/is_ratio_max": ratio.max()})
    out = run_minibatches(
        ctx, batch, lambda **den: make_policy_loss_fn(algo, cfg.policy_loss, **den),
        prefix="actor", temperature=temp, with_entropy=True,
        # entropy is a metric unless it is in the loss: then only it needs a backward graph
        entropy_grad=bool(algo.entropy_coef))
    ctx.log(**out)
    return {}


def make_sft_loss_fn(algo: AlgorithmConfig, loss: str, *, num_tokens: float, num_seqs: float,
                     max_response_len: int) -> Any:
    """The engine's LossFn of one ``update.sft`` mini-batch: ``SFT_LOSSES[loss]`` (the NLL of
    the given tokens) aggregated by ``algorithm.loss_agg_mode`` with the mini-batch's global
    denominators (as :func:`make_policy_loss_fn`: micro-batch losses sum to the mini-batch's).
    Metrics: ``actor/sft_loss`` (the aggregated loss) and ``actor/nll`` (mean NLL per token)."""
    import torch

    from flowrl.algorithms.losses import SFT_LOSSES as SFT_LOSS_FNS
    from flowrl.algorithms.losses import aggregate_loss

    loss_impl = SFT_LOSS_FNS[loss]

    def loss_fn(mb, logprobs, entropy):
        mask = mb["response_mask"]
        per_tok, stats = loss_impl(logprobs, mask)
        total = aggregate_loss(per_tok, mask, algo.loss_agg_mode, num_tokens=num_tokens,
                               num_seqs=num_seqs, max_response_len=max_response_len)
        return total, {"actor/sft_loss": total.detach(),
                       "actor/nll_sum": torch.where(mask, stats["nll"], 0.0).sum()}

    return loss_fn


@register_op("update.sft", inputs=PROMPT + RESPONSE, optional_inputs=("truncated",),
             config=SFTUpdateConfig, roles=("actor",), trains=True)
def update_sft(ctx: StageContext[TrainEngine], cfg: SFTUpdateConfig, *, prompt_ids: Tensor,
               prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
               truncated: Tensor | None = None) -> NoOutputs:
    """Supervised update: epochs x mini-batches of the NLL of the given tokens.

    Supervised fine-tuning of the actor on the given responses (``graphs/sft_teacher.yaml``:
    the teacher's samples): ``algorithm.ppo_epochs`` passes in mini-batches of
    ``algorithm.mini_batch_size`` sequences (:func:`run_minibatches`), each step minimising the
    stage's ``loss`` (``SFTUpdateConfig``: ``nll``) of the response tokens at
    ``cfg.temperature``, aggregated by ``algorithm.loss_agg_mode``. With
    ``algorithm.mask_truncated`` and ``truncated`` bound, truncated responses are left out.

    Args: prompt_ids, prompt_mask (B, P); response_ids (B, R) int64, response_mask (B, R) bool;
        truncated (B,) bool or None. On the actor engine's device (DESIGN "Where tensors live").
    Logs ``actor/sft_loss``, ``actor/nll`` (nats per token), grad norm, lr, optimizer steps.
    """
    algo = ctx.run.algorithm
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
             "response_mask": response_mask}
    if algo.mask_truncated and truncated is not None:
        batch["response_mask"] = response_mask & ~truncated.unsqueeze(-1)
    out = run_minibatches(
        ctx, batch, lambda **den: make_sft_loss_fn(algo, cfg.loss, **den), prefix="actor",
        temperature=cfg.temperature, with_entropy=False)
    ctx.log(**out)
    return {}
