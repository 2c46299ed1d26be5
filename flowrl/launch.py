"""``flowrl train launcher.nproc=N …``: re-execute the job under ``torchrun`` (no home-made launcher).

    flowrl train launcher.nproc=2 model=tiny trainer=smoke
      == torchrun --standalone --nproc_per_node=2 -m flowrl.train launcher.nproc=2 model=tiny trainer=smoke

Multi-node (run the same command on every node; torchrun's c10d rendezvous pairs them up)::

    flowrl train launcher.nproc=8 launcher.nnodes=2 launcher.rdzv_endpoint=node0:29500 \\
        launcher.rdzv_id=job42 trainer.output_dir=/shared/runs/job42 ...

``trainer.output_dir`` must then be on a file system every node sees (DCP checkpoints are written by
all ranks into one folder). On Slurm: ``sbatch scripts/slurm.sbatch`` (one torchrun per node).
"""
from __future__ import annotations

import os
import sys

from flowrl.runtime.launcher import LauncherConfig  # noqa: F401  (re-exported)


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


def maybe_exec_torchrun(overrides: list[str]) -> None:
    """Replace this process with torchrun when the composed ``launcher`` asks for > 1 process.

    Returns (and the caller runs the job in-process) when ``launcher`` is single-process, or when
    this process already is a torchrun worker.

    Raises:
        ValueError: an invalid ``launcher.*`` value (from the config's validation).
    """
    if "LOCAL_RANK" in os.environ or not any(o.lstrip("+~").startswith("launcher") for o in overrides):
        return
    from omegaconf import OmegaConf

    from flowrl.config import compose

    try:
        node = compose(overrides).launcher
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LauncherConfig), node))
        if not isinstance(cfg, LauncherConfig):  # to_object of a structured node builds its class
            raise TypeError(f"launcher: expected a LauncherConfig, got {type(cfg).__name__}")
    except Exception as e:  # Hydra/OmegaConf composition errors: one line, like train's own
        from flowrl.config_errors import explain

        print(f"flowrl train: error: {explain(e, overrides)}", file=sys.stderr)
        sys.exit(2)
    if not cfg.distributed:
        return
    _validate_before_launch(overrides)
    argv = torchrun_argv(cfg, overrides)
    sys.stdout.flush()
    os.execv(argv[0], argv)


def _validate_before_launch(overrides: list[str]) -> None:
    """Check the whole job (config, graph, placement) once here, so a mistake is one line from
    this process, exit status 2, instead of the same error from every rank plus torchrun's
    failure report. Loads no model."""
    from flowrl.config import compose
    from flowrl.train import prepare

    try:
        cfg = compose(overrides)
        if "${hydra:" in str(cfg.trainer._get_node("output_dir")._value()):
            cfg.trainer.output_dir = "(validation only)"  # Hydra's run dir exists only in the ranks
        prepare(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"flowrl train: error: {e}", file=sys.stderr)
        sys.exit(2)
