"""One run per run directory.

- A fresh run (``trainer.resume=false``) into a directory that holds a previous run's outputs
  stops with one line: continue it (``trainer.resume=true``), replace it
  (``trainer.overwrite=true`` deletes those outputs first) or pick another directory.
- A lock (``.flowrl.lock``, ``fcntl.flock``: the kernel drops it when the process dies, so a
  killed run never leaves a stale lock) keeps a second run out while one is using the directory.
- ``flowrl train`` checks both before Hydra writes its ``.hydra/`` record and ``train.log``
  (``flowrl.train.main``: :func:`check_run_dir`), so a rejected run leaves nothing behind.
- A resumed run must be the checkpoint's run (:func:`check_resume`, before any model loads):
  each checkpoint records the model, graph and trained roles it was written with and the
  command-line overrides of the invocation that wrote it (:func:`run_record`; Hydra rewrites
  ``.hydra/overrides.yaml`` on every invocation), so a refusal and every resume hint print the
  overrides to continue with.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Optional

# what a flowrl run writes into its directory (Hydra's .hydra/ and train.log are not counted:
# Hydra writes them before the run starts)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "tb", "plan.txt",
               "eval_before.jsonl", "eval_after.jsonl", "placement_auto.json", "profile")
LOCK_FILE = ".flowrl.lock"
_HYDRA_FILES = (".hydra", "train.log")
# the model fields that decide a checkpoint's tensors (their names and shapes); dtype, attention
# and gradient checkpointing may change on resume, and the tiny model's init seed is overwritten
_MODEL_IDENTITY = ("path", "gguf_file", "tiny", "lora")
# overrides a resume may change: how long the run goes on, how it saves, evaluates, logs, launches
_RESUME_MAY_CHANGE = ("trainer.total_steps", "trainer.save_every", "trainer.keep_last",
                      "trainer.async_save", "trainer.eval", "trainer.profile", "logger", "launcher")
# overrides that name the directory or what to do with it: a hint writes them itself
_RUN_DIR_KEYS = ("trainer.resume", "trainer.overwrite", "trainer.output_dir")


class RunDirError(ValueError):
    """The run directory cannot take this run (a previous run, another run holding it)."""


def previous_run(out_dir: Path) -> list[str]:
    """The outputs of an earlier run found in ``out_dir`` (names from :data:`RUN_OUTPUTS`)."""
    return [name for name in RUN_OUTPUTS if (Path(out_dir) / name).exists()]


def _dir_option(out_dir: Path, hydra_dir: Optional[str] = None) -> str:
    """The command-line option that names this directory again."""
    return (f"hydra.run.dir={out_dir}" if hydra_dir is None or Path(hydra_dir).resolve() ==
            Path(out_dir).resolve() else f"trainer.output_dir={out_dir}")


# the setting that chooses a sweep job's directory (a constant hydra.sweep.subdir puts every job
# in one directory)
SWEEP_DIR_SETTING = "hydra.sweep.dir=..., with a hydra.sweep.subdir of its own per job"


def _dir_setting() -> str:
    """The setting that chooses this run's directory: a sweep job's comes from Hydra's sweep dir
    and subdir."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return SWEEP_DIR_SETTING
    return "hydra.run.dir=..."


def check_fresh(out_dir: Path, resume: bool, overwrite: bool,
                setting: Optional[str] = None) -> list[str]:
    """The outputs ``overwrite`` will delete; raises when a fresh run may not start here.
    ``setting``: the option that chooses another directory, as the refusal names it (default:
    this process's, ``hydra.run.dir`` or a sweep's).

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
                          f"choose another run directory ({setting or _dir_setting()})")
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
    from flowrl.runtime.io import distributed as fdist

    lock: Any = _NoLock()
    err: Optional[str] = None
    if rank0:
        try:
            lock = RunDirLock(out_dir).acquire()
            replaced = check_fresh(out_dir, trainer_cfg.resume, trainer_cfg.overwrite)
            if replaced:  # said: hours of training may go with it (it was silent)
                ckpts = sorted(c.name for c in (Path(out_dir) / "checkpoints").glob("step_*"))
                logging.getLogger("flowrl").warning(
                    "trainer.overwrite=true: deleted the previous run in %s (%s%s)", out_dir,
                    ", ".join(replaced), f"; its newest checkpoint was {ckpts[-1]}" if ckpts else "")
            for name in replaced:
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
    # a run refused inside its job (its data, after the lock was taken) leaves the lock file:
    # released, so gone with the rest unless another process holds it now
    lock = run_dir / LOCK_FILE
    if lock.is_file() and RunDirLock(run_dir).held_elsewhere() is None:
        lock.unlink(missing_ok=True)
    if not any(run_dir.iterdir()):
        run_dir.rmdir()


def remove_sweep_leftovers(sweep_dir: Path) -> None:
    """A sweep whose first job was rejected: delete Hydra's ``multirun.yaml`` and the sweep
    directory when nothing else is in it (no job ran), then the empty ``multirun/<date>`` folders
    of Hydra's default sweep path under the working directory; never a folder that holds anything
    else (an earlier job's run, a user's files)."""
    sweep_dir = Path(sweep_dir).resolve()
    if not sweep_dir.is_dir() or any(p.name != "multirun.yaml" for p in sweep_dir.iterdir()):
        return
    (sweep_dir / "multirun.yaml").unlink(missing_ok=True)
    sweep_dir.rmdir()
    default_root = Path.cwd().resolve() / "multirun"
    for parent in (sweep_dir.parent, sweep_dir.parent.parent):
        if parent.is_relative_to(default_root) and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


def finished_run_summary(out_dir: Path, total_steps: int) -> Optional[tuple[int, dict]]:
    """``(step, summary)`` when the newest complete checkpoint in ``out_dir`` is at or past
    ``total_steps`` (resuming would train nothing; ``summary`` is its ``summary.json``, ``{}``
    when there is none), else None."""
    from flowrl.runtime.io.checkpoint import CheckpointManager

    latest = CheckpointManager(Path(out_dir) / "checkpoints").latest()
    if latest is None:
        return None
    step = int(json.loads((latest / "trainer_state.json").read_text())["step"])
    if step < total_steps:
        return None
    summary_path = Path(out_dir) / "summary.json"
    return step, (json.loads(summary_path.read_text()) if summary_path.is_file() else {})


def invocation_overrides() -> Optional[list[str]]:
    """This process's command-line overrides (Hydra's ``overrides.task``) while a Hydra app
    runs its job; None outside one (a config composed in-process: unknown)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return [str(o) for o in HydraConfig.get().overrides.task]


def _model_option(overrides: list[str]) -> str:
    """The ``model`` group option that ``overrides`` select: the last ``model=X``, else the
    default of ``conf/train.yaml``'s defaults list."""
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("model=")]
    if chosen:
        return chosen[-1]
    import yaml

    conf = Path(__file__).resolve().parents[3] / "conf" / "train.yaml"  # flowrl.config's conf/
    defaults = yaml.safe_load(conf.read_text())["defaults"]
    return next(d["model"] for d in defaults if isinstance(d, dict) and "model" in d)


def override_key(override: str) -> str:
    """The config key of a Hydra override (``+a.b=1``, ``~a.b``, ``group=option``)."""
    return override.split("=", 1)[0].lstrip("+~")


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def repeat_overrides(original: list[str], current: Optional[list[str]] = None) -> list[str]:
    """The overrides that repeat a run: ``original`` without those naming the run directory or
    what to do with it (:data:`_RUN_DIR_KEYS`), with ``current``'s overrides of the fields a
    resume may change (:data:`_RESUME_MAY_CHANGE`: a raised ``trainer.total_steps``) in place of
    or after the original ones."""
    keep = {override_key(o): o for o in original if not _under(override_key(o), _RUN_DIR_KEYS)}
    for o in current or []:
        if _under(override_key(o), _RESUME_MAY_CHANGE):
            keep[override_key(o)] = o
    return list(keep.values())


def _command(opt: str, action: str, overrides: Optional[list[str]]) -> str:
    """``flowrl train OPT ACTION OVERRIDES``; unknown overrides: the user is told to add theirs."""
    if overrides is None:
        return f"flowrl train {opt} {action} (plus your overrides)"
    return " ".join(["flowrl train", opt, action, *repeat_overrides(overrides)])


def resume_hint(out_dir: Path, hydra_dir: Optional[str] = None,
                overrides: Optional[list[str]] = None) -> str:
    """The line printed after an interrupted run: how to continue it, or, before its first
    checkpoint, that there is nothing to continue and how to start over; with this invocation's
    ``overrides`` (default: :func:`invocation_overrides`) in the command when they are known."""
    from flowrl.runtime.io.checkpoint import CheckpointManager

    opt = _dir_option(Path(out_dir), hydra_dir)
    overrides = invocation_overrides() if overrides is None else overrides
    latest = CheckpointManager(Path(out_dir) / "checkpoints").latest()
    if latest is None:
        return ("no checkpoint was written yet, so there is nothing to continue; start again "
                f"with: {_command(opt, 'trainer.overwrite=true', overrides)}")
    return f"continue from {latest.name} with: {_command(opt, 'trainer.resume=true', overrides)}"


def _plain(x: Any) -> Any:
    """``x`` as ``trainer_state.json`` holds it (tuples become lists)."""
    return json.loads(json.dumps(x, default=str))


def _cwd_relative(path: str) -> bool:
    """A relative path that names a file from the working directory (not from anywhere)."""
    p = Path(path).expanduser()
    return not p.is_absolute() and p.is_file()


def run_record(cfg, roles: list[str], overrides: Optional[list[str]]) -> dict[str, Any]:
    """What a checkpoint records of the run that writes it, for :func:`check_resume`: the model
    config, the graph (as given and the file it resolved to), the roles whose state it holds
    (``roles``: the plan's) and this invocation's command-line ``overrides`` (left out when
    unknown)."""
    from flowrl.graph.roles import TRAINED_ROLES  # the role table itself: io sits below step/

    record: dict[str, Any] = {
        "model": _plain(dataclasses.asdict(cfg.model)),
        "graph": {"path": cfg.graph.path, "file": str(cfg.graph.resolve())},
        "trained_roles": [r for r in TRAINED_ROLES if r in roles],
        "settings": settings_record(cfg)}
    if overrides is not None:
        # a graph file given relative to where the run started: absolute, so the printed
        # resume command works from any directory
        record["overrides"] = [f"graph.path={Path(o.split('=', 1)[1]).resolve()}"
                               if override_key(o) == "graph.path" and _cwd_relative(o.split("=", 1)[1])
                               else o for o in overrides]
    return record


# config sections a resume compares by their own rules (model, graph), or that are not a run's
_NOT_SETTINGS = ("model", "graph", "cluster")


def settings_record(cfg) -> dict[str, Any]:
    """Every field of the resolved run config ``cfg`` (a ``TrainConfig``: ``auto`` values as
    this machine resolved them) but the model and graph (:func:`check_resume` compares those),
    as JSON: what :func:`changed_settings` compares a resume against."""
    return {k: v for k, v in _plain(dataclasses.asdict(cfg)).items() if k not in _NOT_SETTINGS}


def changed_settings(saved: Any, cfg) -> list[str]:
    """``name: checkpoint's value -> this run's`` for each setting of ``cfg`` that differs from
    ``saved`` (a checkpoint's :func:`settings_record`; none from a checkpoint written before it
    was recorded), leaving out those a resume is expected to change (:data:`_RESUME_MAY_CHANGE`,
    the run directory's keys). A resume may change them (a lower learning rate to continue
    with): the run announces them, it does not refuse them."""
    if not isinstance(saved, dict):
        return []
    was, has = _differences("", saved, settings_record(cfg))
    out = []
    for a, b in zip(was, has):
        name, old = a[1:].split("=", 1)  # "" prefix: each name starts with "."
        if not _under(name, _RESUME_MAY_CHANGE + _RUN_DIR_KEYS):
            out.append(f"{name}: {old} -> {b.split('=', 1)[1]}")
    return _fold_placement_preset(out)


def _fold_placement_preset(changed: list[str]) -> list[str]:
    """A changed ``placement.mode`` brings its preset's ``placement.pools.*`` / ``placement.roles.*``
    (unset, ``null``, under the other mode): one line for the mode says so, where a resume from
    colocated to partitioned listed eight ``null -> ...`` lines of defaults nobody set. A pool or
    role changed from one set value to another keeps its own line."""
    if not any(c.startswith("placement.mode: ") for c in changed):
        return changed
    preset = [c for c in changed if c.startswith(("placement.pools.", "placement.roles."))
              and (": null -> " in c or c.endswith(" -> null"))]
    if not preset:
        return changed
    with_it = f" (with its preset's {', '.join(dict.fromkeys(c.split('.')[1] for c in preset))})"
    return [c + with_it if c.startswith("placement.mode: ") else c
            for c in changed if c not in preset]


def _value(x: Any) -> str:
    """A config value as an override writes it."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in x.items()) + "}"
    if isinstance(x, list):
        return "[" + ", ".join(_value(v) for v in x) + "]"
    return str(x)


def _differences(name: str, saved: Any, now: Any) -> tuple[list[str], list[str]]:
    """``name=value`` of the checkpoint's and of this run's side where they differ: the keys
    that differ when both are mappings, else the whole value."""
    if isinstance(saved, dict) and isinstance(now, dict):
        was: list[str] = []
        has: list[str] = []
        for k in [*saved, *(k for k in now if k not in saved)]:
            a, b = _differences(f"{name}.{k}", saved.get(k), now.get(k))
            was, has = was + a, has + b
        return was, has
    return ([], []) if saved == now else ([f"{name}={_value(saved)}"], [f"{name}={_value(now)}"])


def check_resume(cfg, roles: list[str], overrides: Optional[list[str]] = None) -> None:
    """With ``trainer.resume=true``: the checkpoint the run would continue from (the newest
    loadable) must have been written by this run's model (:data:`_MODEL_IDENTITY`), graph and
    trained roles (``roles``: the plan's). Loads no model; a field the checkpoint does not record
    (one written before it was recorded) is not compared, and neither is any field a resume may
    change (:data:`_RESUME_MAY_CHANGE`).

    Raises:
        RunDirError: one line naming every differing field with the checkpoint's and this run's
            value, and the command that resumes with the original overrides (``overrides``:
            this invocation's, whose :data:`_RESUME_MAY_CHANGE` ones it keeps) when the
            checkpoint records them.
    """
    if not cfg.trainer.resume:
        return
    # imported past the return: it loads torch.distributed.checkpoint (seconds on a cold
    # machine), which a run that does not resume has no use for at its checks
    from flowrl.runtime.io.checkpoint import CheckpointManager

    out_dir = Path(cfg.trainer.output_dir)
    try:
        latest = CheckpointManager(out_dir / "checkpoints").latest()
    except ValueError:  # a tampered index: the job's start refuses it, naming the file
        return
    if latest is None:
        return
    meta = json.loads((latest / "trainer_state.json").read_text())
    now = run_record(cfg, roles, None)
    was: list[str] = []
    has: list[str] = []
    model = meta.get("model")
    for f in _MODEL_IDENTITY if isinstance(model, dict) else ():
        if f in model:
            a, b = _differences(f"model.{f}", model[f], now["model"][f])
            was, has = was + a, has + b
    original = meta.get("overrides")
    if isinstance(original, list) and overrides is not None and was:
        # another model option (a forgotten model=tiny): name the option, not the fields it sets
        saved_opt, now_opt = _model_option(original), _model_option(overrides)
        if saved_opt != now_opt:
            was = [f"model={saved_opt}", *(w for w in was if not w.startswith("model."))]
            has = [f"model={now_opt}", *(h for h in has if not h.startswith("model."))]
    graph = meta.get("graph")  # the same file named another way (absolute, relative) is the same
    if isinstance(graph, dict) and graph.get("path") != cfg.graph.path and \
            graph.get("file") != now["graph"]["file"]:
        was.append(f"graph.path={graph.get('path')}")
        has.append(f"graph.path={cfg.graph.path}")
    trained = meta.get("trained_roles")
    if isinstance(trained, list) and trained != now["trained_roles"]:
        was.append(f"trained roles [{', '.join(trained)}]")
        has.append(f"trained roles [{', '.join(now['trained_roles'])}]")
    if not was:
        return
    if isinstance(original, list):
        again = " ".join(["flowrl train", _dir_option(out_dir), "trainer.resume=true",
                          *repeat_overrides(original, overrides)])
        how = f"resume with the original overrides: {again}"
    else:
        how = "resume with the original run's overrides (this checkpoint does not record them)"
    raise RunDirError(f"trainer.resume=true: {latest.name} was trained with {', '.join(was)} "
                      f"but this run has {', '.join(has)}; {how}")


def file_in_the_way(path: Path) -> Optional[Path]:
    """``path`` itself, or the nearest of its existing ancestors, when that is a file (no folder
    can be made there); None when the nearest existing one is a folder."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None) \
        if not path.is_dir() else None


def run_dir_field(overrides: "list[str] | tuple[str, ...]") -> str:
    """The setting a run's directory came from, for its messages: ``hydra.run.dir`` when the
    command line set it and not ``trainer.output_dir`` (which defaults to Hydra's run dir), else
    ``trainer.output_dir``."""
    keys = {override_key(o) for o in overrides if "=" in o}
    return "hydra.run.dir" if "hydra.run.dir" in keys and "trainer.output_dir" not in keys \
        else "trainer.output_dir"


def check_run_dir(out_dir: Path, trainer_cfg, field: str = "trainer.output_dir") -> None:
    """Before Hydra writes into ``out_dir``: no other process holds it, and it holds no previous
    run unless ``trainer.resume`` / ``trainer.overwrite`` says what to do with it. ``field``: the
    setting the user gave the directory by (:func:`run_dir_field`), which the errors name.

    Raises:
        RunDirError: naming the directory and the option to set; ``trainer.output_dir`` (or a
            folder above it) is a file.
    """
    blocker = file_in_the_way(Path(out_dir))  # the run would fail at its first mkdir
    if blocker is not None:
        raise RunDirError(f"{field}={out_dir}: {blocker} is a file, not a directory; "
                          f"choose another {field}")
    owner = RunDirLock(out_dir).held_elsewhere()
    if owner is not None:
        raise RunDirError(f"{Path(out_dir).resolve()} is in use by another flowrl run ({owner}): "
                          "wait for it to finish or choose another directory")
    check_fresh(out_dir, trainer_cfg.resume, trainer_cfg.overwrite)

