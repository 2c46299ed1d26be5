"""A 2-rank job for the launcher's fault tests (tests/unit/test_launcher_faults.py): all-reduces
one tensor per step through flowrl's process group, peer monitor and crash report, and rank 1
ends itself at step 3 the way an operator's accident would.

    torchrun --standalone --nproc_per_node=2 tests/distributed/fault_worker.py dead|frozen RUN_DIR
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

from flowrl.ops.collectives import all_reduce_sum
from flowrl.runtime.control import recovery
from flowrl.runtime.io import distributed as fdist
from flowrl.runtime.io import supervisor_dir

HEARTBEAT_TIMEOUT_S = 3.0


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    recovery.stop_on_sigterm()
    try:
        info = fdist.init_distributed("cpu", timeout_s=120.0,
                                      heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        recovery.stop_on_silent_peer(out)
        if info.rank == 0:
            supervisor_dir.announce_run_dir(out)
        for step in range(1, 100):
            fdist.mark_step(step)
            if step == 3 and info.rank == 1:
                time.sleep(1.5)  # rank 0's monitor reads this step's heartbeat first
                os.kill(os.getpid(), signal.SIGKILL if mode == "dead" else signal.SIGSTOP)
            all_reduce_sum(torch.ones(1))
        return 0
    except BaseException as e:
        return recovery.report_crash(e, out)
    finally:
        fdist.teardown()


if __name__ == "__main__":
    sys.exit(main())
