"""The multi-turn turn loop over any RolloutEngine: token in, token out.

For each prompt row the policy and an environment alternate. Every *round* sends the next turn
of every unfinished trajectory to the engine as ONE ``generate`` call (left-padded token-id
contexts of different lengths, the seam of ``flowrl.engines.base.RolloutEngine``), so
trajectories at different turns share the engine's batch; vLLM gets them as token ids and
reuses the KV blocks of each context's earlier turns from its prefix cache. Then all tool calls
of the round run at once in the tool pool, and each environment steps on its turn.

A trajectory is a list of token ids built turn after turn: the ids the engine sampled (mask 1,
their sampler logprobs) and the observation ids rendered once by the chat template (mask 0,
logprob 0). Nothing is re-tokenised, so turn k's ids are exactly the first ids of turn k+1's
context and the trainer scores the tokens that were sampled.

Rules (the per-row ``finish_reason``, ``flowrl.envs.base.FINISH_REASONS``):

- a turn is at most ``max_new_tokens_per_turn`` tokens (None: ``rollout.sampling.max_new_tokens``)
  and never more than what is left of ``max_total_tokens`` (the whole response region: policy
  and observation tokens); a turn that ends without a stop token ends the trajectory
  (``max_tokens``, ``truncated``): a cut-off turn is no complete message to act on (with
  ``continue_cut_turns`` a turn cut by the per-turn limit goes on to its step instead);
- after its step the environment's ``done`` ends it (``answered``, or the reason it gives);
- ``max_tool_errors`` failed tool calls end it (``tool_failure``);
- the ``max_turns``-th turn ends it (``max_turns``) unless the environment was done (its tool
  calls are counted and handed to the environment as ``not_run``, never executed: nobody could
  read their results);
- an observation that would leave no room for one more policy token ends it (``max_tokens``).

The observation of a step that ends the trajectory is dropped, so every row ends with a policy
token and ``response_mask``'s last True is the row's last real token: the train engines attend
to every response position up to it (``flowrl.algorithms.masks.response_attention_mask``).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor

from flowrl.engines.base import RolloutBatch, RolloutEngine, SamplingConfig
from flowrl.envs.base import (
    ANSWERED,
    FINISH_REASONS,
    MAX_TOKENS,
    MAX_TURNS,
    TOOL_FAILURE,
    Action,
    Environment,
    EnvRow,
    ToolResult,
)
from flowrl.envs.config import MultiTurnConfig
from flowrl.envs.parsers import TOOL_CALL_FORMATS, ParsedCall


@dataclass
class MultiTurnBatch:
    """The loop's output; B rows, R = the longest trajectory's response region.

    Attributes:
        response_ids: (B, R) int64, right-padded with the pad id: policy and observation tokens.
        response_mask: (B, R) bool, True on the policy's own tokens only.
        rollout_logprobs: (B, R) float32, the sampler's logprobs; 0 where the mask is False.
        truncated: (B,) bool, finish reason ``max_tokens``.
        rewards: (B,) float32, the sum of the environment's step rewards.
        num_turns, num_tool_calls, num_tool_errors: (B,) int64.
        finish_reason: B strings of ``FINISH_REASONS``.
        turn_spans: per row, the (start, end) columns of each policy turn in the response.
        generate_s, tool_s, env_s: wall seconds in the engine, the tool pool, the environments.
        rounds: generate calls made.
        context_tokens, cached_tokens: context tokens sent to the engine over all rounds, and
            how many its prefix cache served (engines that report it: vLLM, in process or in
            engine processes; else 0).
    """

    response_ids: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    truncated: Tensor
    rewards: Tensor
    num_turns: Tensor
    num_tool_calls: Tensor
    num_tool_errors: Tensor
    finish_reason: list[str]
    turn_spans: list[list[tuple[int, int]]]
    generate_s: float = 0.0
    tool_s: float = 0.0
    env_s: float = 0.0
    rounds: int = 0
    context_tokens: int = 0
    cached_tokens: int = 0

    def as_rollout_batch(self) -> RolloutBatch:
        """The standard-name part (what ``RolloutEngine.generate`` returns)."""
        return RolloutBatch(self.response_ids, self.response_mask, self.rollout_logprobs,
                            self.truncated)


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r):] = True
    return ids, mask


class _Trajectory:
    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.ids: list[int] = []
        self.mask: list[bool] = []
        self.lps: list[float] = []
        self.spans: list[tuple[int, int]] = []
        self.turns = self.calls = self.errors = 0
        self.reward = 0.0
        self.finish: Optional[str] = None


def run_multi_turn(engine: RolloutEngine, prompt_ids: Tensor, prompt_mask: Tensor, rows: Sequence[EnvRow],
                   envs: Sequence[Environment], sampling: SamplingConfig, cfg: MultiTurnConfig,
                   tokenizer: Any, *, render: Callable[[list[dict]], list[int]],
                   run_tools: Optional[Callable[[list[ParsedCall]], list[ToolResult]]] = None,
                   generator: torch.Generator | None = None) -> MultiTurnBatch:
    """Run every row's trajectory to its end (module docstring).

    Args:
        engine: a RolloutEngine (``generate(ids, mask, params, generator) -> RolloutBatch``).
        prompt_ids, prompt_mask: (B, P) left-padded prompts, on any device.
        rows: B environment rows (``reset`` input); envs: B fresh environments.
        sampling: the run's sampling settings (temperature, stop ids, ...); ``max_new_tokens``
            is replaced per round by the turn's limit.
        cfg: the stage's params.
        tokenizer: decodes turns (``decode(ids, skip_special_tokens=True)``); gives the pad id.
        render: observation messages -> token ids (``ObservationRenderer.render``).
        run_tools: executes a round's parsed calls (``ToolRunner.run``); needed when
            ``cfg.tool_specs`` is not empty.
        generator: seeds each round's ``generate`` call.

    Returns:
        :class:`MultiTurnBatch` on the host.

    Raises:
        ValueError: shapes disagree, or an environment returns a finish reason not in
            ``FINISH_REASONS``.
    """
    B = prompt_ids.shape[0]
    if prompt_mask.shape != prompt_ids.shape or len(rows) != B or len(envs) != B:
        raise ValueError(f"run_multi_turn: prompt_ids {tuple(prompt_ids.shape)}, prompt_mask "
                         f"{tuple(prompt_mask.shape)}, {len(rows)} rows, {len(envs)} environments")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    parse = TOOL_CALL_FORMATS[cfg.tool_call_format] if cfg.tool_specs else None
    per_turn = cfg.max_new_tokens_per_turn or sampling.max_new_tokens
    ids_h, mask_h = prompt_ids.cpu(), prompt_mask.bool().cpu()
    trajs = [_Trajectory(ids_h[i][mask_h[i]].tolist()) for i in range(B)]
    t_env = time.perf_counter()
    for env, row in zip(envs, rows):
        env.reset(row)
    env_s, gen_s, tool_s, rounds = time.perf_counter() - t_env, 0.0, 0.0, 0
    ctx_tokens = cached = 0
    active = list(range(B))
    device = engine.device
    while active:
        # ---- one generate call for every unfinished trajectory, whatever its turn
        budgets = [cfg.max_total_tokens - len(trajs[i].ids) for i in active]
        params = dataclasses.replace(sampling, max_new_tokens=max(1, min(per_turn, max(budgets))))
        ctx_ids, ctx_mask = _left_pad([trajs[i].prompt + trajs[i].ids for i in active], pad_id)
        t0 = time.perf_counter()
        out = engine.generate(ctx_ids.to(device), ctx_mask.to(device), params, generator=generator)
        gen_s += time.perf_counter() - t0
        rounds += 1
        ctx_tokens += int(ctx_mask.sum())
        cached += int(engine.last_prefix_cache.get("cached_tokens", 0))
        r_ids, r_mask = out.response_ids.cpu(), out.response_mask.cpu()
        r_lps, r_trunc = out.rollout_logprobs.cpu().float(), out.truncated.cpu()
        actions: dict[int, Action] = {}
        calls: dict[int, list[ParsedCall]] = {}
        for j, i in enumerate(active):
            t = trajs[i]
            toks = r_ids[j][r_mask[j]].tolist()
            turn_lps = r_lps[j][r_mask[j]].tolist()
            stopped = not bool(r_trunc[j])
            budget = cfg.max_total_tokens - len(t.ids)
            if len(toks) > min(per_turn, budget):  # the round's limit was another row's
                toks, turn_lps, stopped = toks[:min(per_turn, budget)], turn_lps[:min(per_turn, budget)], False
            if not stopped and cfg.continue_cut_turns and len(toks) < budget:
                stopped = True  # cut by the per-turn limit with room left: the env decides
            t.spans.append((len(t.ids), len(t.ids) + len(toks)))
            t.ids += toks
            t.mask += [True] * len(toks)
            t.lps += turn_lps
            t.turns += 1
            text = tokenizer.decode(toks, skip_special_tokens=True)
            actions[i] = Action(text=text, token_ids=list(toks), turn=t.turns - 1,
                                truncated=not stopped)
            if stopped and parse is not None:
                parsed = parse(text)
                if t.turns < cfg.max_turns:
                    calls[i] = parsed
                else:  # the last allowed turn: nobody could read results, so none run; the
                    # environment still sees that calls were made (not an answer: max_turns)
                    actions[i].tool_results = [ToolResult(c.name, c.arguments, "", True, "not_run")
                                               for c in parsed]
                    t.calls += len(parsed)
        # ---- every tool call of the round at once
        flat = [(i, c) for i in calls for c in calls[i]]
        if flat:
            if run_tools is None:
                raise ValueError("run_multi_turn: tool calls to run but no run_tools given")
            t0 = time.perf_counter()
            results = run_tools([c for _, c in flat])
            tool_s += time.perf_counter() - t0
            for (i, _), res in zip(flat, results):
                actions[i].tool_results.append(res)
                trajs[i].calls += 1
                trajs[i].errors += not res.ok
        # ---- each environment steps on its turn
        still = []
        t0 = time.perf_counter()
        for i in active:
            t, action = trajs[i], actions[i]
            step = envs[i].step(action)
            t.reward += float(step.reward)
            if action.truncated:
                t.finish = MAX_TOKENS
            elif step.done:
                t.finish = step.finish_reason or ANSWERED
                if t.finish not in FINISH_REASONS:
                    raise ValueError(f"environment {type(envs[i]).__name__} returned finish reason "
                                     f"{t.finish!r}; expected one of {FINISH_REASONS}")
            elif cfg.max_tool_errors is not None and t.errors >= cfg.max_tool_errors:
                t.finish = TOOL_FAILURE
            elif t.turns >= cfg.max_turns:
                t.finish = MAX_TURNS
            else:
                obs = list(step.token_ids) if step.token_ids is not None else render(step.messages)
                if len(t.ids) + len(obs) >= cfg.max_total_tokens:
                    t.finish = MAX_TOKENS
                else:
                    t.ids += obs
                    t.mask += [False] * len(obs)
                    t.lps += [0.0] * len(obs)
                    still.append(i)
        env_s += time.perf_counter() - t0
        active = still
    R = max(1, max(len(t.ids) for t in trajs))
    ids = torch.full((B, R), pad_id, dtype=torch.long)
    mask = torch.zeros((B, R), dtype=torch.bool)
    lps = torch.zeros((B, R), dtype=torch.float32)
    for i, t in enumerate(trajs):
        n = len(t.ids)
        ids[i, :n] = torch.tensor(t.ids, dtype=torch.long)
        mask[i, :n] = torch.tensor(t.mask, dtype=torch.bool)
        lps[i, :n] = torch.tensor(t.lps, dtype=torch.float32)
    lps = torch.where(mask, lps, torch.zeros_like(lps))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return MultiTurnBatch(
        response_ids=ids, response_mask=mask, rollout_logprobs=lps,
        truncated=torch.tensor([t.finish == MAX_TOKENS for t in trajs], dtype=torch.bool),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        num_turns=as_long([t.turns for t in trajs]), num_tool_calls=as_long([t.calls for t in trajs]),
        num_tool_errors=as_long([t.errors for t in trajs]),
        finish_reason=[t.finish or MAX_TURNS for t in trajs],
        turn_spans=[t.spans for t in trajs], generate_s=gen_s, tool_s=tool_s, env_s=env_s,
        rounds=rounds, context_tokens=ctx_tokens, cached_tokens=cached)


class MultiTurnSession:
    """What a stage keeps across steps: the tools' worker pool, the observation renderer and
    the environment constructor, for one config and tokenizer.

    Args:
        cfg: the stage's params. tokenizer: the policy's tokenizer (chat template, EOS).
    """

    def __init__(self, cfg: MultiTurnConfig, tokenizer: Any) -> None:
        from flowrl.data.chat import ObservationRenderer
        from flowrl.envs.library import env_factory
        from flowrl.envs.tools import ToolRunner

        self.cfg, self.tokenizer = cfg, tokenizer
        self.renderer = ObservationRenderer(tokenizer)
        self.make_env = env_factory(cfg.env, cfg.env_params)
        self.tools = ToolRunner(cfg.tool_specs, num_workers=cfg.tool_workers,
                                timeout_s=cfg.tool_timeout_s, memory_mb=cfg.tool_memory_mb,
                                max_output_chars=cfg.max_tool_output_chars) if cfg.tool_specs else None

    def run(self, engine: RolloutEngine, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingConfig,
            rows: Optional[Sequence[EnvRow]] = None,
            generator: torch.Generator | None = None) -> MultiTurnBatch:
        """:func:`run_multi_turn` with fresh environments; ``rows`` None = rows holding only the
        prompt ids."""
        B = prompt_ids.shape[0]
        if rows is None:
            m = prompt_mask.bool().cpu()
            rows = [EnvRow(index=i, prompt_ids=prompt_ids[i].cpu()[m[i]].tolist()) for i in range(B)]
        return run_multi_turn(engine, prompt_ids, prompt_mask, rows,
                              [self.make_env() for _ in range(B)], sampling, self.cfg,
                              self.tokenizer, render=self.renderer.render,
                              run_tools=None if self.tools is None else self.tools.run,
                              generator=generator)

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()


class MultiTurnEngine:
    """A RolloutEngine whose ``generate`` runs whole multi-turn trajectories (the evaluation of
    a graph with a ``rollout.multi_turn`` stage: the answers it scores had their tools).

    ``response_ids`` hold observation tokens too, ``response_mask`` the policy's tokens only, so
    decoding with the mask gives the policy's text of every turn. Device, weights and memory
    moves are the wrapped engine's.
    """

    def __init__(self, engine: RolloutEngine, session: MultiTurnSession) -> None:
        self.engine, self.session = engine, session
        self.device = engine.device
        self.shared = engine.shared

    @property
    def last_timings(self) -> dict[str, float]:
        return self.engine.last_timings

    @property
    def last_prefix_cache(self) -> dict[str, int]:
        return self.engine.last_prefix_cache

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingConfig,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        out = self.session.run(self.engine, prompt_ids, prompt_mask, params, generator=generator)
        batch = out.as_rollout_batch()
        dev = prompt_ids.device
        return RolloutBatch(*(t.to(dev) for t in (batch.response_ids, batch.response_mask,
                                                  batch.rollout_logprobs, batch.truncated)))

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    def offload(self, keep_weights: bool = False) -> None:
        self.engine.offload(keep_weights=keep_weights)

    def onload(self) -> None:
        self.engine.onload()

    def close(self) -> None:
        """The wrapped engine is the run's: its owner closes it (the session's tools: at exit)."""
