"""Token-level rewards with the in-reward KL penalty (PPO / REINFORCE++ style).

``reward.token_rewards`` places each sequence reward on the last valid response token and, when
``algorithm.kl_in_reward`` is true and ``algorithm.kl_coef > 0``, subtracts β·KL_t(π_old ‖ π_ref)
at every valid token (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022, eq. 2)::

    r_t = [t = last valid] · R(x, y) − β · KL_t,      KL_t = kl_type(old_logprobs_t, ref_logprobs_t)

β comes from a KL controller (``algorithms.kl.kl_controller``): fixed (``algorithm.kl_target`` None)
or adaptive (Ziegler et al. 2019 §2.2, eq. 3) towards ``algorithm.kl_target`` nats *per sequence*
(the controller sees the batch mean of Σ_t KL_t, as in the paper; its horizon is
``algorithm.kl_horizon`` samples). The batch is the pool's *global* batch: the mean and the sample
count are summed over the data-parallel ranks (``ctx.dist.group``) before the update, so every
rank holds the same β, the one a single rank would compute on the whole batch. The controller is
the op's declared state (``ops/state.py``, resource ``kl_controller``): the job checkpoints its β
and a resumed run continues with the adapted value, not the initial one, in every placement.

With the penalty in the reward, the policy update's KL *loss* term is off (``update.policy`` skips
it when ``kl_in_reward`` is set): the KL would otherwise be charged twice.
:func:`check_kl_in_reward` rejects, before any model loads, a run whose graph would silently drop
the penalty (no ``reward.token_rewards`` stage, or one without old/ref logprobs bound).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, TypedDict

from flowrl.ops.registry import register_op
from flowrl.ops.state import OpStateSpec, declare_state

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.algorithms.kl import AdaptiveKLController, FixedKLController
    from flowrl.ops.context import StageContext
    from flowrl.ops.spec import NoConfig

OP_NAME = "reward.token_rewards"
RESOURCE = "kl_controller"


def make_kl_controller(algo: AlgorithmConfig) -> FixedKLController | AdaptiveKLController:
    """The controller an ``AlgorithmConfig`` asks for (adaptive iff ``kl_target`` is set)."""
    from flowrl.algorithms.kl import kl_controller

    return kl_controller(algo.kl_coef, algo.kl_target, algo.kl_horizon)


def controller_state(ctrl) -> dict[str, float]:
    """JSON-able state of a KL controller (its current β); the rest is config."""
    return ctrl.state_dict()


def load_controller_state(ctrl, state: dict[str, Any]) -> None:
    """Restore what :func:`controller_state` returned. Raises KeyError when ``kl_coef`` is missing."""
    ctrl.load_state_dict(state)


# the op's cross-step state: built by the executor, checkpointed and restored by the job
def _initial_controller(resources: Mapping[str, Any]) -> FixedKLController | AdaptiveKLController:
    return make_kl_controller(resources["algorithm"])


KL_STATE = declare_state(OP_NAME, OpStateSpec(RESOURCE, _initial_controller))


def kl_in_reward_active(algo: AlgorithmConfig) -> bool:
    return bool(algo.kl_in_reward) and algo.kl_coef > 0


def check_kl_in_reward(plan: Any, algo: AlgorithmConfig) -> None:
    """Raise ValueError (naming the graph/stage) when ``algorithm.kl_in_reward`` is set with
    ``kl_coef > 0`` but the compiled plan cannot apply the penalty."""
    if not kl_in_reward_active(algo):
        return
    stages = [c.stage for c in plan.stages if c.stage.op == OP_NAME]
    if not stages:
        raise ValueError(
            f"algorithm.kl_in_reward=true (kl_coef={algo.kl_coef}) but graph '{plan.graph.name}' has "
            f"no '{OP_NAME}' stage, so the KL penalty would be silently dropped; use a graph that "
            f"places token rewards (graph=ppo, graph=reinforce_pp) or set algorithm.kl_in_reward=false")
    for s in stages:
        missing = [a for a in ("old_logprobs", "ref_logprobs") if a not in s.inputs]
        if missing:
            raise ValueError(f"stage '{s.name}': algorithm.kl_in_reward=true needs inputs {missing} "
                             f"bound (is the ref stage disabled by its 'when'?)")


class TokenRewards(TypedDict):
    """``reward.token_rewards``: the per-token reward, (B, R) float32 (0 at masked positions)."""

    token_rewards: Tensor


@register_op(OP_NAME, inputs=("rewards", "response_mask"),
             optional_inputs=("old_logprobs", "ref_logprobs"))
def token_rewards(ctx: StageContext, cfg: NoConfig, *, rewards: Tensor, response_mask: Tensor,
                  old_logprobs: Tensor | None = None,
                  ref_logprobs: Tensor | None = None) -> TokenRewards:
    """Sequence rewards on the last token, minus beta*KL when algorithm.kl_in_reward.

    Inputs: rewards (B,) float32 (NaN = unscorable → 0 on the last token); response_mask (B, R)
    bool; old_logprobs / ref_logprobs (B, R) float32 (needed only with the penalty).
    Output: token_rewards (B, R) float32, 0 at masked positions.
    Logged: ``reward/token_sum_mean`` (batch mean of Σ_t r_t); with the penalty also ``kl/coef``
    (β used for this batch, before the controller update), ``kl/in_reward`` (this rank's batch
    mean of Σ_t KL_t, nats per sequence), ``kl/in_reward_token_mean`` and
    ``reward/kl_penalty_mean`` (batch mean of β·Σ_t KL_t). The controller is updated with the mean
    over the pool's global batch (one all-reduce of two floats over ``ctx.dist.group``).
    Raises: ValueError naming the stage when the penalty is on and a logprob input is missing.
    """
    import torch

    from flowrl.algorithms.advantages import place_on_last_token
    from flowrl.algorithms.kl import apply_kl_penalty

    algo = ctx.run.algorithm
    mask = response_mask.bool()
    tr = place_on_last_token(rewards, mask)
    if kl_in_reward_active(algo):
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError(f"stage '{ctx.stage}': algorithm.kl_in_reward=true needs old_logprobs "
                             f"and ref_logprobs bound")
        ctrl: FixedKLController | AdaptiveKLController | None = ctx.resources.get(RESOURCE)
        if ctrl is None:  # a direct call, outside an Executor (which creates the op's state)
            ctrl = ctx.resources[RESOURCE] = make_kl_controller(algo)  # = KL_STATE.make
        beta = ctrl.value
        tr, kl = apply_kl_penalty(tr, old_logprobs, ref_logprobs, mask, beta, algo.kl_type,
                                  clamp=algo.kl_clamp)
        seq_kl = kl.sum(-1)
        mean_kl = float(seq_kl.mean()) if seq_kl.numel() else 0.0
        # every data-parallel rank updates with the global batch's mean and size: one β per pool
        from flowrl.ops.collectives import all_reduce_floats

        kl_sum, n = all_reduce_floats([mean_kl * seq_kl.numel(), float(seq_kl.numel())], "sum",
                                      ctx.dist.group)
        ctrl.update(kl_sum / n if n else 0.0, n_steps=int(n))
        metrics: dict[str, float | Tensor] = {
            "kl/coef": beta, "kl/in_reward": mean_kl,
            "kl/in_reward_token_mean": kl.sum() / mask.sum().clamp(min=1),
            "reward/kl_penalty_mean": beta * mean_kl}
        ctx.log(**metrics)
    ctx.log(**{"reward/token_sum_mean": tr.sum(-1).mean() if tr.numel() else torch.tensor(0.0)})
    return {"token_rewards": tr}
