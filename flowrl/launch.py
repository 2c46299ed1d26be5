"""``flowrl train launcher.nproc=N …``: run the job under ``torchrun`` (no home-made launcher:
torchrun's agent runs in this process, ``runtime/control/supervise.py``, so a failed job ends naming
the rank that died or went silent and the resume command).

    flowrl train launcher.nproc=2 model=tiny trainer=smoke
      == torchrun --standalone --nproc_per_node=2 -m flowrl.train launcher.nproc=2 model=tiny trainer=smoke

Multi-node (run the same command on every node; torchrun's c10d rendezvous pairs them up)::

    flowrl train launcher.nproc=8 launcher.nnodes=2 launcher.rdzv_endpoint=node0:29500 \\
        launcher.rdzv_id=job42 trainer.output_dir=/shared/runs/job42 ...

``trainer.output_dir`` must then be on a file system every node sees (DCP checkpoints are written by
all ranks into one folder). On Slurm: ``sbatch scripts/slurm.sbatch`` (one torchrun per node).
"""
from __future__ import annotations

import sys

from flowrl.config import LauncherConfig


def torchrun_argv(cfg: LauncherConfig, overrides: list[str]) -> list[str]:
    """The argv that runs ``python -m flowrl.train <overrides>`` under torchrun for ``cfg``."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg.nproc}"]
    if cfg.nnodes == 1:
        argv.append("--standalone")  # a free local port; no endpoint to configure
    else:
        argv += [f"--nnodes={cfg.nnodes}", f"--rdzv_backend={cfg.rdzv_backend}",
                 f"--rdzv_endpoint={cfg.rdzv_endpoint}", f"--rdzv_id={cfg.rdzv_id}"]
        if cfg.node_rank is not None:
            argv.append(f"--node_rank={cfg.node_rank}")
    if cfg.max_restarts:
        argv.append(f"--max_restarts={cfg.max_restarts}")
    return argv + ["-m", "flowrl.train", *overrides]


def exec_torchrun(cfg: LauncherConfig, overrides: list[str]) -> None:
    """Run torchrun's agent in this process on ``cfg``'s processes running ``overrides``, then
    exit with its status (never returns; a failed group: the last line names the rank and the
    resume command, ``runtime/control/supervise.py``). ``flowrl.train.main`` calls it once the run
    is prepared (a bad config is one line
    from this process, exit status 2, not the same error from every rank plus torchrun's
    report); each rank then prepares the same run from the same overrides."""
    from flowrl.runtime.control.supervise import supervise

    argv = torchrun_argv(cfg, overrides)
    sys.stdout.flush()
    # torchrun's agent in this process: a failed job ends naming the rank and the resume command
    sys.exit(supervise(argv[3:], overrides))
