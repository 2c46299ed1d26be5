"""The names of flowrl's algorithm variants and what their interface needs, without torch.

A graph file picks a variant by name (``op: advantage.<estimator>``, ``update.policy`` param
``policy_loss: <name>``); validating it must not import torch (``flowrl graph validate`` answers
in well under a second), so the names and the flags that shape an op's inputs/outputs live here.
The functions register under these names in ``advantages.py`` and ``losses.py``, which refuse a
name that is not declared here (one list, checked at import).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorSpec:
    """An advantage estimator's interface.

    Attributes:
        name: ``advantage.<name>`` is its op.
        needs_groups: a group baseline (rejected for ``algorithm.n < 2``: :func:`validate_estimator`).
        needs_values: reads the critic's ``values`` and ``token_rewards`` (required op inputs).
        produces_returns: outputs ``returns`` besides ``advantages`` (a return-to-go or the
            critic's regression target).
        needs_logprobs: reads the student's ``old_logprobs`` and the teacher's
            ``teacher_logprobs`` (required op inputs) instead of rewards and groups, and takes a
            task estimator's ``advantages`` as an optional input to add to (distillation).
    """

    name: str
    needs_groups: bool = False
    needs_values: bool = False
    produces_returns: bool = False
    needs_logprobs: bool = False


ESTIMATORS: dict[str, EstimatorSpec] = {s.name: s for s in (
    EstimatorSpec("grpo", needs_groups=True),
    # Dr.GRPO (Liu et al. 2025): group-centred, no std division; its own estimator, not a flag
    EstimatorSpec("dr_grpo", needs_groups=True),
    EstimatorSpec("rloo", needs_groups=True),
    EstimatorSpec("rloo_std", needs_groups=True),
    EstimatorSpec("reinforce_pp", produces_returns=True),
    EstimatorSpec("reinforce_pp_baseline", needs_groups=True, produces_returns=True),
    EstimatorSpec("gae", needs_values=True, produces_returns=True),
    # on-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): per-token reverse KL
    EstimatorSpec("distill", needs_logprobs=True),
)}

# update.policy's ``policy_loss`` param: token-level PPO clip, GSPO's sequence-level ratio
# (Zheng et al. 2025), plain policy gradient
POLICY_LOSSES = ("ppo_clip", "gspo", "vanilla")
# update.sft's ``loss`` param: the negative log-likelihood of the given tokens (SFT on teacher
# samples, graphs/sft_teacher.yaml)
SFT_LOSSES = ("nll",)
# algorithm.rollout_is: no correction, or truncated importance sampling (Yao et al. 2025)
ROLLOUT_IS = ("none", "tis")


def validate_estimator(name: str, n: int) -> None:
    """Raise ValueError if ``name`` is unknown, or needs groups and ``n`` (samples/prompt) < 2 (C01)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ESTIMATORS)}")
    if ESTIMATORS[name].needs_groups and n < 2:
        raise ValueError(f"algorithm.n must be >= 2 for the group-baseline estimator {name!r} "
                         f"(got {n}): a group of one sample has advantage 0 and trains nothing")
