"""The params of a ``rollout.multi_turn`` stage (:class:`MultiTurnConfig`), torch-free: the op's
declaration (``flowrl/ops/multi_turn.py``) names it, so a graph with a multi-turn stage is validated
and planned without importing torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from flowrl.envs.parsers import TOOL_CALL_FORMATS
from flowrl.envs.tools import resolve_tools


@dataclass
class MultiTurnConfig:
    """Params of a ``rollout.multi_turn`` stage.

    Attributes:
        env: the environment: a built-in name (``tools``, ``gymnasium``;
            ``flowrl/envs/library.py``) or ``"package.module:Class"`` (the Environment Protocol
            of ``flowrl/envs/base.py``), one instance per trajectory.
        env_params: keyword arguments of its constructor.
        tools: tools offered to the policy (names, ``module:function`` paths or mappings with a
            schema: ``flowrl/envs/tools.py``); their schemas are put in every prompt by the chat
            template. Empty = no tool calls are parsed.
        tool_call_format: how calls are parsed from a turn (``flowrl/envs/parsers.py``:
            ``hermes``).
        max_turns: policy turns per trajectory (>= 1; 1 = one response, as rollout.generate).
        max_total_tokens: tokens of the whole response region (policy + observations): the
            width R of ``response_ids`` is at most this.
        max_new_tokens_per_turn: tokens of one policy turn; None = ``rollout.sampling.max_new_tokens``.
        max_tool_errors: failed tool calls that end a trajectory (``tool_failure``); None = never.
        continue_cut_turns: a turn cut by ``max_new_tokens_per_turn`` (no stop token, budget
            left) is stepped like a finished one (its tool calls run, the observation follows
            it directly) instead of ending the trajectory as ``max_tokens``.
        tool_workers: tool worker processes (0 = in the trainer's process: no memory cap).
        tool_timeout_s: seconds one tool call may take (then its worker is stopped); None = no limit.
        tool_memory_mb: address-space cap of each tool worker (MiB); None = none.
        max_tool_output_chars: a longer tool output is cut (the policy sees ``...``).
    """

    env: str = "tools"
    env_params: dict = field(default_factory=dict)
    tools: list = field(default_factory=list)
    tool_call_format: str = "hermes"
    max_turns: int = 4
    max_total_tokens: int = 512
    max_new_tokens_per_turn: Optional[int] = None
    max_tool_errors: Optional[int] = None
    continue_cut_turns: bool = False
    tool_workers: int = 2
    tool_timeout_s: Optional[float] = 10.0
    tool_memory_mb: Optional[int] = 2048
    max_tool_output_chars: int = 2000
    tool_specs: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from flowrl.envs.library import env_factory

        for name in ("max_turns", "max_total_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"params.{name} must be an int >= 1, got {v!r}")
        if self.max_new_tokens_per_turn is not None and self.max_new_tokens_per_turn < 1:
            raise ValueError(f"params.max_new_tokens_per_turn must be >= 1 or null, "
                             f"got {self.max_new_tokens_per_turn}")
        if self.max_tool_errors is not None and self.max_tool_errors < 1:
            raise ValueError(f"params.max_tool_errors must be >= 1 or null, got {self.max_tool_errors}")
        if self.tool_workers < 0:
            raise ValueError(f"params.tool_workers must be >= 0, got {self.tool_workers}")
        if self.tool_timeout_s is not None and self.tool_timeout_s < 0:
            raise ValueError(f"params.tool_timeout_s must be >= 0, got {self.tool_timeout_s}")
        if self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"params.tool_call_format must be one of {sorted(TOOL_CALL_FORMATS)}, "
                             f"got {self.tool_call_format!r}")
        self.tool_specs = tuple(resolve_tools(self.tools))
        env_factory(self.env, self.env_params)  # unknown env / bad arguments: now

    @property
    def tool_schemas(self) -> list[dict]:
        """The tools' JSON schemas, as the chat template takes them."""
        return [t.schema for t in self.tool_specs]
