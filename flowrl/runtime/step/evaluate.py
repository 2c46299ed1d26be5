"""Greedy accuracy on a fixed evaluation slice, through the rollout engine, scored by the graph's
own reward verifier (:func:`eval_scorer`: its first ``reward.rule`` stage, else its first
``reward.function`` stage). With the GSM8K verifier two more views are reported, strict (``#### n``)
next to format-free (math-verify), and how many answers carry the format at all, so a gain can be
read as format learning or as arithmetic."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from flowrl.engines.base import SamplingConfig
from flowrl.ops.reward import RuleRewardConfig, decode_responses
from flowrl.rewards import REWARD_FUNCTIONS, RewardFn, gsm8k_format_reward, math_verify_reward

if TYPE_CHECKING:
    from flowrl.compiler.plan import ExecutionPlan
    from flowrl.config import TrainConfig

# (response texts, per-answer fields: ground_truth, question, data.extra_keys, the answers' rows
# in the evaluation slice) -> rewards (float; NaN = unscorable)
Score = Callable[[list[str], list[dict[str, Any]], list[int]], list[float]]


@dataclass
class EvalScorer:
    """How an evaluation scores answers.

    Attributes:
        name: what scores them, for messages (``"reward.rule gsm8k (stage 'reward')"``).
        score: the reward of each answer (:data:`Score`); ``eval/accuracy`` counts reward == 1.
        lenient: a second, format-free verifier ``fn(text, ground_truth)`` (GSM8K: math-verify);
            None = not reported.
        answer_format: 1.0 when an answer carries the expected answer format (GSM8K: a
            ``#### <number>`` line), right or wrong; None = not reported.
        check_ground_truth: raises ValueError for a ground truth ``score`` cannot use (run on
            every evaluation and training row before any model loads); None = no check.
    """

    name: str
    score: Score
    lenient: Optional[RewardFn] = None
    answer_format: Optional[Callable[[str], float]] = None
    check_ground_truth: Optional[Callable[[str], object]] = None  # its return value is unused


def rule_eval_scorer(cfg: RuleRewardConfig | None = None, *, stage: str = "") -> EvalScorer:
    """An :class:`EvalScorer` of a ``reward.rule`` stage's settings (its ``RuleRewardConfig``:
    verifier, ``format_score``, ``fallback_last_number``; None = that dataclass's defaults, the
    one home of the defaults of training and evaluation alike); ``gsm8k`` adds the math-verify
    and format views."""
    cfg = cfg or RuleRewardConfig()
    verifier = cfg.verifier
    fn = REWARD_FUNCTIONS[verifier]
    kw = {"format_score": cfg.format_score, "fallback_last_number": cfg.fallback_last_number}
    gsm8k = verifier == "gsm8k"
    return EvalScorer(
        name=f"reward.rule {verifier}" + (f" (stage '{stage}')" if stage else ""),
        score=lambda texts, fields, rows: [float(fn(t, f["ground_truth"], **kw))
                                           for t, f in zip(texts, fields)],
        lenient=math_verify_reward if gsm8k else None,
        answer_format=gsm8k_format_reward if gsm8k else None,
        # a verifier raises ValueError on a reference it cannot read, whatever the answer
        check_ground_truth=lambda truth: fn("", truth, **kw))


def function_eval_scorer(cfg, stage: str = "") -> EvalScorer:
    """An :class:`EvalScorer` of a ``reward.function`` stage's config (``FunctionRewardConfig``):
    the same user function, workers, timeout and component weights as in training; metadata
    ``group_id`` = ``index`` = the answer's row in the evaluation slice, ``step`` = -1."""
    from flowrl.ops.reward import _runner
    from flowrl.rewards.function import OK, combine

    def score(texts: list[str], fields: list[dict[str, Any]], rows: list[int]) -> list[float]:
        metas = [{"group_id": i, "index": i, "step": -1} for i in rows]
        return [combine(o.components, cfg.weights) if o.status == OK else math.nan
                for o in _runner(cfg).score(texts, fields, metas)]

    return EvalScorer(name=f"reward.function {cfg.path}" + (f" (stage '{stage}')" if stage else ""),
                      score=score)


def eval_scorer(plan) -> Optional[EvalScorer]:
    """The scorer of the graph's correctness reward: its first ``reward.rule`` stage (verifier,
    ``format_score``, ``fallback_last_number``), else its first ``reward.function`` stage; None
    when it has neither (a reward model or judge alone has no reference answer to check)."""
    for op in ("reward.rule", "reward.function"):
        for c in plan.stages:
            if c.stage.op == op:
                if op == "reward.rule":
                    return rule_eval_scorer(c.config, stage=c.stage.name)
                return function_eval_scorer(c.config, stage=c.stage.name)
    return None


# evaluate(samples_path, on_progress) -> eval metrics, or None on a rank that reports none (the
# job's evaluator of a rank: runtime/control/job.py RankPlacement.evaluator)
Evaluator = Callable[[Optional[Path], Optional[Callable[[int, int], None]]],
                     Optional[dict[str, float]]]


def evaluate_greedy(rollout_engine, prompts, tokenizer, scorer: EvalScorer, *, split: str,
                    limit: Optional[int], batch_size: int, max_new_tokens: int, stop_token_ids=(),
                    samples_path: Optional[Path] = None,
                    on_progress: Optional[Callable[[int, int], None]] = None) -> dict[str, float]:
    """Greedy-decode the first ``limit`` prompts of ``split`` (None = all of it) and score them.

    The slice goes to ``rollout_engine.generate`` in calls of ``batch_size`` prompts (one call
    for the whole split is what a vLLM engine runs fastest). Each response is scored by
    ``scorer.score`` (the graph's verifier: the number after the last ``####`` for GSM8K), and
    when the scorer has them by ``scorer.lenient`` (math-verify's own answer extraction, no
    format needed) and ``scorer.answer_format`` (1.0 when the response carries a parseable
    ``#### <number>`` line, right or wrong).

    Returns:
        ``{}`` when ``limit == 0``; else (all floats, fractions over the ``eval/n`` answers):

        - ``eval/accuracy``: fraction with reward exactly 1 (the strict accuracy; the key's
          meaning since the first release, so curves stay comparable); an unscorable answer
          counts as wrong, and with none scorable it is NaN;
        - ``eval/accuracy_strict``: the same number under its explicit name;
        - ``eval/accuracy_math_verify``: fraction ``scorer.lenient`` accepts (when it has one);
        - ``eval/format_frac``: fraction with the answer format (when it has ``answer_format``);
        - ``eval/math_verify_unformatted_frac``: fraction the lenient verifier accepts that have
          NOT the format (right arithmetic the strict verifier cannot see; when it has both);
        - ``eval/reward_mean`` (mean reward over the scorable answers, shaping included),
          ``eval/unscorable_frac`` (reward NaN), ``eval/n``, ``eval/response_length_mean``
          (tokens), ``eval/truncated_frac``, ``eval/seconds`` (generation and scoring, wall clock).

    Args:
        samples_path: when set, one JSON line per answer (``index``, ``ground_truth``,
            ``response``, ``strict`` (the reward), ``math_verify``, ``format``, ``truncated``)
            is written there.
        on_progress: called ``(answers done, answers in the slice)`` before the first and after
            every ``generate`` call (the console's eval progress).

    Raises:
        ValueError: an empty slice (every prompt longer than ``data.max_prompt_tokens``).
    """
    if limit == 0:
        return {}
    # scoring reads the tokens only: no logprobs (vLLM's slow its decode)
    params = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens,
                            stop_token_ids=list(stop_token_ids), logprobs="none")
    t0 = time.perf_counter()
    rows: list[dict] = []
    # one rank evaluates the whole slice (the others have nothing to add while it decodes)
    batches = list(prompts.eval_batches(limit, batch_size, split=split, shard=False))
    total = sum(len(b) for b in batches)
    if on_progress is not None:
        on_progress(0, total)
    for batch in batches:
        images = batch.images()  # a vision-language eval: the prompts' images (else None)
        out = rollout_engine.generate(batch.prompt_ids, batch.prompt_mask, params,
                                      **({} if images is None else {"images": images}))
        texts = decode_responses(tokenizer, out.response_ids, out.response_mask,
                                 prompts.response_prefix)  # the pre-filled start is answer text
        fields = [{"ground_truth": gt, **f} for gt, f in zip(batch.ground_truth, batch.fields)]
        rewards = scorer.score(texts, fields, batch.prompt_index.tolist())
        for i, text, truth, reward, n_tok, trunc in zip(
                batch.prompt_index.tolist(), texts, batch.ground_truth, rewards,
                out.response_mask.sum(-1).tolist(), out.truncated.tolist()):
            row = {"index": i, "ground_truth": truth, "response": text, "strict": float(reward)}
            if scorer.lenient is not None:
                row["math_verify"] = float(scorer.lenient(text, truth))
            if scorer.answer_format is not None:
                row["format"] = float(scorer.answer_format(text))
            rows.append({**row, "length": int(n_tok), "truncated": bool(trunc)})
        if on_progress is not None:
            on_progress(len(rows), total)
    if not rows:  # every prompt of the slice was longer than data.max_prompt_tokens
        raise ValueError(f"the evaluation slice of split {split!r} is empty: every prompt was "
                         "skipped as too long (data.max_prompt_tokens)")
    if samples_path is not None:
        Path(samples_path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    n = len(rows)
    frac = lambda pred: sum(1 for r in rows if pred(r)) / n  # noqa: E731
    scored = [r["strict"] for r in rows if math.isfinite(r["strict"])]
    # no answer scorable (a reward function that raised on every one): no accuracy at all, not
    # a 0.000 that reads as a model that learned nothing
    strict = frac(lambda r: r["strict"] == 1.0) if scored else math.nan
    out = {"eval/accuracy": strict, "eval/accuracy_strict": strict}
    if scorer.lenient is not None:
        out["eval/accuracy_math_verify"] = frac(lambda r: r["math_verify"] == 1.0)
    if scorer.answer_format is not None:
        out["eval/format_frac"] = frac(lambda r: r["format"] == 1.0)
    if scorer.lenient is not None and scorer.answer_format is not None:
        out["eval/math_verify_unformatted_frac"] = frac(lambda r: r["math_verify"] == 1.0
                                                        and r["format"] != 1.0)
    return {**out, "eval/reward_mean": sum(scored) / len(scored) if scored else math.nan,
            "eval/unscorable_frac": 1 - len(scored) / n, "eval/n": float(n),
            "eval/response_length_mean": sum(r["length"] for r in rows) / n,
            "eval/truncated_frac": frac(lambda r: r["truncated"]),
            "eval/seconds": time.perf_counter() - t0}


def greedy_evaluator(cfg: "TrainConfig", plan: "ExecutionPlan", engine: Any, prompts: Any,
                     tokenizer: Any) -> Evaluator:
    """``trainer.eval`` on ``engine``, scored by the graph's own verifier (``evaluate.eval_scorer``)."""
    from flowrl.ops.multi_turn import eval_engine

    ev, scorer = cfg.trainer.eval, eval_scorer(plan)
    engine = eval_engine(plan, engine, tokenizer)  # a multi-turn graph evaluates with its tools

    def evaluate(samples_path: Optional[Path], on_progress=None) -> dict[str, float]:
        if scorer is None:  # no correctness reward: pre-flight passed it for limit=0 / no eval
            if ev.limit == 0:
                return {}
            raise ValueError("trainer.eval: the graph has no reward.rule or reward.function "
                             "stage to score answers against the ground truth; set "
                             "trainer.eval.limit=0")
        return evaluate_greedy(engine, prompts, tokenizer, scorer, split=ev.split, limit=ev.limit,
                               batch_size=ev.batch_size, max_new_tokens=ev.max_new_tokens,
                               stop_token_ids=cfg.rollout.sampling.stop_token_ids,
                               samples_path=samples_path, on_progress=on_progress)

    return evaluate


def eval_line(m: dict[str, float]) -> str:
    """The console line of an eval: accuracy, and for GSM8K math-verify accuracy and the share of
    ``#### n`` answers; the answers that could not be scored (``eval/unscorable_frac`` > 0)."""
    views = []
    if "eval/accuracy_math_verify" in m:
        views.append(f"math-verify {m['eval/accuracy_math_verify']:.3f}")
    if "eval/format_frac" in m:
        views.append(f"#### format {m['eval/format_frac']:.2f}")
    extra = f" ({', '.join(views)})" if views else ""
    u, n = m.get("eval/unscorable_frac", 0.0), m["eval/n"]
    if u >= 1:  # nothing scored: no accuracy (NaN), said as such
        return (f"no accuracy{extra} on {n:.0f}: none of the {n:.0f} answers could be scored "
                "(the reward function raised or timed out on every one; the run's warnings say why)")
    line = f"accuracy {m['eval/accuracy']:.3f}{extra} on {n:.0f}"
    if u > 0:  # a reward function that raised or timed out: its answers count as wrong above,
        # so an accuracy of 0.000 is not read as a model that learned nothing
        line += (f"; {round(u * n):.0f} of {n:.0f} answers could not be scored (the reward "
                 "function raised or timed out: counted as wrong)")
    return line
