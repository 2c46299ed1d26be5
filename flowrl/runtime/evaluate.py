"""Greedy accuracy on a fixed evaluation slice, through the rollout engine and the rule verifier."""
from __future__ import annotations

import time

import torch

from flowrl.engines.base import SamplingConfig
from flowrl.ops.reward import decode_responses


def evaluate_greedy(rollout_engine, prompts, tokenizer, verifier, *, split: str, limit: int,
                    batch_size: int, max_new_tokens: int, stop_token_ids=()) -> dict[str, float]:
    """Greedy-decode the first ``limit`` prompts of ``split`` and score them.

    Returns ``eval/accuracy`` (fraction with reward 1), ``eval/reward_mean``, ``eval/n``,
    ``eval/response_length_mean``, ``eval/truncated_frac`` and ``eval/seconds``; with ``limit == 0``
    an empty dict.
    """
    if limit == 0:
        return {}
    params = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens,
                            stop_token_ids=list(stop_token_ids))
    t0 = time.perf_counter()
    rewards, lengths, truncated = [], [], []
    # one rank evaluates the whole slice (the others have nothing to add while it decodes)
    for batch in prompts.eval_batches(limit, batch_size, split=split, shard=False):
        out = rollout_engine.generate(batch.prompt_ids, batch.prompt_mask, params)
        texts = decode_responses(tokenizer, out.response_ids, out.response_mask)
        rewards += [float(verifier(t, gt)) for t, gt in zip(texts, batch.ground_truth)]
        lengths += out.response_mask.sum(-1).tolist()
        truncated += out.truncated.tolist()
    r = torch.tensor(rewards)
    return {"eval/accuracy": (r == 1.0).float().mean().item(), "eval/reward_mean": r.mean().item(),
            "eval/n": float(len(rewards)), "eval/response_length_mean": float(sum(lengths)) / len(lengths),
            "eval/truncated_frac": float(sum(truncated)) / len(truncated),
            "eval/seconds": time.perf_counter() - t0}
