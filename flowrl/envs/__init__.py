"""Environments and tools for multi-turn rollouts (op ``rollout.multi_turn``).

The policy and an :class:`~flowrl.envs.base.Environment` alternate: the policy writes a turn, the
environment answers with an observation (a tool result, feedback), a reward and whether the
episode is over. The trajectory is kept as token ids from the first turn to the last
(``flowrl/envs/rollout.py``); observations are rendered once, by the chat template, and appended.

Modules (none imports ``flowrl.runtime``; only ``rollout.py`` imports torch):

- ``base.py``: the Environment Protocol and the values it exchanges (EnvRow, Action, StepResult).
- ``tools.py``: tools as Python functions with JSON schemas; run in a worker process pool with a
  timeout and a memory limit (the reward-function pool of ``flowrl/rewards/function.py``).
- ``parsers.py``: tool-call formats of model outputs (``hermes``: ``<tool_call>{json}</tool_call>``).
- ``chat.py``: tools in the prompt (``apply_chat_template(tools=)``), observation tokens.
- ``calculator.py``: a safe arithmetic evaluator (the example tool; no ``eval``).
- ``library.py``: built-in environments (``tools``: answer with tools, scored by a verifier;
  ``gymnasium``: adapter for a gymnasium-style text environment).
- ``rollout.py``: the turn loop over any RolloutEngine.
"""
