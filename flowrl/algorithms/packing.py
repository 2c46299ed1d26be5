"""Padding-free layout: the valid tokens of a micro-batch packed back to back in one row.

Each sequence (valid prompt tokens, then valid response tokens) keeps its own position ids, which
restart at 0, so a transformers model given ``position_ids`` and no ``attention_mask`` detects the
packing (``transformers.masking_utils.find_packed_sequence_indices``) and masks attention per
document: a block mask under ``flex_attention``, ``cu_seqlens`` (varlen kernels) under
``flash_attention_*``, a dense (T, T) boolean mask under ``sdpa``/``eager``. The ids are the same
as the padded layout's: ``position_ids_from_mask`` counts valid tokens (case C09).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowrl.algorithms.masks import position_ids_from_mask, response_attention_mask


@dataclass
class PackedBatch:
    """One packed row.

    Attributes:
        input_ids: (1, T) int64, T = attended prompt + response tokens of the micro-batch.
        position_ids: (1, T) int64, 0.. per sequence.
        predictor_index: (N,) int64, N = valid response tokens, in row-major order of the response
            mask: the packed position whose output predicts each of them (the token before it).
        cu_seqlens: (D+1,) int32, D = sequences with an attended token: 0, then the cumulative
            sequence lengths (the document boundaries of a varlen attention kernel; the last
            entry is T).
        max_seqlen: the longest sequence's attended tokens (0 for an empty row).
    """

    input_ids: Tensor
    position_ids: Tensor
    predictor_index: Tensor
    cu_seqlens: Tensor
    max_seqlen: int


def packable(prompt_mask: Tensor, response_mask: Tensor) -> bool:
    """Whether :func:`pack` keeps every logprob unchanged.

    True when each row's attended tokens (prompt, then the response up to its last valid token:
    ``response_attention_mask``) form one contiguous run and every row with a valid response
    token ends its prompt with a valid token (its first response token then has a predictor of
    its own sequence). Left-padded prompts with right-padded responses satisfy both, multi-turn
    responses (environment tokens between policy turns, mask False) too; a hole inside the prompt
    does not.

    Args:
        prompt_mask: (B, P) bool; response_mask: (B, R) bool.
    """
    attn = torch.cat([prompt_mask.bool(), response_attention_mask(response_mask)], dim=1)
    starts = attn[:, :1].long().sum(1) + (attn[:, 1:] & ~attn[:, :-1]).long().sum(1)
    has_resp = response_mask.bool().any(1)
    return bool((starts <= 1).all()) and bool((prompt_mask.bool()[:, -1] | ~has_resp).all())


def pack(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
         response_mask: Tensor) -> PackedBatch:
    """Pack the valid tokens of (B, P) left-padded prompts and (B, R) right-padded responses.

    Requires :func:`packable`; tensors on one device, and the result is on it (on the host, as the
    train engine calls it, nothing waits for a GPU: ``max_seqlen`` is read off a host tensor).
    """
    p_mask, r_mask = prompt_mask.bool(), response_mask.bool()
    attn = torch.cat([p_mask, response_attention_mask(r_mask)], dim=1)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    pos = position_ids_from_mask(attn)
    # packed index of every attended (row, column); a valid response token's predictor is the
    # attended position before it
    packed_idx = attn.flatten().long().cumsum(0).view_as(attn) - 1
    pred = packed_idx[:, p_mask.shape[1]:][r_mask] - 1
    # rows are packed in order, each one contiguous run (packable): its length is its count; a
    # row with no attended token is no document (position ids mark none either)
    lengths = attn.sum(1)
    lengths = lengths[lengths > 0]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    longest = int(lengths.max()) if lengths.numel() else 0
    return PackedBatch(ids[attn].unsqueeze(0), pos[attn].unsqueeze(0), pred, cu, longest)


def unpack(values: Tensor, response_mask: Tensor) -> Tensor:
    """(N,) per-valid-token values (row-major order of ``response_mask``) → (B, R), 0 where the
    mask is False; differentiable w.r.t. ``values``."""
    mask = response_mask.bool()
    return values.new_zeros(mask.shape).masked_scatter(mask, values)
