"""Masks and positions derived from lengths and the tokenizer, never from token values.

Comparing ids with the pad id breaks when pad == eos (case C04: the real EOS must stay in the
mask) and when the pad id occurs inside the text, so every mask here comes from lengths.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def response_mask(response_ids: Tensor, response_lengths: Tensor,
                  stop_token_ids: Sequence[int]) -> Tensor:
    """Valid-token mask of right-padded responses.

    A position is valid when it lies before ``response_lengths`` (tokens really generated) and at
    or before the first stop token (the stop token is kept so the policy learns to stop).

    Args:
        response_ids: (B, R) int64, right-padded.
        response_lengths: (B,) int64, number of generated tokens per row (0..R).
        stop_token_ids: ids that end a response (EOS and any extra stop ids).

    Returns:
        (B, R) bool.

    Reference: case C03/C04 of the project's rl_math cases.
    """
    B, R = response_ids.shape
    pos = torch.arange(R, device=response_ids.device).expand(B, R)
    within = pos < response_lengths.to(response_ids.device).unsqueeze(1)
    if len(stop_token_ids):
        stops = torch.tensor(list(stop_token_ids), device=response_ids.device)
        is_stop = torch.isin(response_ids, stops) & within
        # index of the first stop (R when none): everything after it is dropped
        first = torch.where(is_stop, pos, torch.full_like(pos, R)).min(dim=1).values
        within = within & (pos <= first.unsqueeze(1))
    return within


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids for a left-padded sequence: 0 at the first real token, counting real tokens.

    attention_mask: (B, L) bool/int. Returns (B, L) int64; pads get position 0 (their value is never
    used because they are masked). Needed by models with absolute position embeddings (case C09).
    """
    m = attention_mask.long()
    return (m.cumsum(dim=1) - 1).clamp(min=0) * m


def response_attention_mask(response_mask: Tensor) -> Tensor:
    """The response positions a forward attends to: every column up to the row's last True.

    ``response_mask`` is the loss mask; the context is everything before its last valid token.
    For a single-turn response (one run of True, right-padded) both are the same; in a
    multi-turn row the environment's tokens between policy turns (mask False) are context the
    policy read when it sampled the next turn, so they are attended (and scored by nobody).

    Args:
        response_mask: (B, R) bool (or 0/1).

    Returns:
        (B, R) bool on the same device.
    """
    m = response_mask.bool()
    return m.flip(1).cummax(dim=1).values.flip(1)


def left_align(input_ids: Tensor, attention_mask: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate each row left by ``shift`` columns, so a left-padded prompt starts at column 0 and
    its padding moves to the end of the row.

    Why: in a left-padded row the padding columns are query positions that attend to no key
    (causal mask ∧ padding mask is empty). That was issue 25's NaN grad norm (default GPU job,
    bf16): cuDNN's fused attention (PyTorch's default SDPA backend for bf16 on Hopper) gives a
    non-finite gradient for such rows whenever the padded length L is not a multiple of 128, and
    the NaN reaches every weight gradient although the loss never reads those rows. Measured on
    the H200 (``benchmarks/nan_layout_check.py``, ``benchmarks/results/nan_layout_h200.md``):
    left-padded rows 4/4 cases non-finite at L = 64, 192, 320, 448 (0/4 at 128 and 256), in raw
    SDPA and in a SmolLM2-shaped model; left-aligned rows 0/24. Whatever the kernel does, after the rotation every pad is a trailing query that sees the row's real
    tokens, so no row of the attention is empty; the real tokens stay contiguous and in order,
    with their keys and their position ids (taken from the rotated mask), so a sliding window
    sees the same neighbours as in the unpadded sequence.

    Args:
        input_ids: (B, L) token ids; attention_mask: (B, L) bool/int (the same layout).
        shift: (B,) int64, the number of leading padding columns of each row (>= 0, < L).

    Returns:
        (ids, mask) rotated, same shapes and dtypes: column c of row b holds old column
        (c + shift[b]) mod L.
    """
    B, L = input_ids.shape
    idx = (torch.arange(L, device=input_ids.device)[None, :] + shift.to(input_ids.device)[:, None]) % L
    return input_ids.gather(1, idx), attention_mask.gather(1, idx.to(attention_mask.device))
