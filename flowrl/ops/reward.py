"""Reward stages: rule verifiers, user reward functions, the classifier reward model, DAPO
overlong shaping and the weighted mix of named components.

Every stage outputs ``rewards`` (B,) float32 where NaN marks an unscorable sample: it is counted
in the metrics and excluded from its group's statistics by the advantage estimators.
"""
from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from flowrl.ops.fields import PROMPT, RESPONSE, Rewards
from flowrl.ops.registry import register_op
from flowrl.rewards import REWARD_FUNCTIONS
from flowrl.rewards.function import check_reward_signature, load_reward_function

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from flowrl.engines.base import RewardScorer
    from flowrl.ops.context import StageContext
    from flowrl.ops.spec import NoConfig

# the components reward.mix sums, each an optional input
MIX_COMPONENTS = ("rule", "function", "model", "genrm", "format", "overlong")


log = logging.getLogger(__name__)


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor,
                     prefix: str = "") -> list[str]:
    """Text of the valid response tokens only (never the prompt), after ``prefix``: the
    pre-filled start of the response (``data.response_prefix``), which lives in the prompt ids
    but is part of the answer a verifier reads.

    response_ids (B, R) int64 and response_mask (B, R) bool, on any device: both are copied to
    the host once (a per-row masked index of device tensors costs a device sync per row), and the
    rows decode in one ``batch_decode`` call (the fast tokenizer's batch path)."""
    ids, mask = response_ids.cpu().tolist(), response_mask.bool().cpu().tolist()
    rows = [[t for t, keep in zip(r, m) if keep] for r, m in zip(ids, mask)]
    return [prefix + text for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]


def response_prefix(ctx: StageContext) -> str:
    """The run's ``data.response_prefix`` (from its prompt source; "" without one)."""
    source = ctx.run.prompts_or_none
    return source.response_prefix if source is not None else ""


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
    source = ctx.run.prompts_or_none
    if group_id is not None and source is not None:
        for f, g in zip(fields, group_id.tolist()):
            record = source.record_for_group(g)
            if record is not None:
                f.update(question=record["question"], **record["fields"])
    if prompt_ids is None or prompt_mask is None:
        return fields
    tok = ctx.run.tokenizer
    index = _question_index(source) if source is not None else {}
    for f, ids, m in zip(fields, prompt_ids, prompt_mask):
        toks = ids[m.bool()].tolist()
        f["prompt"] = tok.decode(toks, skip_special_tokens=False)
        if "question" not in f and tuple(toks) in index:
            f["question"] = index[tuple(toks)]
    return fields


def log_reward_stats(ctx: StageContext, rewards: torch.Tensor, prefix: str = "reward") -> None:
    """``<prefix>/mean``, ``/std`` over scorable samples and ``/unscorable`` (NaN count)."""
    import torch

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
    import torch

    empty = ~response_mask.bool().any(-1).to(rewards.device)
    ctx.log(**{"reward/empty": empty.sum()})
    if bool(empty.any()):
        log.warning("stage %s: %d of %d response(s) have no token (a failed generation); "
                    "marked unscorable (NaN), not scored 0", ctx.stage, int(empty.sum()),
                    empty.numel())
    return torch.where(empty, torch.full_like(rewards, float("nan")), rewards)


# --------------------------------------------------------------------------- reward.rule
@dataclass
class RuleRewardConfig:
    """verifier: key in ``flowrl.rewards.REWARD_FUNCTIONS``; format_score: reward for a
    well-formed but wrong answer (0: a policy must not earn reward without the right answer, e.g.
    by a ``#### <a number copied from the question>`` line, issue 25); fallback_last_number:
    accept the last number when no ``####`` (on: the answer is what the response ends with, in any
    format, compared exactly; SmolLM2-135M writes ``63 + 78 = 141``, never ``####``, so a strict
    verifier gives GRPO groups of zeros; ``benchmarks/results/task_baseline_cpu.md``)."""

    verifier: str = "gsm8k"
    format_score: float = 0.0
    fallback_last_number: bool = True

    def __post_init__(self) -> None:
        if self.verifier not in REWARD_FUNCTIONS:
            raise ValueError(f"verifier must be one of {sorted(REWARD_FUNCTIONS)}, got {self.verifier!r}")


@register_op("reward.rule", inputs=RESPONSE + ("ground_truth",), config=RuleRewardConfig)
def rule_reward(ctx: StageContext, cfg: RuleRewardConfig, *, response_ids: Tensor,
                response_mask: Tensor, ground_truth: list[str]) -> Rewards:
    """Score each response against its ground truth (a verifier).

    The text scored is ``data.response_prefix`` + the sampled text.

    Output: rewards (B,) float32; NaN marks an unscorable sample (the verifier raised or returned a
    non-finite value): it is counted in ``reward/unscorable`` and excluded from group statistics.
    Logged: reward mean/std over scorable samples, accuracy (reward == 1).
    """
    import torch

    fn = REWARD_FUNCTIONS[cfg.verifier]
    texts = decode_responses(ctx.run.tokenizer, response_ids, response_mask,
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
@dataclass
class FunctionRewardConfig:
    """A user reward function (contract: ``flowrl.rewards.function``).

    Attributes:
        path: ``"package.module:function"``; imported (and its signature checked against
            the call ``fn(response_text, fields, metadata)``) when the graph is compiled, so a
            bad path or signature fails before any model loads.
        num_workers: 0 = call in the trainer process; >= 1 = a process pool of that size.
        timeout_s: per-call limit in seconds (None or 0 = none); a call over it scores NaN.
        weights: component name → weight for functions returning a dict (absent names: 1.0).
    """

    path: str = ""
    num_workers: int = 0
    timeout_s: Optional[float] = 30.0
    weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.timeout_s is not None and self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or null, got {self.timeout_s}")
        # a signature flowrl's call cannot bind is refused now, not as a TypeError per sample
        check_reward_signature(load_reward_function(self.path), self.path)
        self.weights = dict(self.weights)


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


@register_op("reward.function", inputs=RESPONSE + ("ground_truth", "group_id"),
             optional_inputs=PROMPT, config=FunctionRewardConfig)
def function_reward(ctx: StageContext, cfg: FunctionRewardConfig, *, response_ids: Tensor,
                    response_mask: Tensor, ground_truth: list[str], group_id: Tensor,
                    prompt_ids: Tensor | None = None,
                    prompt_mask: Tensor | None = None) -> Rewards:
    """Call the user's reward function on every response.

    The text scored is ``data.response_prefix`` + the sampled text.

    Output: rewards (B,) float32 (a dict return is combined with ``weights``); NaN where the call
    raised, returned a non-number or a value that is not finite in float32 (weights applied),
    timed out, or killed its worker process (only that sample: ``rewards/function.py``); one
    warning line per step counts them by kind. Logged: ``reward/mean``,
    ``reward/std``, ``reward/unscorable`` (all NaN), ``reward/errors``, ``reward/nonfinite``,
    ``reward/timeouts`` and ``reward/fn/<component>`` means. The run always continues.
    """
    import torch

    from flowrl.rewards.function import NONFINITE, OK, Outcome, combine, fits_float32

    texts = decode_responses(ctx.run.tokenizer, response_ids, response_mask,
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
@register_op("reward.model", inputs=PROMPT + RESPONSE, roles=("reward_model",),
             # the classifier attends to response_mask's tokens only: tool results would be cut
             single_turn_inputs=RESPONSE)
def model_reward(ctx: StageContext[RewardScorer], cfg: NoConfig, *, prompt_ids: Tensor,
                 prompt_mask: Tensor, response_ids: Tensor,
                 response_mask: Tensor) -> Rewards:
    """Classifier reward model score of prompt + response.

    The model is ``engines/reward_model.py``'s.

    Output: rewards (B,) float32, the head's raw scalar (NaN if the model produced one).
    Logged: ``reward/model/mean``, ``/std``, ``/unscorable``.
    """
    import torch

    rewards = ctx.engine.score(prompt_ids, prompt_mask, response_ids, response_mask).float()
    rewards = torch.where(torch.isfinite(rewards), rewards, torch.full_like(rewards, float("nan")))
    log_reward_stats(ctx, rewards, "reward/model")
    return {"rewards": rewards}


# --------------------------------------------------------------------------- reward.overlong
@dataclass
class OverlongConfig:
    """DAPO soft overlong punishment (``flowrl.rewards.shaping.overlong_penalty``).

    Attributes:
        max_length: L_max in tokens; usually ``${rollout.sampling.max_new_tokens}``.
        buffer_length: L_cache, the width of the linear penalty ramp before L_max (DAPO: 4096
            of 20480); 0 = ``buffer_fraction * max_length`` (rounded, at least 1), so one graph
            fits any generation length.
        buffer_fraction: used when ``buffer_length`` is 0 (DAPO's ratio is 0.2).
        penalty_factor: scale of the penalty (1.0 = the paper's).
    """

    max_length: int = 256
    buffer_length: int = 0
    buffer_fraction: float = 0.2
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.buffer_fraction <= 1:
            raise ValueError(f"buffer_fraction must be in (0, 1], got {self.buffer_fraction}")
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.buffer_length == 0:
            self.buffer_length = max(1, round(self.buffer_fraction * self.max_length))
        if not 1 <= self.buffer_length <= self.max_length:
            raise ValueError(f"need 1 <= buffer_length <= max_length, got buffer_length="
                             f"{self.buffer_length}, max_length={self.max_length}")
        if self.penalty_factor < 0:
            raise ValueError(f"penalty_factor must be >= 0, got {self.penalty_factor}")


@register_op("reward.overlong", inputs=("response_mask",), config=OverlongConfig)
def overlong_reward(ctx: StageContext, cfg: OverlongConfig, *,
                    response_mask: Tensor) -> Rewards:
    """DAPO soft overlong punishment of the response lengths.

    Length penalty component: rewards (B,) float32 in [-penalty_factor, 0] from the response
    lengths (EOS included). Logged: ``reward/overlong/mean``, ``reward/overlong/penalised_frac``."""
    from flowrl.rewards.shaping import overlong_penalty

    r = overlong_penalty(response_mask.sum(-1), cfg.max_length, cfg.buffer_length, cfg.penalty_factor)
    ctx.log(**{"reward/overlong/mean": r.mean(), "reward/overlong/penalised_frac": (r < 0).float().mean()})
    return {"rewards": r}


# --------------------------------------------------------------------------- reward.mix
@dataclass
class MixConfig:
    """weights: component name (an input of ``reward.mix``) → weight. A bound component without
    an entry weighs 1.0; an entry for an unbound component (e.g. a stage pruned by ``when``) is
    ignored. Weight 0 leaves a component out of the sum (it is still logged)."""

    weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.weights = {str(k): float(v) for k, v in dict(self.weights).items()}
        unknown = sorted(set(self.weights) - set(MIX_COMPONENTS))
        if unknown:
            raise ValueError(f"weights: unknown component(s) {unknown}; components: {list(MIX_COMPONENTS)}")


@register_op("reward.mix", optional_inputs=MIX_COMPONENTS, config=MixConfig)
def mix_reward(ctx: StageContext, cfg: MixConfig, **components: Tensor | None) -> Rewards:
    """Weighted sum of the bound reward components.

    The sum is ``flowrl.rewards.shaping.mix_rewards``'s.

    Output: rewards (B,) float32, NaN where any component with a non-zero weight is NaN.
    Logged: ``reward/<component>/mean`` (over its scorable samples) for every component, and
    ``reward/mean``, ``reward/std``, ``reward/unscorable`` of the mix.

    Raises:
        ValueError: no component bound, or components of different lengths.
    """
    import torch

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

