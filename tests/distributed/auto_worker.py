"""torchrun worker: a placement=auto job whose choice after profiling is forced to a partitioned
split (the measured choice on a tiny CPU model is always colocated), to run the real switch:
colocated checkpoint -> partitioned resume. Usage: torchrun --nproc_per_node=2 auto_worker.py <overrides>"""
import sys

import flowrl.runtime.control.auto as auto
from flowrl.config import compose
from flowrl.runtime.io.distributed import teardown
from flowrl.train import train

_decide = auto.decide


def forced(cfg, plan, world_size, profile):
    d = _decide(cfg, plan, world_size, profile)  # the real notes and prediction
    d.update(mode="partitioned", pools={"train": [0], "rollout": [1]},
             prompts_per_step=cfg.trainer.prompts_per_step * world_size,
             notes=d["notes"] + ["forced partitioned by tests/distributed/auto_worker.py"])
    return d


if __name__ == "__main__":
    auto.decide = forced
    try:
        train(compose(sys.argv[1:]))
    finally:
        teardown()
