"""``flowrl train`` / ``python -m flowrl.train``: the Hydra entry point of one training run.

Bad input loses nothing: the config, graph, placement and data are checked
(``runtime/preflight.py``, one line naming the field, stage or file) before any model loads;
then ``runtime/job.py`` runs the job, the same loop for every placement. Nothing heavy is
imported at module level, so a rejected config answers before torch loads.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra

from flowrl.config import REPO_ROOT, register_configs
from flowrl.runtime.preflight import (ConfigError, prepare, prepare_placement, prepare_run,
                                      role_parallelism, world_size)

if TYPE_CHECKING:
    from omegaconf import DictConfig


def train(raw: "DictConfig | dict") -> dict[str, Any]:
    """Run a whole training job; returns the summary also written to ``summary.json``.

    Raises:
        ConfigError: rejected before any model loaded. RunDirError: the run directory holds a
            previous run (``trainer.resume`` / ``trainer.overwrite``) or another run.
    """
    from flowrl.runtime import preflight
    from flowrl.runtime.job import run_job

    # the Hydra callback pre-flighted this very config: its result, not a second check
    cfg, plan, resolved = preflight.take(raw) or prepare_run(raw)
    preflight.check_machine(cfg)  # what this machine cannot run: refused before anything loads
    return run_job(cfg, plan, resolved)


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


__all__ = ["ConfigError", "main", "prepare", "prepare_placement", "prepare_run",
           "role_parallelism", "train", "world_size"]


if __name__ == "__main__":
    main()
