"""``flowrl train`` / ``python -m flowrl.train``: the Hydra entry point of one training run.

Bad input loses nothing: :func:`prepare_run` checks the config fields, resolves the machine's
``auto`` settings and hands the rest of the pre-flight to ``runtime/preflight.py`` (graph,
placement, model folder, every data row: one line naming the field, stage or file) before any
model loads; then ``runtime/job.py`` runs the job, one loop for every placement. Nothing heavy
is imported at module level, so a rejected config answers before torch loads.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.experimental.callback import Callback

from flowrl.config import REPO_ROOT, register_configs
from flowrl.runtime.preflight import ConfigError, prepare_placement, role_parallelism, world_size

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from flowrl.compiler.plan import ExecutionPlan
    from flowrl.config import TrainConfig
    from flowrl.machine import Resolved


def prepare_run(raw: "DictConfig | dict", overrides: "list[str] | None" = None, *,
                plan_only: bool = False) -> "tuple[TrainConfig, ExecutionPlan, list[Resolved]]":
    """Validate the config, resolve its ``auto`` settings for this machine (returned with their
    reasons) and pre-flight the run (``runtime/preflight.check_run``, given the invocation's
    command-line ``overrides`` when the caller knows them; ``plan_only``: for ``flowrl plan``,
    which may leave a graph's teacher unset); loads no model.

    Raises:
        ConfigError: naming the field, stage, file or row.
    """
    from flowrl.config import to_train_config
    from flowrl.machine import resolve_machine_defaults
    from flowrl.runtime.preflight import check_run

    try:
        cfg = to_train_config(raw)  # a bad field stops here, before torch is imported
        resolved = resolve_machine_defaults(cfg)
        return cfg, check_run(cfg, raw, overrides, plan_only=plan_only), resolved
    except (ValueError, FileNotFoundError) as e:
        raise e if isinstance(e, ConfigError) else ConfigError(str(e)) from e


def prepare(raw: "DictConfig | dict") -> "tuple[TrainConfig, ExecutionPlan]":
    """:func:`prepare_run` without the resolved settings."""
    cfg, plan, _ = prepare_run(raw)
    return cfg, plan


def check_machine(cfg: "TrainConfig") -> None:
    """Raises ConfigError naming the first thing this machine cannot run (vLLM missing, no CUDA;
    ``flowrl plan`` only prints them: a GPU job may be planned anywhere)."""
    from flowrl.machine import machine_problems

    problems = machine_problems(cfg)
    if problems:
        raise ConfigError(problems[0])


def train(raw: "DictConfig | dict") -> dict[str, Any]:
    """Run a whole training job; returns the summary also written to ``summary.json``.

    Raises:
        ConfigError: rejected before any model loaded. RunDirError: the run directory holds a
            previous run (``trainer.resume`` / ``trainer.overwrite``) or another run.
    """
    from flowrl.runtime import preflight
    from flowrl.runtime.job import run_job

    # pre-flight runs once: the Hydra callback already checked this very config
    cfg, plan, resolved = preflight.take(raw) or prepare_run(raw)
    check_machine(cfg)  # what this machine cannot run: refused before anything loads
    return run_job(cfg, plan, resolved)


class PreflightCallback(Callback):
    """Hydra callback (``conf/train.yaml``: ``hydra.callbacks``): pre-flight the run and check
    its run directory in ``on_run_start``, before Hydra creates the directory and writes
    ``.hydra/`` into it (which would overwrite the record of a previous run held there). A
    rejected run prints one line and exits with status 2, leaving nothing on disk; an accepted
    one hands its result to :func:`train`. Multirun jobs are checked by :func:`train` itself
    (their directories are created per job)."""

    def on_run_start(self, config, **kwargs: Any) -> None:
        from flowrl.runtime import preflight, rundir

        task = rundir.task_config(config)
        try:  # Hydra sets the job's HydraConfig (its overrides) only after this callback
            result = prepare_run(task, [str(o) for o in config.hydra.overrides.task])
            rundir.check_run_dir(Path(result[0].trainer.output_dir), result[0].trainer)
        except (ConfigError, rundir.RunDirError) as e:
            print(f"flowrl train: error: {e}", file=sys.stderr)
            sys.exit(2)
        preflight.remember(task, result)


register_configs()


# absolute: Hydra resolves a relative path against the package when this module is imported
@hydra.main(version_base="1.3", config_path=str(REPO_ROOT / "conf"), config_name="train")
def main(cfg: "DictConfig") -> None:
    from hydra.core.hydra_config import HydraConfig

    from flowrl.runtime import rundir
    from flowrl.runtime.recovery import report_crash, stop_on_sigterm

    hydra_dir = HydraConfig.get().runtime.output_dir
    stop_on_sigterm()  # torchrun stops the survivors of a dead rank with SIGTERM
    try:
        train(cfg)
    except (ConfigError, rundir.RunDirError) as e:  # rejected before any model loaded: one line
        print(f"flowrl train: error: {e}", file=sys.stderr)
        if isinstance(e, ConfigError):  # a multirun job's directory: Hydra's files only
            rundir.remove_hydra_leftovers(Path(hydra_dir))
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"\nflowrl train: interrupted; {rundir.resume_hint(cfg.trainer.output_dir, hydra_dir)}",
              file=sys.stderr)
        sys.exit(130)
    except BaseException as e:  # SIGTERM, a dead peer, a full disk, a diverged step...
        if isinstance(e, SystemExit):
            raise
        sys.exit(report_crash(e, cfg.trainer.output_dir))
    finally:
        if "torch.distributed" in sys.modules:  # a config rejected before torch loaded: nothing
            from flowrl.runtime.distributed import teardown

            teardown()


__all__ = ["ConfigError", "PreflightCallback", "check_machine", "main", "prepare",
           "prepare_placement", "prepare_run", "role_parallelism", "train", "world_size"]


if __name__ == "__main__":
    main()
