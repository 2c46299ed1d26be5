"""Reward stages: rule verifiers, user reward functions, the classifier reward model, DAPO
overlong shaping and the weighted mix of named components.

Every stage outputs ``rewards`` (B,) float32 where NaN marks an unscorable sample: it is counted
in the metrics and excluded from its group's statistics by the advantage estimators.
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import TYPE_CHECKING, Any

import torch

from flowrl.ops.builtin import (  # noqa: F401
    MIX_COMPONENTS,
    FunctionRewardConfig,
    MixConfig,
    OverlongConfig,
    RuleRewardConfig,
)
from flowrl.ops.context import StageContext
from flowrl.ops.registry import implements

if TYPE_CHECKING:
    from flowrl.engines.base import RewardScorer


log = logging.getLogger(__name__)


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor,
                     prefix: str = "") -> list[str]:
    """Text of the valid response tokens only (never the prompt), after ``prefix``: the
    pre-filled start of the response (``data.response_prefix``), which lives in the prompt ids
    but is part of the answer a verifier reads."""
    return [prefix + tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
            for ids, m in zip(response_ids, response_mask)]


def response_prefix(ctx: StageContext) -> str:
    """The run's ``data.response_prefix`` (from its prompt source; "" without one)."""
    from flowrl.data.prompts import PromptSource

    source = ctx.resources.get("prompts")
    return source.response_prefix if isinstance(source, PromptSource) else ""


_QUESTIONS: "weakref.WeakKeyDictionary[Any, dict[tuple, str]]" = weakref.WeakKeyDictionary()


def _question_index(source) -> dict[tuple, str]:
    """Encoded prompt tokens → question text of the run's prompt source (built once). The tokens
    of a rendered prompt determine its question; groups are still identified by group_id."""
    if source not in _QUESTIONS:
        tokens = getattr(source, "_tokens", None) or []
        records = getattr(source, "records", None) or []
        _QUESTIONS[source] = {tuple(t): r.get("question", "") for t, r in zip(tokens, records)}
    return _QUESTIONS[source]


def prompt_fields(ctx: StageContext, ground_truth, prompt_ids=None, prompt_mask=None,
                  group_id=None) -> list[dict]:
    """Per-sample prompt fields handed to reward functions and judges: ``ground_truth`` always;
    ``prompt`` (rendered prompt text) when the prompt tokens are given; ``question`` and the
    ``data.extra_keys`` columns of the sample's record when the run's prompt source knows it (by
    ``group_id``: the record that ``data.sample`` drew for the group; else by prompt tokens,
    the question only)."""
    fields = [{"ground_truth": gt} for gt in ground_truth]
    source = ctx.resources.get("prompts")
    if group_id is not None and source is not None:
        for f, g in zip(fields, group_id.tolist()):
            record = source.record_for_group(g)
            if record is not None:
                f.update(question=record["question"], **record["fields"])
    if prompt_ids is None or prompt_mask is None:
        return fields
    tok = ctx.resource("tokenizer")
    index = _question_index(source) if source is not None else {}
    for f, ids, m in zip(fields, prompt_ids, prompt_mask):
        toks = ids[m.bool()].tolist()
        f["prompt"] = tok.decode(toks, skip_special_tokens=False)
        if "question" not in f and tuple(toks) in index:
            f["question"] = index[tuple(toks)]
    return fields


def log_reward_stats(ctx: StageContext, rewards: torch.Tensor, prefix: str = "reward") -> None:
    """``<prefix>/mean``, ``/std`` over scorable samples and ``/unscorable`` (NaN count)."""
    ok = torch.isfinite(rewards)
    valid = rewards[ok].double()
    ctx.log(**{f"{prefix}/mean": valid.mean() if valid.numel() else float("nan"),
               f"{prefix}/std": valid.std() if valid.numel() > 1 else 0.0,
               f"{prefix}/unscorable": (~ok).sum()})
    if prefix == "reward" and rewards.numel():  # the batch's reward: its health counter
        ctx.log(**{"train/unscorable_frac": (~ok).float().mean()})


def mark_empty_unscorable(ctx: StageContext, rewards: torch.Tensor,
                          response_mask: torch.Tensor) -> torch.Tensor:
    """NaN (unscorable) for rows without a single generated token: a generation that failed
    (an aborted or errored request) is not an answer the policy gave, so it must not be scored
    as a normal 0 that GRPO would push the policy away from. Logs ``reward/empty`` (count).
    rewards (B,) float32, response_mask (B, R) bool → (B,) float32."""
    empty = ~response_mask.bool().any(-1).to(rewards.device)
    ctx.log(**{"reward/empty": empty.sum()})
    if bool(empty.any()):
        log.warning("stage %s: %d of %d response(s) have no token (a failed generation); "
                    "marked unscorable (NaN), not scored 0", ctx.stage, int(empty.sum()),
                    empty.numel())
    return torch.where(empty, torch.full_like(rewards, float("nan")), rewards)


# --------------------------------------------------------------------------- reward.rule
@implements("reward.rule")
def rule_reward(ctx: StageContext, cfg: RuleRewardConfig, *, response_ids, response_mask,
                ground_truth) -> dict:
    """Score each response (``data.response_prefix`` + the sampled text) against its ground
    truth.

    Output: rewards (B,) float32; NaN marks an unscorable sample (the verifier raised or returned a
    non-finite value): it is counted in ``reward/unscorable`` and excluded from group statistics.
    Logged: reward mean/std over scorable samples, accuracy (reward == 1).
    """
    from flowrl.rewards import REWARD_FUNCTIONS

    fn = REWARD_FUNCTIONS[cfg.verifier]
    texts = decode_responses(ctx.resource("tokenizer"), response_ids, response_mask,
                             response_prefix(ctx))
    scores = []
    for text, gt in zip(texts, ground_truth):
        try:
            r = float(fn(text, gt, format_score=cfg.format_score,
                         fallback_last_number=cfg.fallback_last_number))
            scores.append(r if math.isfinite(r) else float("nan"))
        except Exception as e:  # a verifier bug must not kill the run: mark the sample unscorable
            log.warning("stage %s: verifier %s raised %r; sample marked unscorable", ctx.stage, cfg.verifier, e)
            scores.append(float("nan"))
    rewards = mark_empty_unscorable(ctx, torch.tensor(scores, dtype=torch.float32), response_mask)
    valid = rewards[torch.isfinite(rewards)]
    log_reward_stats(ctx, rewards)
    ctx.log(**{"reward/accuracy": (valid == 1.0).float().mean() if valid.numel() else 0.0})
    return {"rewards": rewards}


# --------------------------------------------------------------------------- reward.function
_RUNNERS: dict[tuple, Any] = {}


def _runner(cfg: FunctionRewardConfig):
    """One runner (and pool) per distinct config, reused across steps; closed at exit."""
    import atexit

    from flowrl.rewards.function import RewardFunctionRunner

    key = (cfg.path, cfg.num_workers, cfg.timeout_s)
    if key not in _RUNNERS:
        _RUNNERS[key] = RewardFunctionRunner(cfg.path, cfg.num_workers, cfg.timeout_s)
        atexit.register(_RUNNERS[key].close)
    return _RUNNERS[key]


@implements("reward.function")
def function_reward(ctx: StageContext, cfg: FunctionRewardConfig, *, response_ids, response_mask,
                    ground_truth, group_id, prompt_ids=None, prompt_mask=None) -> dict:
    """Call the user's reward function on every response (``data.response_prefix`` + the
    sampled text).

    Output: rewards (B,) float32 (a dict return is combined with ``weights``); NaN where the call
    raised, returned a non-number or a value that is not finite in float32 (weights applied),
    timed out, or killed its worker process (only that sample: ``rewards/function.py``); one
    warning line per step counts them by kind. Logged: ``reward/mean``,
    ``reward/std``, ``reward/unscorable`` (all NaN), ``reward/errors``, ``reward/nonfinite``,
    ``reward/timeouts`` and ``reward/fn/<component>`` means. The run always continues.
    """
    from flowrl.rewards.function import NONFINITE, OK, Outcome, combine, fits_float32

    texts = decode_responses(ctx.resource("tokenizer"), response_ids, response_mask,
                             response_prefix(ctx))
    fields = prompt_fields(ctx, ground_truth, prompt_ids, prompt_mask, group_id)
    metas = [{"group_id": int(g), "index": i, "step": ctx.step} for i, g in enumerate(group_id.tolist())]
    outcomes = _runner(cfg).score(texts, fields, metas)
    for i, o in enumerate(outcomes):  # weights can push a float32-sized component past it
        if o.status == OK and not fits_float32(combine(o.components, cfg.weights)):
            outcomes[i] = Outcome(NONFINITE, {}, f"weighted sum of {o.components!r} overflows float32")
    rewards = torch.tensor([combine(o.components, cfg.weights) if o.status == OK else float("nan")
                            for o in outcomes], dtype=torch.float32)
    rewards = mark_empty_unscorable(ctx, rewards, response_mask)
    counts = log_unscorable(ctx, cfg.path, outcomes)
    comps: dict[str, list[float]] = {}
    for o in outcomes:
        for k, v in o.components.items():
            comps.setdefault(k, []).append(v)
    log_reward_stats(ctx, rewards)
    ctx.log(**{"reward/errors": counts["error"], "reward/timeouts": counts["timeout"],
               "reward/nonfinite": counts["nonfinite"],
               **{f"reward/fn/{k}": sum(v) / len(v) for k, v in comps.items()}})
    return {"rewards": rewards}


def log_unscorable(ctx: StageContext, path: str, outcomes) -> dict[str, int]:
    """One warning line per step for the samples a reward function could not score (every kind:
    errors, timeouts, non-finite values) with the first detail of each; returns the counts."""
    from flowrl.rewards.function import ERROR, NONFINITE, TIMEOUT

    counts = {k: sum(o.status == k for o in outcomes) for k in (ERROR, TIMEOUT, NONFINITE)}
    if any(counts.values()):
        first = {k: next(o.detail for o in outcomes if o.status == k) for k in counts if counts[k]}
        why = {ERROR: "error(s) (a raise, a bad return or a dead worker)",
               TIMEOUT: "timeout(s) (over timeout_s)",
               NONFINITE: "non-finite (NaN, inf or beyond float32)"}
        log.warning("stage %s: reward function %s: %d of %d sample(s) unscorable (NaN): %s",
                    ctx.stage, path, sum(counts.values()), len(outcomes), "; ".join(
                        f"{counts[k]} {why[k]}{', first: ' + first[k][:200] if first[k] else ''}"
                        for k in first))
    return counts


# --------------------------------------------------------------------------- reward.model
@implements("reward.model")
def model_reward(ctx: StageContext[RewardScorer], cfg, *, prompt_ids, prompt_mask, response_ids,
                 response_mask) -> dict:
    """Classifier reward model score of prompt + response (``engines/reward_model.py``).

    Output: rewards (B,) float32, the head's raw scalar (NaN if the model produced one).
    Logged: ``reward/model/mean``, ``/std``, ``/unscorable``.
    """
    rewards = ctx.engine.score(prompt_ids, prompt_mask, response_ids, response_mask).float()
    rewards = torch.where(torch.isfinite(rewards), rewards, torch.full_like(rewards, float("nan")))
    log_reward_stats(ctx, rewards, "reward/model")
    return {"rewards": rewards}


# --------------------------------------------------------------------------- reward.overlong
@implements("reward.overlong")
def overlong_reward(ctx: StageContext, cfg: OverlongConfig, *, response_mask) -> dict:
    """Length penalty component: rewards (B,) float32 in [-penalty_factor, 0] from the response
    lengths (EOS included). Logged: ``reward/overlong/mean``, ``reward/overlong/penalised_frac``."""
    from flowrl.rewards.shaping import overlong_penalty

    r = overlong_penalty(response_mask.sum(-1), cfg.max_length, cfg.buffer_length, cfg.penalty_factor)
    ctx.log(**{"reward/overlong/mean": r.mean(), "reward/overlong/penalised_frac": (r < 0).float().mean()})
    return {"rewards": r}


# --------------------------------------------------------------------------- reward.mix


@implements("reward.mix")
def mix_reward(ctx: StageContext, cfg: MixConfig, **components) -> dict:
    """Weighted sum of the bound reward components (``flowrl.rewards.shaping.mix_rewards``).

    Output: rewards (B,) float32, NaN where any component with a non-zero weight is NaN.
    Logged: ``reward/<component>/mean`` (over its scorable samples) for every component, and
    ``reward/mean``, ``reward/std``, ``reward/unscorable`` of the mix.

    Raises:
        ValueError: no component bound, or components of different lengths.
    """
    from flowrl.rewards.shaping import mix_rewards

    bound = {k: v.float() for k, v in components.items() if v is not None}
    if not bound:
        raise ValueError(f"stage '{ctx.stage}': reward.mix needs at least one bound component "
                         f"of {list(MIX_COMPONENTS)}")
    weights = {k: cfg.weights.get(k, 1.0) for k in bound}
    try:
        rewards = mix_rewards(bound, weights)
    except ValueError as e:
        raise ValueError(f"stage '{ctx.stage}': {e}") from e
    for k, v in bound.items():
        ok = torch.isfinite(v)
        ctx.log(**{f"reward/{k}/mean": v[ok].mean() if ok.any() else float("nan")})
    log_reward_stats(ctx, rewards)
    return {"rewards": rewards}

