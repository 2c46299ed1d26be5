"""The built-in ops: the modules that declare and implement them (``registry.register_op`` on
each function). ``ops/registry.py`` imports them all when it is imported, so every graph file's
vocabulary is known; none of them imports torch at module level (only inside the functions), so
reading the declarations imports no torch.
"""
from __future__ import annotations

import importlib

# imported by name (importlib), not by an import statement: the no-torch contract of
# pyproject.toml then holds for the registry, and tests/unit/test_import_contract.py checks that
# importing these modules really loads no torch
MODULES = (
    "flowrl.ops.sample",
    "flowrl.ops.vision",
    "flowrl.ops.rollout",
    "flowrl.ops.multi_turn",
    "flowrl.ops.reward",
    "flowrl.ops.genrm",
    "flowrl.ops.filter",
    "flowrl.ops.token_rewards",
    "flowrl.ops.logprobs",
    "flowrl.ops.critic",
    "flowrl.ops.advantage",
    "flowrl.ops.update",
)


def load() -> None:
    """Import every module of :data:`MODULES` (idempotent)."""
    for module in MODULES:
        importlib.import_module(module)
