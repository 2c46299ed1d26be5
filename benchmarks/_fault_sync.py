"""A user module of ``benchmarks/faults.py`` that breaks the weight sync, as a plugin that
replaces the rollout engine's loader would: importing it (the run's in-process reward function,
``_fault_sync:length_reward``) makes ``HFRolloutEngine.load_weights`` take every tensor and copy
none. ``rollout.verify_sync`` must stop the run at the first sync."""
from __future__ import annotations

from _fault_rewards import length_reward  # noqa: F401 (the reward the graph names)

from flowrl.engines.rollout.hf import HFRolloutEngine


def _takes_all_copies_nothing(self, named_tensors):
    for _ in named_tensors:
        pass


HFRolloutEngine.load_weights = _takes_all_copies_nothing  # type: ignore[method-assign]
