"""Greedy accuracy on a fixed evaluation slice, through the rollout engine: strict (the run's rule
verifier, ``#### n`` on GSM8K) and format-free (math-verify), plus how many answers carry the
format at all, so a gain can be read as format learning or as arithmetic."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

from flowrl.engines.base import SamplingConfig
from flowrl.ops.reward import decode_responses
from flowrl.rewards import RewardFn, gsm8k_format_reward, math_verify_reward


def evaluate_greedy(rollout_engine, prompts, tokenizer, verifier: RewardFn, *, split: str,
                    limit: Optional[int], batch_size: int, max_new_tokens: int, stop_token_ids=(),
                    lenient_verifier: RewardFn = math_verify_reward,
                    answer_format: Callable[[str], float] = gsm8k_format_reward,
                    samples_path: Optional[Path] = None) -> dict[str, float]:
    """Greedy-decode the first ``limit`` prompts of ``split`` (None = all of it) and score them.

    The slice goes to ``rollout_engine.generate`` in calls of ``batch_size`` prompts (one call
    for the whole split is what a vLLM engine runs fastest). Each response is scored three ways:
    ``verifier(text, truth)`` (the strict rule, e.g. ``gsm8k_reward``: the number after the last
    ``####``), ``lenient_verifier`` (math-verify's own answer extraction, no format needed) and
    ``answer_format(text)`` (1.0 when the response carries a parseable ``#### <number>`` line,
    right or wrong).

    Returns:
        ``{}`` when ``limit == 0``; else (all floats, fractions over the ``eval/n`` answers):

        - ``eval/accuracy``: fraction with ``verifier`` reward exactly 1 (the strict accuracy;
          the key's meaning since the first release, so curves stay comparable);
        - ``eval/accuracy_strict``: the same number under its explicit name;
        - ``eval/accuracy_math_verify``: fraction ``lenient_verifier`` accepts;
        - ``eval/format_frac``: fraction with a parseable ``#### n`` answer line;
        - ``eval/math_verify_unformatted_frac``: fraction math-verify accepts that have NO such
          line (right arithmetic the strict verifier cannot see);
        - ``eval/reward_mean`` (mean ``verifier`` reward, shaping included), ``eval/n``,
          ``eval/response_length_mean`` (tokens), ``eval/truncated_frac``, ``eval/seconds``
          (generation and scoring, wall clock).

    Args:
        samples_path: when set, one JSON line per answer (``index``, ``ground_truth``,
            ``response``, ``strict``, ``math_verify``, ``format``, ``truncated``) is written there.

    Raises:
        ValueError: a ground truth the verifiers cannot parse (a data error), or an empty slice.
    """
    if limit == 0:
        return {}
    params = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens,
                            stop_token_ids=list(stop_token_ids))
    t0 = time.perf_counter()
    rows: list[dict] = []
    # one rank evaluates the whole slice (the others have nothing to add while it decodes)
    for batch in prompts.eval_batches(limit, batch_size, split=split, shard=False):
        out = rollout_engine.generate(batch.prompt_ids, batch.prompt_mask, params)
        texts = decode_responses(tokenizer, out.response_ids, out.response_mask)
        for i, text, truth, n_tok, trunc in zip(batch.prompt_index.tolist(), texts, batch.ground_truth,
                                                out.response_mask.sum(-1).tolist(),
                                                out.truncated.tolist()):
            rows.append({"index": i, "ground_truth": truth, "response": text,
                         "strict": float(verifier(text, truth)),
                         "math_verify": float(lenient_verifier(text, truth)),
                         "format": float(answer_format(text)), "length": int(n_tok),
                         "truncated": bool(trunc)})
    if not rows:  # every prompt of the slice was longer than data.max_prompt_tokens
        raise ValueError(f"the evaluation slice of split {split!r} is empty: every prompt was "
                         "skipped as too long (data.max_prompt_tokens)")
    if samples_path is not None:
        Path(samples_path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    n = len(rows)
    frac = lambda pred: sum(1 for r in rows if pred(r)) / n  # noqa: E731
    strict = frac(lambda r: r["strict"] == 1.0)
    return {"eval/accuracy": strict, "eval/accuracy_strict": strict,
            "eval/accuracy_math_verify": frac(lambda r: r["math_verify"] == 1.0),
            "eval/format_frac": frac(lambda r: r["format"] == 1.0),
            "eval/math_verify_unformatted_frac": frac(lambda r: r["math_verify"] == 1.0
                                                      and r["format"] != 1.0),
            "eval/reward_mean": sum(r["strict"] for r in rows) / n, "eval/n": float(n),
            "eval/response_length_mean": sum(r["length"] for r in rows) / n,
            "eval/truncated_frac": frac(lambda r: r["truncated"]),
            "eval/seconds": time.perf_counter() - t0}
