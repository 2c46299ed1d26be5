"""Critic stages for PPO: ``values`` (V of the state before each response token) and
``update.critic`` (clipped value regression towards the estimator's ``returns``).

Both run under the ``critic`` role, whose engine is a :class:`flowrl.engines.train.value.
ValueTrainEngine` (value head on the actor's base model, its own AdamW; ``trainer.critic_lr``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

from flowrl.ops.fields import PROMPT, RESPONSE, NoOutputs
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.engines.base import ValueEngine
    from flowrl.ops.context import StageContext
    from flowrl.ops.spec import NoConfig


class Values(TypedDict):
    """``values``: the critic's value per response token, (B, R) float32."""

    values: Tensor


@register_op("values", inputs=PROMPT + RESPONSE, roles=("critic",))
def values(ctx: StageContext[ValueEngine], cfg: NoConfig, *, prompt_ids: Tensor,
           prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor) -> Values:
    """Critic values V(s_t) at the response positions.

    Computed without grad.

    Output: values (B, R) float32, 0 where response_mask is False; value t is the one of the state
    before response token t is emitted (same position shift as ``logprobs``).
    Logged: ``critic/values_mean`` over valid tokens.
    """
    import torch

    from flowrl.ops.rebalance import balance_rows

    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
             "response_mask": response_mask}
    bal = balance_rows(ctx, batch)  # equal rows / tokens per rank; values return in row order
    v = bal.restore(ctx.engine.values(bal.batch))
    mask = response_mask.bool()  # on the engine's device, as v (DESIGN.md "Where tensors live")
    ctx.log(**{"critic/values_mean": torch.where(mask, v, 0.0).sum() / mask.sum().clamp(min=1)})
    return {"values": v}


def make_value_loss_fn(algo: AlgorithmConfig, *, num_tokens: float, num_seqs: float,
                       max_response_len: int) -> Any:
    """The critic engine's LossFn for one mini-batch:
    loss = vf_coef · agg(½ max((V − G)², (V_old + clip(V − V_old, ±clip_range_value) − G)²))
    (PPO value loss, ``algorithms.losses.value_loss``), aggregated with ``algorithm.loss_agg_mode``
    over the whole mini-batch's denominators (so micro-batching does not change it)."""
    import torch

    from flowrl.algorithms.losses import aggregate_loss, value_loss

    def loss_fn(mb, new_values, _entropy):
        mask = mb["response_mask"].bool()
        per_tok, stats = value_loss(new_values, mb["values"], mb["returns"], mask,
                                    clip_range_value=algo.clip_range_value)
        vf = aggregate_loss(per_tok, mask, algo.loss_agg_mode, num_tokens=num_tokens,
                            num_seqs=num_seqs, max_response_len=max_response_len)
        err = torch.where(mask, new_values.detach().float() - mb["returns"].float(), 0.0)
        return algo.vf_coef * vf, {
            "critic/vf_loss": vf.detach(),
            "critic/vf_clipfrac_sum": stats["vf_clipfrac"].detach().sum(),
            "critic/vpred_abs_err_sum": err.abs().sum(),
        }

    return loss_fn


@register_op("update.critic", inputs=PROMPT + RESPONSE + ("values", "returns"),
             optional_inputs=("truncated",), roles=("critic",), trains=True)
def update_critic(ctx: StageContext[ValueEngine], cfg: NoConfig, *, prompt_ids: Tensor,
                  prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                  values: Tensor, returns: Tensor,
                  truncated: Tensor | None = None) -> NoOutputs:
    """Critic update: clipped value regression towards returns.

    ``algorithm.ppo_epochs`` passes of shuffled mini-batches of ``algorithm.mini_batch_size``
    sequences (the same schedule as ``update.policy``), one critic optimizer step each.

    Inputs: values (B, R) float32 from the ``values`` stage (the old values the clip is centred
    on); returns (B, R) float32 from the advantage estimator (GAE: A + V_old). With
    ``algorithm.mask_truncated`` and ``truncated`` bound, truncated rows leave the loss.
    Logged (means over optimizer steps / valid tokens): ``critic/vf_loss``, ``critic/vf_clipfrac``,
    ``critic/vpred_abs_err``, ``critic/grad_norm``, ``critic/lr``, ``critic/loss``,
    ``critic/optimizer_steps``.
    """
    from flowrl.ops.update import run_minibatches

    algo = ctx.run.algorithm
    mask = response_mask.bool()
    if algo.mask_truncated and truncated is not None:
        mask = mask & ~truncated.bool().unsqueeze(-1)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
             "response_mask": mask, "values": values, "returns": returns}
    # the temperature is unused by a value forward; the engine seam takes it
    ctx.log(**run_minibatches(ctx, batch, lambda **den: make_value_loss_fn(algo, **den),
                              prefix="critic", temperature=ctx.run.sampling.temperature))
    return {}
