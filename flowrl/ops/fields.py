"""The standard fields that flow between stages: each name's shape, dtype and kind, once.

An op declaration (``registry.register_op``) names its inputs and outputs; what each holds comes
from here (``OpSpec.field_type``), so ``response_mask`` is ``(B, R) bool`` in every op that takes
it, and an op states only where its own field differs (``register_op(fields=...)``). DESIGN.md
"Data that flows" explains the names. Dimensions: B rows (samples), P prompt tokens, R response
tokens, N image patches per row, D patch features, K images per row. No torch here: the graph
validator reads these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from torch import Tensor

TENSOR, LIST = "tensor", "list"  # Field.kind values


@dataclass(frozen=True)
class Field:
    """What one input or output holds.

    Attributes:
        shape: e.g. ``"(B, R)"``; ``"(B, ...)"`` for a batch-first tensor of any trailing shape.
        dtype: a torch dtype name (``"float32"``, ``"int64"``, ``"bool"``), or ``"str"`` / ``"any"``
            for list fields.
        kind: ``"tensor"`` (leading batch dimension) or ``"list"`` (a Python list, one entry per
            row); the validator refuses a list wired into a tensor input and the reverse.
    """

    shape: str = "(B, ...)"
    dtype: str = "any"
    kind: str = TENSOR

    def __str__(self) -> str:
        return f"list[{self.dtype}] of length B" if self.kind == LIST else f"{self.shape} {self.dtype}"


FIELDS: dict[str, Field] = {
    "prompt_ids": Field("(B, P)", "int64"),  # left-padded
    "prompt_mask": Field("(B, P)", "bool"),
    "response_ids": Field("(B, R)", "int64"),  # right-padded
    "response_mask": Field("(B, R)", "bool"),
    "rollout_logprobs": Field("(B, R)", "float32"),
    "truncated": Field("(B,)", "bool"),
    "logprobs": Field("(B, R)", "float32"),
    "old_logprobs": Field("(B, R)", "float32"),
    "ref_logprobs": Field("(B, R)", "float32"),
    "teacher_logprobs": Field("(B, R)", "float32"),
    "values": Field("(B, R)", "float32"),
    "rewards": Field("(B,)", "float32"),  # NaN = unscorable
    "token_rewards": Field("(B, R)", "float32"),
    "advantages": Field("(B, R)", "float32"),
    "returns": Field("(B, R)", "float32"),
    "group_id": Field("(B,)", "int64"),
    "ground_truth": Field("(B,)", "str", LIST),
    "pixel_values": Field("(B, N, D)", "float32"),
    "image_grid_thw": Field("(B, K, 3)", "int64"),
    # rollout.multi_turn's per-trajectory metadata
    "num_turns": Field("(B,)", "int64"),
    "num_tool_calls": Field("(B,)", "int64"),
    "num_tool_errors": Field("(B,)", "int64"),
    "finish_reason": Field("(B,)", "str", LIST),
}

# field groups that many ops take together
PROMPT = ("prompt_ids", "prompt_mask")
RESPONSE = ("response_ids", "response_mask")
# a vision-language batch's image inputs (flowrl.data.images): store entries read by the rollout,
# every logprob stage and the update (graphs/grpo_vl.yaml)
VISION = ("pixel_values", "image_grid_thw")


def field_of(name: str) -> Field:
    """The standard field ``name``; a batch-first tensor of any shape for a name of your own."""
    return FIELDS.get(name, Field())


# ---- op outputs: the return types of the ops that produce these fields (``register_op`` takes an
# op's ``outputs`` from its return TypedDict's keys, in this order; shapes and dtypes: FIELDS)
class Prompts(TypedDict):
    """``data.sample``: the step's prompt rows, B = prompts x ``algorithm.n``."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    group_id: Tensor
    ground_truth: list[str]


class ImagePrompts(Prompts):
    """``data.sample_images``: :class:`Prompts` plus the rows' images."""

    pixel_values: Tensor
    image_grid_thw: Tensor


class Generated(TypedDict):
    """``teacher.generate``: one response per prompt row."""

    response_ids: Tensor
    response_mask: Tensor
    truncated: Tensor


class Rollout(TypedDict):
    """``rollout.generate``: one response per prompt row and its sampling logprobs."""

    response_ids: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    truncated: Tensor


class MultiTurnRollout(Rollout):
    """``rollout.multi_turn``: :class:`Rollout` (rows of several policy turns) plus per-row
    metadata of the episode."""

    rewards: Tensor
    num_turns: Tensor
    num_tool_calls: Tensor
    num_tool_errors: Tensor
    finish_reason: list[str]


class Rewards(TypedDict):
    """Every ``reward.*`` op: one scalar per row, NaN = unscorable."""

    rewards: Tensor


class NoOutputs(TypedDict):
    """An op run for its effect (an update stage: weights and metrics)."""
