"""torchrun worker: ``flowrl.train.train`` with every checkpoint save recorded (step, async) per
rank in ``<output_dir>/saves_rank<R>.jsonl``, so a test sees how each rank saved.
Usage: torchrun --nproc_per_node=2 job_worker.py <overrides>; ``placement=auto``: the choice
after profiling is forced to the partitioned split train [0] / rollout [1], as in auto_worker.py."""
import json
import os
import sys
from pathlib import Path

import flowrl.runtime.control.auto as auto
from flowrl.config import compose
from flowrl.runtime.io.checkpoint import CheckpointManager
from flowrl.runtime.io.distributed import teardown
from flowrl.train import train

_save, _decide = CheckpointManager.save, auto.decide


def recorded_save(self, step, tensors, meta, *, async_save=False):
    with open(Path(self.root).parent / f"saves_rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "async": async_save}) + "\n")
    return _save(self, step, tensors, meta, async_save=async_save)


def forced(cfg, plan, world_size, profile):
    d = _decide(cfg, plan, world_size, profile)
    d.update(mode="partitioned", pools={"train": [0], "rollout": [1]},
             prompts_per_step=cfg.trainer.prompts_per_step * world_size)
    return d


if __name__ == "__main__":
    CheckpointManager.save = recorded_save
    auto.decide = forced
    try:
        train(compose(sys.argv[1:]))
    finally:
        teardown()
