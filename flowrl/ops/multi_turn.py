"""Multi-turn, tool-using rollouts as a graph stage: ``rollout.multi_turn``, usable wherever
``rollout.generate`` is (same inputs, same standard outputs).

The turn loop, environments and tools live in ``flowrl/envs/`` (``rollout.py`` has the rules);
this op binds them to a stage: the rollout role's engine, the run's sampling settings and
tokenizer, the rows' ground truth and prompt fields. Its ``response_mask`` covers the policy's
own tokens only, so estimators, losses and placements take its outputs unchanged; the train
engines attend to the environment tokens between turns as context
(``flowrl.algorithms.masks.response_attention_mask``).
"""
from __future__ import annotations

import atexit
from typing import TYPE_CHECKING, Any

from flowrl.envs.base import FINISH_REASONS, EnvRow
from flowrl.envs.config import MultiTurnConfig
from flowrl.ops.fields import PROMPT, RESPONSE, MultiTurnRollout
from flowrl.ops.registry import register_op

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.engines.base import RolloutEngine
    from flowrl.envs.rollout import MultiTurnSession
    from flowrl.ops.context import StageContext


OP_NAME = "rollout.multi_turn"
STANDARD_OUTPUTS = RESPONSE + ("rollout_logprobs", "truncated")
# per-trajectory metadata, which a graph may leave unconsumed
INFO_OUTPUTS = ("rewards", "num_turns", "num_tool_calls", "num_tool_errors", "finish_reason")

# one session (tool pool, renderer) per compiled stage config, reused across steps
_SESSIONS: dict[int, tuple[MultiTurnConfig, Any, MultiTurnSession]] = {}


def session_for(cfg: MultiTurnConfig, tokenizer) -> MultiTurnSession:
    """The stage's :class:`MultiTurnSession` (built on first use, closed at exit)."""
    from flowrl.envs.rollout import MultiTurnSession

    entry = _SESSIONS.get(id(cfg))
    if entry is None or entry[0] is not cfg or entry[1] is not tokenizer:
        session = MultiTurnSession(cfg, tokenizer)
        _SESSIONS[id(cfg)] = (cfg, tokenizer, session)
        atexit.register(session.close)
        return session
    return entry[2]


def _rows(ctx: StageContext, prompt_ids, prompt_mask, ground_truth, group_id) -> list[EnvRow]:
    source = ctx.run.prompts_or_none
    mask = prompt_mask.bool().cpu()
    ids = prompt_ids.cpu()
    gids = group_id.tolist() if group_id is not None else [-1] * ids.shape[0]
    rows = []
    for i in range(ids.shape[0]):
        fields: dict[str, Any] = {}
        if source is not None and gids[i] >= 0:
            rec = source.record_for_group(gids[i])
            if rec is not None:
                fields = {"question": rec.get("question", ""), **rec.get("fields", {})}
        rows.append(EnvRow(index=i, prompt_ids=ids[i][mask[i]].tolist(),
                           ground_truth=None if ground_truth is None else ground_truth[i],
                           fields=fields, group_id=int(gids[i])))
    return rows


def multi_turn_stages(plan) -> list:
    """The plan's compiled ``rollout.multi_turn`` stages."""
    return [c for c in plan.stages if c.stage.op == OP_NAME]


def check_multi_turn(plan, cfg) -> None:
    """Run-level checks of a graph with ``rollout.multi_turn`` stages, before any model loads;
    puts the stage's tool schemas into ``cfg.data.tools`` so every prompt offers them.

    Raises:
        ValueError: two multi-turn stages offering different tools (one prompt set cannot offer
            both), or ``data.tools`` set by hand to other tools than the stage's.
    """
    stages = multi_turn_stages(plan)
    if not stages:
        return
    schemas = [c.config.tool_schemas for c in stages]
    for c, s in zip(stages[1:], schemas[1:]):
        if s != schemas[0]:
            raise ValueError(f"stage '{c.stage.name}', field 'params.tools': the prompts offer the "
                             f"tools of stage '{stages[0].stage.name}'; give both stages the same tools")
    given = list(cfg.data.tools or [])
    if given and given != schemas[0]:
        raise ValueError(f"data.tools is set by hand to other tools than stage "
                         f"'{stages[0].stage.name}' params.tools; leave data.tools empty (the run "
                         "fills it from the stage)")
    cfg.data.tools = schemas[0]


@register_op(OP_NAME, inputs=PROMPT, optional_inputs=("ground_truth", "group_id"),
             outputs=STANDARD_OUTPUTS + INFO_OUTPUTS, config=MultiTurnConfig, roles=("rollout",),
             multi_turn_outputs=RESPONSE + ("rollout_logprobs",), info_outputs=INFO_OUTPUTS,
             check=check_multi_turn)
def multi_turn(ctx: StageContext[RolloutEngine], cfg: MultiTurnConfig, *, prompt_ids: Tensor,
               prompt_mask: Tensor, ground_truth: list[str] | None = None,
               group_id: Tensor | None = None) -> MultiTurnRollout:
    """Policy and environment alternate per prompt (tools, max_turns); standard outputs.

    The turn loop is ``flowrl/envs/rollout.py``'s.

    Inputs: prompt_ids/prompt_mask (B, P) left-padded (rendered with the stage's tools: the run
    puts ``params.tools`` into ``data.tools``); optional ground_truth (B strings) and group_id
    (B,) for the environments' ``reset``.

    Outputs: response_ids (B, R) int64 right-padded, policy and environment tokens;
    response_mask (B, R) bool, the policy's tokens only; rollout_logprobs (B, R) float32, 0
    off the mask; truncated (B,) bool (finish reason ``max_tokens``); rewards (B,) float32, the
    environment's summed step rewards; num_turns, num_tool_calls, num_tool_errors (B,) int64;
    finish_reason: B strings (answered | max_turns | max_tokens | tool_failure).

    Logged: ``response/*`` as rollout.generate (policy tokens), ``multi_turn/turns_mean``,
    ``/tool_calls_mean``, ``/tool_errors_mean``, ``/env_tokens_mean``, ``/finish_<reason>_frac``,
    ``/env_reward_mean``, ``/rounds`` (generate calls), ``/prefix_cache_hit_frac`` (context
    tokens vLLM's prefix cache served; 0 for engines that do not report it), ``perf/tool_s``, ``perf/env_s``, ``perf/rollout_generate_s``,
    ``perf/rollout_tokens_per_s`` (policy tokens per generate second).
    """
    session = session_for(cfg, ctx.run.tokenizer)
    from flowrl.ops.rollout import step_sampling

    out = session.run(ctx.engine, prompt_ids, prompt_mask, step_sampling(ctx),
                      rows=_rows(ctx, prompt_ids, prompt_mask, ground_truth, group_id),
                      generator=ctx.generator)
    lengths = out.response_mask.sum(-1).float()
    total = (out.response_mask.flip(1).cummax(1).values).sum(-1).float()
    B = float(len(out.finish_reason))
    metrics: dict[str, float | Tensor] = {
        "response/length_mean": lengths.mean(), "response/length_max": lengths.max(),
        "response/truncated_frac": out.truncated.float().mean(),
        "perf/rollout_tokens_per_s": lengths.sum() / max(out.generate_s, 1e-9),
        "perf/rollout_generate_s": out.generate_s, "perf/tool_s": out.tool_s,
        "perf/env_s": out.env_s,
        "multi_turn/turns_mean": out.num_turns.float().mean(),
        "multi_turn/tool_calls_mean": out.num_tool_calls.float().mean(),
        "multi_turn/tool_errors_mean": out.num_tool_errors.float().mean(),
        "multi_turn/env_tokens_mean": (total - lengths).mean(),
        "multi_turn/env_reward_mean": out.rewards.nanmean(),
        "multi_turn/rounds": out.rounds,
        "multi_turn/prefix_cache_hit_frac": out.cached_tokens / max(out.context_tokens, 1),
        **{f"multi_turn/finish_{r}_frac": sum(f == r for f in out.finish_reason) / B
           for r in FINISH_REASONS},
    }
    ctx.log(**metrics)
    dev = prompt_ids.device
    return {"response_ids": out.response_ids.to(dev), "response_mask": out.response_mask.to(dev),
            "rollout_logprobs": out.rollout_logprobs.to(dev), "truncated": out.truncated.to(dev),
            "rewards": out.rewards.to(dev), "num_turns": out.num_turns.to(dev),
            "num_tool_calls": out.num_tool_calls.to(dev),
            "num_tool_errors": out.num_tool_errors.to(dev), "finish_reason": out.finish_reason}


def eval_engine(plan, engine, tokenizer):
    """The engine an evaluation generates with: a graph with a ``rollout.multi_turn`` stage
    evaluates whole trajectories with that stage's environment and tools
    (:class:`MultiTurnEngine`), any other graph ``engine`` itself."""
    from flowrl.envs.rollout import MultiTurnEngine

    stages = multi_turn_stages(plan)
    if not stages:
        return engine
    return MultiTurnEngine(engine, session_for(stages[0].config, tokenizer))
