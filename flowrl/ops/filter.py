"""DAPO dynamic sampling (Yu et al. 2025, "DAPO", §3.2 and eq. 11: keep only groups with
0 < #correct < G): drop every group whose valid rewards have zero variance, since GRPO gives all
of its samples a zero advantage, so they only dilute the batch.

With ``refill: true`` the executor re-runs the stages this filter depends on (sample → rollout →
reward …) and concatenates what each attempt keeps until ``target_groups`` groups are in, at most
``max_attempts`` times, then raises (``flowrl/runtime/step/refill.py``). The compiler lists those
stages in the plan (``flowrl plan``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from flowrl.errors import RunStopped
from flowrl.ops.fields import PROMPT, RESPONSE
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.ops.context import StageContext

# (B, ...) batch fields dynamic sampling carries through; any may be left unbound (output None)
CARRIED = PROMPT + RESPONSE + ("rollout_logprobs", "truncated")


class KeptRows(TypedDict):
    """``filter.dynamic_sampling``: its inputs restricted to the rows of the kept groups, order
    preserved, B' <= B rows: ``rewards`` (B',) float32, ``group_id`` (B',) int64, and the carried
    fields of ``CARRIED`` (``prompt_ids`` / ``prompt_mask`` (B', P) int64 / bool,
    ``response_ids`` / ``response_mask`` (B', R) int64 / bool, ``rollout_logprobs`` (B', R)
    float32, ``truncated`` (B',) bool), each None when its input is unbound."""

    rewards: Tensor
    group_id: Tensor
    prompt_ids: Tensor | None
    prompt_mask: Tensor | None
    response_ids: Tensor | None
    response_mask: Tensor | None
    rollout_logprobs: Tensor | None
    truncated: Tensor | None


@dataclass
class DynamicSamplingConfig:
    """Attributes:
        refill: re-sample until ``target_groups`` informative groups are in (the executor
            re-runs the upstream sub-graph); False = just drop (error if nothing is left).
        max_attempts: sample → … → filter passes per step at most (the first one included).
        target_groups: groups the step trains on; 0 = as many as one attempt samples.
        min_std: a group with std <= min_std counts as constant (0 = exactly constant).
    """

    refill: bool = True
    max_attempts: int = 4
    target_groups: int = 0
    min_std: float = 0.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.target_groups < 0:
            raise ValueError(f"target_groups must be >= 0, got {self.target_groups}")
        if self.min_std < 0:
            raise ValueError(f"min_std must be >= 0, got {self.min_std}")


def informative_groups(scores: Tensor, group_id: Tensor, min_std: float = 0.0) -> tuple[Tensor, dict]:
    """Which groups carry a learning signal.

    A group is kept when its VALID (finite) scores number at least 2 and their sample std
    (Bessel-corrected, fp64) exceeds ``min_std``: ``[0.3, 0.3, 0.3]`` is dropped,
    ``[0.3, 0.30001, 0.3]`` kept (a mean-range test such as ``0 < mean < 1`` gets continuous
    rewards wrong). NaN scores are left out; a group with fewer than 2 valid scores is dropped.

    Args:
        scores: (B,) float, NaN = unscorable. group_id: (B,) int64.
        min_std: std at or below which a group counts as constant.

    Returns:
        keep: (B,) bool row mask; counts: ``kept``, ``zero_std`` and ``too_few_valid`` groups.
    """
    import torch

    ids, inverse = torch.unique(group_id, return_inverse=True)
    s = scores.double()
    valid = torch.isfinite(s)
    x = torch.where(valid, s, torch.zeros_like(s))
    n = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, valid.double())
    mean = torch.zeros_like(n).index_add_(0, inverse, x) / n.clamp(min=1)
    dev = torch.where(valid, s - mean[inverse], torch.zeros_like(s))
    var = torch.zeros_like(n).index_add_(0, inverse, dev * dev) / (n - 1).clamp(min=1)
    enough = n >= 2
    informative = enough & (var.sqrt() > min_std)
    counts = {"kept": int(informative.sum()), "too_few_valid": int((~enough).sum()),
              "zero_std": int((enough & ~informative).sum())}
    return informative[inverse], counts


@register_op("filter.dynamic_sampling", inputs=("rewards", "group_id"),
             optional_inputs=("filter_by",) + CARRIED, config=DynamicSamplingConfig)
def dynamic_sampling(ctx: StageContext, cfg: DynamicSamplingConfig, *, rewards: Tensor,
                     group_id: Tensor, filter_by: Tensor | None = None,
                     **carried: Tensor | None) -> KeptRows:
    """Keep the rows of groups with reward variance.

    The kept groups are the informative ones (see :func:`informative_groups`).

    Inputs: rewards (B,) float32 (passed through); filter_by (B,) optional criterion (DAPO filters
    on accuracy, i.e. the rule reward, while training on the shaped reward; default rewards);
    group_id (B,) int64; the carried batch fields of ``CARRIED``.
    Outputs (:class:`KeptRows`): the same fields restricted to kept rows, order preserved (None
    for unbound ones).
    Logged (counts of this attempt; summed over refill attempts): ``filter/kept_groups``,
    ``filter/filtered_groups``, ``filter/zero_std_groups``, ``filter/too_few_valid_groups``.

    Raises:
        RunStopped (a RuntimeError): ``refill`` is off and no group is informative (never an
            empty batch).
    """
    scores = rewards if filter_by is None else filter_by
    keep, counts = informative_groups(scores, group_id, cfg.min_std)
    filtered = counts["zero_std"] + counts["too_few_valid"]
    ctx.log(**{"filter/kept_groups": counts["kept"], "filter/filtered_groups": filtered,
               "filter/zero_std_groups": counts["zero_std"],
               "filter/too_few_valid_groups": counts["too_few_valid"]})
    if counts["kept"] == 0 and not cfg.refill:
        raise RunStopped(f"stage '{ctx.stage}': dynamic sampling dropped all {filtered} groups "
                         "(zero reward variance) and refill is off; set params.refill: true of "
                         f"stage '{ctx.stage}' in the graph file, or raise algorithm.n")

    def kept(name: str) -> Tensor | None:
        v = carried.get(name)
        return None if v is None else v[keep]

    return {"rewards": rewards[keep], "group_id": group_id[keep],
            "prompt_ids": kept("prompt_ids"), "prompt_mask": kept("prompt_mask"),
            "response_ids": kept("response_ids"), "response_mask": kept("response_mask"),
            "rollout_logprobs": kept("rollout_logprobs"), "truncated": kept("truncated")}
