"""Shared inputs of the GPU tier's engine-level tests."""
from __future__ import annotations

import torch


def ragged_batch(n: int = 8, seed: int = 0, vocab: int = 1024) -> dict:
    """``n`` rows on the host: left-padded prompts of 3-40 tokens (width 40) and right-padded
    responses of 1-60 (width 60), random ids in [3, vocab); seeded, so every test sees the same."""
    g = torch.Generator().manual_seed(seed)
    P, R = 40, 60
    p_len = torch.randint(3, P + 1, (n,), generator=g)
    r_len = torch.randint(1, R + 1, (n,), generator=g)
    return dict(prompt_ids=torch.randint(3, vocab, (n, P), generator=g),
                prompt_mask=torch.arange(P)[None] >= (P - p_len)[:, None],
                response_ids=torch.randint(3, vocab, (n, R), generator=g),
                response_mask=torch.arange(R)[None] < r_len[:, None])
