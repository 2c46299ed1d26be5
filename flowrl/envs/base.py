"""The environment Protocol of multi-turn rollouts and the values it exchanges.

One Environment instance serves one trajectory: ``reset`` with the prompt row, then one ``step``
per policy turn until a step says ``done`` (or the turn loop stops it: ``max_turns``,
``max_total_tokens``, too many tool errors). Tool calls in a turn are parsed and executed by the
turn loop *before* ``step`` (all trajectories' calls of a round at once, in the tool pool), so the
environment receives their results in :attr:`Action.tool_results` and stays cheap and
single-threaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

# why a trajectory ended (the turn loop's ``finish_reason`` per row)
ANSWERED = "answered"        # the environment said done (e.g. a final answer without tool call)
MAX_TURNS = "max_turns"      # max_turns policy turns and the environment still wanted more
MAX_TOKENS = "max_tokens"    # a turn hit its token limit (or the trajectory's), or an
#                              observation would not fit in max_total_tokens
TOOL_FAILURE = "tool_failure"  # max_tool_errors failed tool calls
FINISH_REASONS = (ANSWERED, MAX_TURNS, MAX_TOKENS, TOOL_FAILURE)


@dataclass
class EnvRow:
    """What an environment is reset from: one row of the batch.

    Attributes:
        index: row in the batch.
        prompt_ids: the prompt's token ids (left padding removed).
        ground_truth: the row's reference answer (None when the graph binds none).
        fields: the prompt record's fields when the prompt source knows them (``question``,
            ``data.extra_keys`` columns); else empty.
        group_id: the prompt instance (``-1`` when unbound).
    """

    index: int
    prompt_ids: list[int]
    ground_truth: Any = None
    fields: dict[str, Any] = field(default_factory=dict)
    group_id: int = -1


@dataclass
class ToolResult:
    """One tool call of a turn and what came of it.

    Attributes:
        name: the tool the policy named ("" when the call did not parse).
        arguments: its parsed arguments.
        content: the tool's output as text, or the error message the policy will read.
        ok: False for a call that did not parse, an unknown tool, arguments the schema rejects,
            a raise, a timeout, a dead worker or an output that is not text/JSON.
        status: ``ok``, ``parse_error``, ``unknown_tool``, ``bad_arguments``, ``error``,
            ``timeout``, ``bad_output``, or ``not_run`` (a call in the ``max_turns``-th turn:
            counted, never executed, ``ok`` True, empty content).
        seconds: the pool's wall time for the round's calls, divided by their number (0 for
            calls that never ran).
    """

    name: str
    arguments: dict[str, Any]
    content: str
    ok: bool
    status: str = "ok"
    seconds: float = 0.0


@dataclass
class Action:
    """One policy turn, as the environment sees it.

    Attributes:
        text: the turn decoded (special tokens dropped).
        token_ids: the turn's token ids as sampled (the stop token included when it stopped).
        turn: 0-based index of this policy turn.
        truncated: the turn hit its token limit without a stop token: the loop ends the
            trajectory after this step whatever it returns (its reward still counts).
        tool_results: the turn's tool calls, executed (empty without tools or calls).
    """

    text: str
    token_ids: list[int]
    turn: int
    truncated: bool = False
    tool_results: list[ToolResult] = field(default_factory=list)


@dataclass
class StepResult:
    """An environment's answer to one turn.

    Attributes:
        messages: the observation as chat messages (``{"role": "tool" | "user", "content": ...}``),
            rendered by the tokenizer's chat template into the next turn's context.
        token_ids: the observation as token ids instead (used verbatim; takes precedence over
            ``messages``). Must end where the policy's next turn starts (for a chat model: after
            the assistant generation prefix).
        reward: added to the trajectory's reward (``rewards`` = the sum over its steps; NaN =
            unscorable).
        done: the episode is over (finish reason ``answered`` unless ``finish_reason`` says
            otherwise); the observation is then dropped.
        finish_reason: one of :data:`FINISH_REASONS` to report when ``done``; None = ``answered``.
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    token_ids: Optional[list[int]] = None
    reward: float = 0.0
    done: bool = False
    finish_reason: Optional[str] = None


class Environment(Protocol):
    """One trajectory's environment (implementations: ``flowrl/envs/library.py``, your own class
    named by ``module:Class`` in the stage's ``params.env``)."""

    def reset(self, row: EnvRow) -> None:
        """Start an episode for ``row`` (its prompt is the first turn's context)."""
        ...

    def step(self, action: Action) -> StepResult:
        """React to the policy's turn (its tool calls already executed)."""
        ...
