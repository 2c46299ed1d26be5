"""Built-in environments, by name (``params.env`` of a ``rollout.multi_turn`` stage), and the
lookup of your own (``params.env: "package.module:Class"``, constructed with ``params.env_params``).

- ``tools`` (:class:`ToolEnvironment`): the policy answers a prompt and may call the stage's
  tools on the way. A turn with tool calls is answered with their results (one ``tool`` message
  per call, errors included); a turn without one is the final answer (done, finish reason
  ``answered``). Its reward is 0: score the answer with the graph's reward stages
  (``reward.rule``, ``reward.function``, ...), as a single-turn graph does.
- ``gymnasium`` (:class:`GymnasiumEnvironment`): any environment with the gymnasium API
  (``reset(seed=, options=) -> (obs, info)``, ``step(action) -> (obs, reward, terminated,
  truncated, info)``) whose actions are the policy's text and whose observations are text:
  ``gymnasium.make(env_id)`` or a class by import path.
"""
from __future__ import annotations

import difflib
import inspect
import zlib
from typing import Any, Callable, Mapping, Optional

from flowrl.envs.base import MAX_TURNS, Action, Environment, EnvRow, StepResult


class ToolEnvironment:
    """Answer with tools: tool results are the observations, a turn without calls ends it.

    Args:
        tool_role: the role of observation messages (``tool``; ``user`` for a template without a
            tool role).
    """

    def __init__(self, tool_role: str = "tool") -> None:
        self.tool_role = tool_role

    def reset(self, row: EnvRow) -> None:
        self.row = row

    def step(self, action: Action) -> StepResult:
        if action.truncated or not action.tool_results:
            return StepResult(done=True)
        return StepResult(messages=[{"role": self.tool_role, "name": r.name, "content": r.content}
                                    for r in action.tool_results])


class GymnasiumEnvironment:
    """Adapter for a gymnasium-style text environment.

    The episode is reset with ``seed`` = a hash of the row's group id (the ``n`` samples of a
    prompt see the same episode) and ``options = {"prompt_ids", "ground_truth", "fields"}``;
    its reset observation is not shown (the prompt row is the first turn's context). Each policy
    turn's text is the action; the observation (``str(obs)``) comes back as a message of
    ``obs_role``; ``terminated`` ends the trajectory as ``answered``, ``truncated`` (the
    environment's own time limit) as ``max_turns``.

    Args:
        env_id: a registered gymnasium id, made by ``gymnasium.make(env_id, **kwargs)`` (needs
            ``pip install gymnasium``, or ``pip install flowrl[envs]``).
        entry: instead, ``"package.module:Class"`` of an environment with the same API (a
            ``gymnasium.Env`` subclass or any class), built as ``Class(**kwargs)``.
        kwargs: constructor arguments.
        obs_role: the role of observation messages.

    Raises:
        ValueError: neither or both of ``env_id`` / ``entry``; ImportError: gymnasium missing.
    """

    def __init__(self, env_id: Optional[str] = None, entry: Optional[str] = None,
                 kwargs: Optional[Mapping[str, Any]] = None, obs_role: str = "user") -> None:
        kwargs = dict(kwargs or {})
        if env_id is not None and entry is None:
            try:
                import gymnasium
            except ImportError as e:
                raise ImportError("env=gymnasium with env_id needs gymnasium: pip install "
                                  "gymnasium (or flowrl[envs])") from e
            self.env = gymnasium.make(env_id, **kwargs)
        elif entry is not None and env_id is None:
            self.env = load_class(entry, "env_params.entry")(**kwargs)
        else:
            raise ValueError("gymnasium environment: give exactly one of env_params.env_id "
                             "(gymnasium.make) or env_params.entry ('module:Class')")
        self.obs_role = obs_role

    def reset(self, row: EnvRow) -> None:
        seed = zlib.crc32(str(row.group_id if row.group_id >= 0 else row.index).encode())
        self.env.reset(seed=seed, options={"prompt_ids": row.prompt_ids,
                                           "ground_truth": row.ground_truth, "fields": row.fields})

    def step(self, action: Action) -> StepResult:
        obs, reward, terminated, truncated, _ = self.env.step(action.text)
        done = bool(terminated or truncated)
        return StepResult(messages=[{"role": self.obs_role, "content": str(obs)}],
                          reward=float(reward), done=done,
                          finish_reason=MAX_TURNS if truncated and not terminated else None)


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "tools": ToolEnvironment, "gymnasium": GymnasiumEnvironment}


def load_class(path: str, field: str) -> Callable[..., Any]:
    """Import ``"package.module:Name"`` (the reward-function loader's rules). Raises ValueError
    naming ``field``."""
    from flowrl.rewards.function import load_reward_function

    try:
        return load_reward_function(path)
    except ValueError as e:
        raise ValueError(f"{field}: {str(e).replace('reward function', 'class')}") from None


def env_factory(name: str, params: Mapping[str, Any] | None,
                field: str = "params.env") -> Callable[[], Environment]:
    """A zero-argument constructor of environment ``name`` (a key of :data:`ENVIRONMENTS` or
    ``module:Class``) with ``params``; the arguments are checked against its signature now.

    Raises:
        ValueError: unknown name (with the close match), an import failure, arguments the
            constructor does not take, naming ``field`` / ``params.env_params``.
    """
    if ":" in str(name):
        cls = load_class(name, field)
    elif name in ENVIRONMENTS:
        cls = ENVIRONMENTS[name]
    else:
        close = difflib.get_close_matches(str(name), list(ENVIRONMENTS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ValueError(f"{field}: unknown environment {name!r}{hint}; built-in: "
                         f"{sorted(ENVIRONMENTS)}, or 'module:Class'")
    params = dict(params or {})
    try:
        inspect.signature(cls).bind(**params)
    except TypeError as e:
        raise ValueError(f"params.env_params: environment {name!r} does not take {sorted(params)}: "
                         f"{e}") from None
    except ValueError:  # no signature (a builtin): checked when constructed
        pass
    return lambda: cls(**params)
