"""One run per run directory.

- A fresh run (``trainer.resume=false``) into a directory that holds a previous run's outputs
  stops with one line: continue it (``trainer.resume=true``), replace it
  (``trainer.overwrite=true`` deletes those outputs first) or pick another directory.
- A lock (``.flowrl.lock``, ``fcntl.flock``: the kernel drops it when the process dies, so a
  killed run never leaves a stale lock) keeps a second run out while one is using the directory.
- ``flowrl train`` checks both before Hydra writes its ``.hydra/`` record and ``train.log``
  (:class:`PreflightCallback`), so a rejected run leaves nothing behind.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Optional

# what a flowrl run writes into its directory (Hydra's .hydra/ and train.log are not counted:
# Hydra writes them before the run starts)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "tb", "plan.txt",
               "eval_before.jsonl", "eval_after.jsonl", "placement_auto.json")
LOCK_FILE = ".flowrl.lock"
_HYDRA_FILES = (".hydra", "train.log")


class RunDirError(ValueError):
    """The run directory cannot take this run (a previous run, another run holding it)."""


def previous_run(out_dir: Path) -> list[str]:
    """The outputs of an earlier run found in ``out_dir`` (names from :data:`RUN_OUTPUTS`)."""
    return [name for name in RUN_OUTPUTS if (Path(out_dir) / name).exists()]


def _dir_option(out_dir: Path, hydra_dir: Optional[str] = None) -> str:
    """The command-line option that names this directory again."""
    return (f"hydra.run.dir={out_dir}" if hydra_dir is None or Path(hydra_dir).resolve() ==
            Path(out_dir).resolve() else f"trainer.output_dir={out_dir}")


def check_fresh(out_dir: Path, resume: bool, overwrite: bool) -> list[str]:
    """The outputs ``overwrite`` will delete; raises when a fresh run may not start here.

    Raises:
        RunDirError: ``out_dir`` holds a previous run and neither ``resume`` nor ``overwrite``
            is set (one line saying the three ways on), or both are set.
    """
    if resume and overwrite:
        raise RunDirError("trainer.resume=true continues the run in the directory and "
                          "trainer.overwrite=true deletes it: set one of them")
    found = previous_run(out_dir)
    if found and not resume and not overwrite:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise RunDirError(f"{out_dir} holds a previous run ({shown}): continue it "
                          "with trainer.resume=true, replace it with trainer.overwrite=true, or "
                          "choose another run directory (hydra.run.dir=...)")
    return found if overwrite else []


class RunDirLock:
    """An exclusive ``flock`` on ``<out_dir>/.flowrl.lock`` holding the owner's pid and host.

    Re-entrant within a process (``placement=auto`` runs its phases as nested runs in the same
    directory): each :meth:`acquire` needs one :meth:`release`.
    """

    _held: dict[str, tuple[Any, int]] = {}  # resolved lock path -> (open file, depth)

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir).resolve() / LOCK_FILE

    def acquire(self) -> "RunDirLock":
        """Raises:
            RunDirError: another process holds the lock (naming its pid and host)."""
        key = str(self.path)
        if key in self._held:
            f, depth = self._held[key]
            self._held[key] = (f, depth + 1)
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "another process"
            f.close()
            raise RunDirError(f"{self.path.parent} is in use by another flowrl run ({owner}): "
                              "wait for it to finish or choose another directory") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._held[key] = (f, 1)
        return self

    def release(self) -> None:
        key = str(self.path)
        if key not in self._held:
            return
        f, depth = self._held.pop(key)
        if depth > 1:
            self._held[key] = (f, depth - 1)
            return
        f.close()  # closing the file drops the flock; the file itself stays (see module doc)

    def held_elsewhere(self) -> Optional[str]:
        """The owner line when another process holds the lock now, else None (takes nothing)."""
        if str(self.path) in self._held or not self.path.is_file():
            return None
        with open(self.path, "r") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return f.read().strip() or "another process"
            fcntl.flock(f, fcntl.LOCK_UN)
        return None


class _NoLock:
    def release(self) -> None:
        pass


def claim_run_dir(out_dir: Path, trainer_cfg, *, rank0: bool = True):
    """Take ``out_dir`` for this run: rank 0 locks it, refuses a fresh run into a previous one
    (``trainer.overwrite=true``: deletes that run's outputs first) and tells every rank its
    verdict, so all ranks stop together. Returns the lock (``.release()`` it at the end).

    Raises:
        RunDirError: on every rank, with rank 0's one-line reason.
    """
    from flowrl.runtime import distributed as fdist

    lock: Any = _NoLock()
    err: Optional[str] = None
    if rank0:
        try:
            lock = RunDirLock(out_dir).acquire()
            for name in check_fresh(out_dir, trainer_cfg.resume, trainer_cfg.overwrite):
                p = Path(out_dir) / name
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        except RunDirError as e:
            lock.release()
            err = str(e)
    err = fdist.broadcast_object(err)
    if err is not None:
        raise RunDirError(err)
    return lock


def remove_hydra_leftovers(run_dir: Path) -> None:
    """A rejected run: delete what Hydra wrote into ``run_dir`` (``.hydra/``, ``train.log``) and
    the directory itself when that was all it held; never anything of a previous run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or previous_run(run_dir):
        return
    if any(p.name not in (*_HYDRA_FILES, LOCK_FILE) for p in run_dir.iterdir()):
        return
    for name in _HYDRA_FILES:
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    if not any(run_dir.iterdir()):
        run_dir.rmdir()


def finished_run_summary(out_dir: Path, total_steps: int) -> Optional[tuple[int, dict]]:
    """``(step, summary)`` when the newest complete checkpoint in ``out_dir`` is at or past
    ``total_steps`` (resuming would train nothing; ``summary`` is its ``summary.json``, ``{}``
    when there is none), else None."""
    import json

    from flowrl.runtime.checkpoint import CheckpointManager

    latest = CheckpointManager(Path(out_dir) / "checkpoints").latest()
    if latest is None:
        return None
    step = int(json.loads((latest / "trainer_state.json").read_text())["step"])
    if step < total_steps:
        return None
    summary_path = Path(out_dir) / "summary.json"
    return step, (json.loads(summary_path.read_text()) if summary_path.is_file() else {})


def resume_hint(out_dir: Path, hydra_dir: Optional[str] = None) -> str:
    """The line printed after an interrupted run: how to continue it, or, before its first
    checkpoint, that there is nothing to continue and how to start over."""
    from flowrl.runtime.checkpoint import CheckpointManager

    opt = _dir_option(Path(out_dir), hydra_dir)
    latest = CheckpointManager(Path(out_dir) / "checkpoints").latest()
    if latest is None:
        return (f"no checkpoint was written yet, so there is nothing to continue; start again "
                f"with: flowrl train {opt} trainer.overwrite=true (plus your overrides)")
    return (f"continue from {latest.name} with: flowrl train {opt} trainer.resume=true (plus your "
            "overrides)")


def check_run_dir(out_dir: Path, trainer_cfg) -> None:
    """Before Hydra writes into ``out_dir``: no other process holds it, and it holds no previous
    run unless ``trainer.resume`` / ``trainer.overwrite`` says what to do with it.

    Raises:
        RunDirError: naming the directory and the option to set.
    """
    owner = RunDirLock(out_dir).held_elsewhere()
    if owner is not None:
        raise RunDirError(f"{Path(out_dir).resolve()} is in use by another flowrl run ({owner}): "
                          "wait for it to finish or choose another directory")
    check_fresh(out_dir, trainer_cfg.resume, trainer_cfg.overwrite)


def task_config(config):
    """The task's run config from the config a Hydra callback receives (``hydra`` removed,
    ``trainer.output_dir=${hydra:...}`` pinned to the run directory it will resolve to)."""
    from omegaconf import OmegaConf

    run_dir = os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))
    task = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    task.pop("hydra", None)
    node = task.trainer._get_node("output_dir") if "trainer" in task else None
    if node is not None and "${hydra:" in str(node._value()):
        task.trainer.output_dir = run_dir
    return task
