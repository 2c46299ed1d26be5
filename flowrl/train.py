"""``flowrl train`` / ``python -m flowrl.train``: one training run, set up once.

    overrides ──prepare──► RunSpec ──(launcher.nproc > 1: torchrun, each rank prepares its own)
        composed once · fields · machine defaults · graph → plan · placement · model folder ·
        every data row (runtime/control/preflight.py); run directory free; nothing loaded or written
    RunSpec ──Hydra job (run dir, .hydra/, train.log)──► runtime/control/job.run_job

A rejected run prints one line (exit status 2) and leaves nothing on disk. Hydra's own command
line (``-m`` sweeps, ``--cfg``, ``--help``) runs Hydra's app, each job prepared by
:func:`train`. Nothing heavy is imported at module level: a rejected config answers before
torch loads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from flowrl.config import REPO_ROOT, compose, output_dir_is_hydras, task_section, to_train_config
from flowrl.config_errors import loose_bool_override
from flowrl.machine import check_machine, resolve_machine_defaults
from flowrl.runtime.control import mps
from flowrl.runtime.control.preflight import ConfigError, check_run, load_prompts
from flowrl.runtime.control.spec import RunSpec
from flowrl.runtime.io.rundir import override_key

if TYPE_CHECKING:
    from omegaconf import DictConfig


_PREPARED = False  # a prepare ran in this process already (a Hydra sweep prepares per job)


def prepare(source: "Sequence[str] | DictConfig | dict", overrides: Optional[Sequence[str]] = None,
            *, plan_only: bool = False) -> RunSpec:
    """The run of ``source`` (command-line overrides, composed here with Hydra's section, or a
    composed config), pre-flighted: fields validated, ``auto`` settings resolved for this machine,
    graph compiled, placed, its inputs checked (``runtime/control/preflight.check_run``).
    ``overrides``: the invocation's (default: ``source`` when it is overrides; Hydra's inside a Hydra job);
    ``plan_only`` (``flowrl plan``): a graph's teacher may be left unset. Loads no model.

    Raises:
        ConfigError: naming the field, stage, file or row. HydraException /
            OmegaConfBaseException: overrides that do not compose (``config_errors.explain``).
    """
    from flowrl.runtime.step.resources import COMMAND_START_ENV, since_launch_s

    # where a start-up's seconds go before any model loads, logged by the job (on a GPU machine
    # the first console line came 15 s after the command, with nothing to say why). The time
    # before this call counts once per process (a sweep's later jobs would count the earlier
    # ones); a rank of a multi-process run counts it from the command (its supervisor's start).
    global _PREPARED
    first = "parent, torchrun and imports" if os.environ.get(COMMAND_START_ENV) else \
        "python and imports"
    began = since_launch_s() if _PREPARED else 0.0  # a sweep's later job: from its own start
    parts = [] if _PREPARED else [(first, since_launch_s())]
    _PREPARED = True
    t = time.perf_counter()

    def done(part: str) -> None:
        nonlocal t
        now = time.perf_counter()
        parts.append((part, now - t))
        t = now

    if isinstance(source, (list, tuple)):
        overrides = list(source) if overrides is None else overrides
        source = compose(list(source), with_hydra=True)
        done("compose")
    given = None if overrides is None else list(overrides)
    if loose := loose_bool_override(given if given is not None else _hydra_task_overrides()):
        raise ConfigError(loose)
    from omegaconf import DictConfig, OmegaConf

    if isinstance(source, DictConfig) and \
            OmegaConf.select(source, "hydra.job.chdir", default=False) is True:
        # the checks read relative paths (data.path, model.path, graph.path) from the launch
        # directory, and the job would read them from its run directory: passed, then crashed
        raise ConfigError("hydra.job.chdir=true: flowrl runs a job in the directory it was started "
                          "from (relative data.path, model.path and graph.path are read from "
                          "there; the run's files go to hydra.run.dir); leave it false")
    try:
        task = task_section(source)  # Hydra's run dir pinned: the run is checked before it exists
        cfg = to_train_config(task)  # a bad field stops here, before torch is imported
        done("config")
        # before anything initialises CUDA in this process (the machine defaults ask torch): a
        # context made before the job's MPS daemon never joins it
        mps_line = None if plan_only else mps.engage(cfg)
        if mps_line is not None:  # its decision reads nvidia-smi and the model's size: timed apart
            done("CUDA MPS daemon" if mps_line.value == "true" else "CUDA MPS decision")
        resolved = resolve_machine_defaults(cfg)
        done("machine defaults")
        plan, placement = check_run(cfg, task, given, plan_only=plan_only, part=done)
        done("placement, model and data checks")
    except (ValueError, FileNotFoundError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(_one_line(e)) from e
    if mps_line is not None:
        resolved = [*resolved, mps_line]
    return RunSpec(source, cfg, plan, placement, tuple(resolved),
                   None if given is None else tuple(given), startup=tuple(parts),
                   startup_began_s=began)


def _one_line(e: BaseException) -> str:
    """A check's error as one line; OmegaConf's (an interpolation that does not resolve) named
    by its key, without its ``full_key``/``object_type`` detail lines."""
    from omegaconf.errors import OmegaConfBaseException

    from flowrl.config import one_line

    if not isinstance(e, OmegaConfBaseException):
        return str(e)
    key = getattr(e, "full_key", None)
    return f"{key}: {one_line(e)}" if key else one_line(e)


def _hydra_task_overrides() -> list[str]:
    """The command line's overrides inside a Hydra job (``flowrl train -m ...``: each multirun
    job composes its own); none outside one."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def train(source: "RunSpec | DictConfig | dict") -> dict[str, Any]:
    """Run a whole training job (``source``: a prepared run, or a composed config to
    :func:`prepare`); returns the summary also written to ``summary.json``.

    Raises:
        ConfigError: rejected before any model loaded (also what this machine cannot run:
            ``machine.check_machine``). RunDirError: the run directory holds a previous run
            (``trainer.resume`` / ``trainer.overwrite``) or another run.
    """
    from flowrl.runtime.control.job import run_job

    spec = source if isinstance(source, RunSpec) else prepare(source)
    _start_ahead(spec)  # `flowrl train` did already: nothing is started twice
    try:
        check_machine(spec.config)
        return run_job(spec)
    finally:  # the build took what it needed; a refused or failed run leaves nothing running
        _cancel_ahead()


def _start_ahead(spec: RunSpec) -> None:
    """What the engine build will wait for, started now, beside the machine check and the model
    load: vLLM's model-info inspection (``engines/rollout/vllm_prefetch.py``) and, for a
    one-process job whose vLLM runs in engine processes, those processes (their imports:
    ``vllm_proc.start_ahead``). Not in torchrun's supervisor, whose ranks build."""
    cfg = spec.config
    if cfg.launcher.distributed and "LOCAL_RANK" not in os.environ:
        return
    from flowrl.runtime.step.resources import start_vllm_prefetch

    start_vllm_prefetch(cfg, set(spec.plan.roles))
    if cfg.launcher.distributed or cfg.rollout.backend != "vllm" or "rollout" not in spec.plan.roles:
        return  # a rank of a multi-process job: its device and pool are the job's to set
    from flowrl.machine import vllm_importable

    if not vllm_importable():
        return  # the machine check refuses the run
    import torch

    from flowrl.runtime.control.mps import engine_procs_expected
    from flowrl.runtime.step.resources import run_device

    try:
        device = run_device(cfg)
        memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" \
            else None
    except (RuntimeError, ValueError):  # no usable CUDA device: the machine check says so
        return
    procs = engine_procs_expected(cfg, memory)
    if procs:
        from flowrl.engines.rollout import vllm_proc

        vllm_proc.start_ahead(procs, device)


def _cancel_ahead() -> None:
    """End what :func:`_start_ahead` started (a run refused after all): nothing outlives it."""
    if "flowrl.engines.rollout.vllm_prefetch" in sys.modules:  # else none was started
        from flowrl.engines.rollout import vllm_prefetch

        vllm_prefetch.cancel_all()
    if "flowrl.engines.rollout.vllm_proc" in sys.modules:
        from flowrl.engines.rollout import vllm_proc

        vllm_proc.discard_ahead()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``flowrl train [overrides]``: prepare once, refuse a bad run in one line (exit status 2,
    nothing written), start torchrun for ``launcher.nproc > 1``, else run the job in a Hydra job
    (run dir, ``.hydra/``, ``train.log``)."""
    from flowrl.runtime.io import rundir

    args = list(sys.argv[1:] if argv is None else argv)
    # Hydra's --run / -r is its default mode: flowrl's own path (its checks, one-line refusals)
    for i, a in enumerate(args[:-1]):
        if a in ("--run", "-r") and "=" not in args[i + 1] and not args[i + 1].startswith("-"):
            sys.exit(_refused(f"{a} takes no value (it is Hydra's default mode); give the run "
                              f"directory as hydra.run.dir={args[i + 1]}"))
    args = [a for a in args if a not in ("--run", "-r")]
    if any(a.startswith("-") for a in args):  # Hydra's command line: -m, --cfg job, --help...
        if "-m" in args or "--multirun" in args:
            bad = check_sweep([a for a in args if "=" in a and not a.startswith("-")])
            if bad is not None:  # before job 1 trains: a later job's typo would cost its hours
                sys.exit(_refused(bad))
        elif any(a in ("--cfg", "-c", "--resolve") or a.startswith("--cfg=") for a in args):
            # `--cfg job` is what a refused key's line tells a user to run: a typo in its own
            # overrides gets the same one line, not Hydra's 6-15 (its search path, a variable)
            bad = check_overrides([a for a in args if "=" in a and not a.startswith("-")])
            if bad is not None:
                sys.exit(_refused(bad))
        sys.argv = [sys.argv[0], *args]
        return _hydra_app()
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from flowrl.config_errors import explain

    try:
        with _kept_warnings() as early:
            spec = prepare(args)
        spec = dataclasses.replace(spec, early_warnings=tuple(early))
        for key in ("hydra.run.dir", "trainer.output_dir"):  # an unset shell variable ($OUT)
            # gives an empty value: taken for the working directory (overwrite=true clears it)
            if _empty(_override(args, key)):
                raise ConfigError(f"{key} is empty: the run would write into the working "
                                  f"directory ({os.getcwd()}); give it a path")
        if not str(spec.config.trainer.output_dir).strip():  # an interpolation resolving to ''
            field = rundir.run_dir_field(args)  # (${oc.env:OUT,""} with OUT unset)
            raise ConfigError(f"{field}={_override(args, field)} resolves to an empty path: the "
                              f"run would write into the working directory ({os.getcwd()}); "
                              "give it a path")
        out = Path(spec.config.trainer.output_dir)
        rundir.check_run_dir(out, spec.config.trainer, rundir.run_dir_field(args))
        if spec.config.trainer.overwrite and rundir.previous_run(out):
            # the replaced run's log goes with its outputs, before Hydra's job appends to it
            (out / "train.log").unlink(missing_ok=True)
        t0 = time.perf_counter()
        _start_ahead(spec)  # its ~18 s (cold) beside the check's liger import and the model load
        check_machine(spec.config)
        if spec.startup:  # one of the start-up line's parts: on the H100 the default job's took
            # 7.3 s, liger-kernel's import (torch._dynamo, peft, triton) to check the model type,
            # an import the model load needs anyway
            part = ("machine check (packages, kernels)", time.perf_counter() - t0)
            spec = dataclasses.replace(spec, startup=(*spec.startup, part))
    except (ConfigError, rundir.RunDirError) as e:
        _cancel_ahead()
        sys.exit(_refused(str(e)))
    except (HydraException, OmegaConfBaseException) as e:  # Hydra's own report takes 6-15 lines
        sys.exit(_refused(explain(e, args)))
    if _finished(spec):
        _cancel_ahead()
        # nothing to train: said before Hydra's job (or torchrun) rewrites the run's .hydra/
        # with this invocation's config, which would no longer be the one the run trained with
        return None
    out = Path(spec.config.trainer.output_dir)
    try:  # Hydra's job would make it, and fail in a traceback where it cannot (/proc/..., a file)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _cancel_ahead()
        sys.exit(_refused(f"{rundir.run_dir_field(args)}={out}: the run directory cannot be created "
                          f"({e.strerror or e})"))
    if spec.config.launcher.distributed and "LOCAL_RANK" not in os.environ:
        from flowrl.runtime.control import supervise

        sys.stdout.flush()
        # torchrun's agent in this process: every rank prepares the same overrides; a failed
        # group ends naming the rank and the resume command
        sys.exit(supervise.supervise(supervise.torchrun_args(spec.config.launcher, args), args))
    _hydra_job(spec)


@contextlib.contextmanager
def _kept_warnings(say: bool = True) -> Iterator[list[logging.LogRecord]]:
    """flowrl's warnings inside the block, kept to be written into the run's train.log once the
    job has one (:func:`_write_early_warnings`). ``say``: still said on the console as they were
    (before logging is configured, by Python's last-resort handler, which a handler of ours would
    otherwise silence); False: kept only (a sweep's check: each job says its own)."""
    kept: list[logging.LogRecord] = []
    logger = logging.getLogger("flowrl")
    fallback = say and not logger.hasHandlers()  # nothing else would print them

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)
            last = logging.lastResort
            if fallback and last is not None and record.levelno >= last.level:
                last.handle(record)

    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield kept
    finally:
        logger.removeHandler(handler)


def _write_early_warnings(spec: RunSpec) -> None:
    """The warnings ``prepare`` said before Hydra's job set up logging, into the job's log
    files (train.log; by rank 0 only, the ranks share it): the console had them, the run's
    record did not."""
    if os.environ.get("RANK", "0") != "0":
        return
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for record in spec.early_warnings:
        for h in files:
            if record.levelno >= h.level:
                h.handle(record)


def check_overrides(overrides: list[str]) -> Optional[str]:
    """The one-line reason ``overrides`` do not compose with Hydra's section (an unknown config
    group option, a key no config has, a value of the wrong type: ``config_errors.explain``), or
    None when they do. Nothing is prepared: ``--cfg`` only prints the config."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from flowrl.config_errors import explain

    try:
        compose(overrides, with_hydra=True)
    except (HydraException, OmegaConfBaseException) as e:
        return explain(e, overrides)
    return None


def check_sweep(overrides: list[str]) -> Optional[str]:
    """Every job of a command-line sweep (``flowrl train -m a=1,2 b=x,y``: the jobs Hydra's basic
    sweeper makes) checked before the first job runs: first every job's config (fields and
    values), then each job's run checks as ``flowrl train`` makes them before its models load
    (machine defaults, graph, placement, model folder and data files: :func:`prepare`; what this
    machine cannot run: ``machine.check_machine``) and its prompts through its
    tokenizer (``data.max_prompt_tokens``, the chat template: ``preflight.load_prompts``, once
    per distinct model and data), and its directory in a re-used ``hydra.sweep.dir`` (an older
    run there without ``trainer.resume`` / ``trainer.overwrite``: ``rundir.check_fresh``). No
    model loads. Returns the first bad job's one-line reason
    (its number and overrides) or, for an override that does not parse, the line
    ``config_errors.explain`` gives it; None when all pass or when the sweep is Hydra's to expand
    (``glob()`` over a config group).

    Why all of it: a sweep's jobs run one after the other, so a job refused at its start (a
    ``data.max_prompt_tokens`` no prompt fits) was found only after every job before it had
    trained. ``hydra._internal``'s :class:`BasicSweeper` expands the sweep exactly as the run will."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from flowrl.config_errors import explain
    from flowrl.runtime.io import rundir

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        # glob() over a config group needs Hydra's config loader, interval() an optimizing
        # sweeper: those sweeps are Hydra's to expand (or refuse), unchecked here
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except HydraException as e:
        if "does not support sweep type" in str(e):  # interval(): the basic sweeper's refusal
            return (f"{e}: interval() sweeps need an optimizing sweeper plugin (Optuna, Ax); "
                    "list the values (a=0,0.5,1) or use range()")
        if isinstance(e, OverrideParseException):  # one line, as without -m (Hydra's took four)
            return explain(e, overrides)
        return None
    swept = {o.key_or_group for o in parsed if o.is_sweep_override()}

    def refused(i: int, why: str) -> str:
        job = jobs[i - 1]
        # a multirun of one job (nothing swept): its own overrides, Hydra's left out
        which = " ".join(o for o in job if override_key(o) in swept or
                         (not swept and not override_key(o).startswith("hydra.")))
        return f"sweep job {i} of {len(jobs)} ({which}): {why}; no job was run"

    for i, job in enumerate(jobs, 1):  # the fields of all: a typo says so in a second
        try:
            to_train_config(task_section(compose(list(job), with_hydra=True)))
            continue
        except ValueError as e:
            why = str(e)
        except (HydraException, OmegaConfBaseException) as e:
            why = explain(e, list(job))
        return refused(i, why)
    global _PREPARED
    first, data_seen, dirs = _PREPARED, set[str](), dict[str, int]()
    try:
        bad_dir = _sweep_dir_problem(jobs[0])
        subdir = _override(jobs[0], "hydra.sweep.subdir")
        subdir = None if subdir is None else subdir.replace("\\", "")  # the sweeper escapes ${
        if bad_dir is None and subdir is not None and len(jobs) > 1 and "${hydra.job." not in subdir:
            # one directory for every job: the next job finds the one before's run and is
            # refused, or with trainer.overwrite / trainer.resume replaces or skips it silently
            bad_dir = (f"hydra.sweep.subdir={subdir}: every job of the sweep would write into one "
                       "directory; keep ${hydra.job.num} in it (the default), one per job")
        if bad_dir is not None:
            return f"{bad_dir}; no job was run"
        sweep_dir = _sweep_dir(jobs[0]) if subdir in (None, "${hydra.job.num}") else None
        for i, job in enumerate(jobs, 1):
            try:
                # plan_only: no MPS daemon now (the job decides its own), the teacher below;
                # its warnings are the job's to say when it runs (they came twice)
                with _kept_warnings(say=False):
                    spec = prepare(list(job), plan_only=True)
                cfg = spec.config
                _check_sweep_job(spec)
                if output_dir_is_hydras(spec.raw):
                    if sweep_dir is not None:
                        # a re-used sweep folder: job i's directory may hold an older run
                        # (found only at job i's turn, after the jobs before it had trained)
                        rundir.check_fresh(sweep_dir / str(i - 1), cfg.trainer.resume,
                                           cfg.trainer.overwrite, setting=rundir.SWEEP_DIR_SETTING)
                else:  # a trainer.output_dir of its own
                    out = os.path.abspath(cfg.trainer.output_dir)
                    if out in dirs:
                        raise ConfigError(
                            f"trainer.output_dir={cfg.trainer.output_dir}: sweep job {dirs[out]} "
                            "writes into the same directory, so this job would find its run there; "
                            "leave trainer.output_dir to the sweep (hydra.sweep.dir, a subdir per "
                            "job) or give each job its own")
                    dirs[out] = i
                key = repr((cfg.model, cfg.data))
                if key not in data_seen:
                    data_seen.add(key)
                    load_prompts(cfg)
            except (ValueError, rundir.RunDirError) as e:  # a ConfigError, the teacher
                return refused(i, str(e))  # check's ValueError, an older run in job i's folder
    finally:
        _PREPARED = first  # job 1's start-up line still counts the process's imports
    return None


def _check_sweep_job(spec: RunSpec) -> None:
    """What a sweep job's own start would refuse beyond :func:`prepare` (``plan_only``): a
    multi-rank launcher (a Hydra multirun runs each job in this one process), what this machine
    cannot run, ``launcher.mps=true`` where it cannot be had, a graph's teacher left unset.

    Raises:
        ConfigError / ValueError: one line naming the field."""
    from flowrl.runtime.control.preflight import check_teacher_role

    cfg = spec.config
    if cfg.launcher.nproc > 1 or cfg.launcher.nnodes > 1:
        raise ConfigError(f"launcher.nproc={cfg.launcher.nproc}, launcher.nnodes="
                          f"{cfg.launcher.nnodes}: a sweep (-m) runs its jobs one after the other "
                          "in this process, on one rank each; start a multi-rank job on its own "
                          "(flowrl train without -m), once per setting")
    check_machine(cfg)  # vLLM not installed, no CUDA, ...
    if cfg.launcher.mps == "true":
        line = mps.preview(cfg)
        if line is not None and line.value == "refused":
            raise ConfigError(f"launcher.mps=true: {line.why}")
    if {"teacher", "teacher_rollout"} & set(spec.plan.roles):
        check_teacher_role(cfg, spec.plan)


def _sweep_dir(job: Sequence[str]) -> Optional[Path]:
    """The ``hydra.sweep.dir`` a sweep's jobs write under (its first job's), None where it does
    not resolve outside Hydra's job."""
    from omegaconf import OmegaConf

    try:
        return Path(str(OmegaConf.select(compose(list(job), with_hydra=True), "hydra.sweep.dir")))
    except Exception:  # noqa: BLE001 - an unresolvable value: Hydra's own report says why
        return None


def _sweep_dir_problem(job: Sequence[str]) -> Optional[str]:
    """``hydra.sweep.dir`` of a sweep (its first job's: every job's is the same) that cannot be
    made: empty (the jobs would write into the working directory), a file or under one, or a
    place where no directory can be created. None when it can be (nothing is left behind)."""

    from flowrl.runtime.io import rundir

    if _empty(_override(job, "hydra.sweep.dir")):
        return ("hydra.sweep.dir is empty: the jobs would write into the working directory; "
                "give it a path")
    where = _sweep_dir(job)
    if where is None:
        return None
    field = f"hydra.sweep.dir={where}"
    blocker = rundir.file_in_the_way(where)
    if blocker is not None:
        return f"{field}: {blocker} is a file, not a directory; choose another hydra.sweep.dir"
    missing = [p for p in (where, *where.parents) if not p.exists()]
    if missing:  # its first missing folder made and removed again: the sweep makes it at job 1
        try:
            missing[-1].mkdir()
        except OSError as e:
            return f"{field}: the sweep directory cannot be created ({e.strerror or e})"
        missing[-1].rmdir()
    return None


def _override(overrides: Sequence[str], key: str) -> Optional[str]:
    """The value ``overrides`` give ``key`` (the last one), None when none does."""
    return next((o.split("=", 1)[1] for o in reversed(overrides) if "=" in o and override_key(o) == key),
                None)


def _empty(value: Optional[str]) -> bool:
    """A given value that is empty (an unset shell variable, ``''``)."""
    return value is not None and value.strip().strip("'\"") == ""


def _finished(spec: RunSpec) -> bool:
    """A resumed run that is already complete, said in one line (``job.finished_run``); False
    where the newest checkpoint cannot be read here (the job's own checks then refuse it in one
    line, as for any resume)."""
    from flowrl.runtime.control.job import finished_run

    try:
        return finished_run(spec.config, Path(spec.config.trainer.output_dir), rank0=True) is not None
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _hydra_job(spec: RunSpec) -> None:
    """Run ``spec`` as Hydra runs a job (``hydra.core.utils.run_job``, its launchers' API): the
    run dir created, ``.hydra/`` and ``train.log`` written, ``HydraConfig`` set while it runs."""
    from typing import cast

    from hydra.core.utils import run_job
    from hydra.types import HydraContext, RunMode

    if spec.raw.hydra.mode is None:  # what Hydra's app records for a single run
        spec.raw.hydra.mode = RunMode.RUN
    # Hydra's files (.hydra/, train.log) go with the run: a trainer.output_dir given on the
    # command line used to leave them in a stray ./outputs/<date>/<time>/ of the working directory
    spec.raw.hydra.run.dir = os.path.abspath(spec.config.trainer.output_dir)
    context = HydraContext(config_loader=cast(Any, None), callbacks=cast(Any, _NoCallbacks()))
    # a resumed run's .hydra/ holds the config it trained with: Hydra's job rewrites it with this
    # invocation's, which a refusal inside the job (a corrupt checkpoint) must not leave behind
    record = Path(spec.raw.hydra.run.dir) / ".hydra"
    kept = _copy_aside(record)
    try:
        ret = run_job(task_function=lambda _: _run(spec), config=spec.raw,
                      job_dir_key="hydra.run.dir", job_subdir_key=None, hydra_context=context)
        _ = ret.return_value  # re-raises what the job raised
    except SystemExit as e:
        if kept is not None and e.code == 2:  # refused (_refused): the run's record goes back
            shutil.rmtree(record, ignore_errors=True)
            shutil.copytree(kept, record)
        raise
    finally:
        if kept is not None:
            shutil.rmtree(kept.parent, ignore_errors=True)


def _copy_aside(folder: Path) -> Optional[Path]:
    """A copy of ``folder`` in a temporary directory (None where there is no such folder)."""
    if not folder.is_dir():
        return None
    aside = Path(tempfile.mkdtemp(prefix="flowrl-hydra-record-")) / folder.name
    shutil.copytree(folder, aside)
    return aside


class _NoCallbacks:
    """Hydra's job hooks (``hydra.core.utils.run_job`` calls them): flowrl configures none."""

    def on_job_start(self, **kwargs: Any) -> None:
        pass

    def on_job_end(self, **kwargs: Any) -> None:
        pass


def _refused(line: str) -> int:
    print(f"flowrl train: error: {line}", file=sys.stderr)
    return 2


def _run(source: "RunSpec | DictConfig") -> None:
    """The job inside Hydra's (its run dir exists): :func:`train`; a crash, Ctrl-C or SIGTERM
    ends in one report with the command that continues the run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from flowrl.runtime.control.recovery import report_crash, stop_on_sigterm
    from flowrl.runtime.io import rundir

    hydra_dir = HydraConfig.get().runtime.output_dir
    if isinstance(source, RunSpec):
        _write_early_warnings(source)
    stop_on_sigterm()  # torchrun stops the survivors of a dead rank with SIGTERM
    out_dir = (source.config if isinstance(source, RunSpec) else source).trainer.output_dir
    try:
        train(source)  # a multirun job (a DictConfig) is prepared here
    except (ConfigError, rundir.RunDirError) as e:  # rejected before any model loaded: one line
        why = str(e)
        if isinstance(e, ConfigError):  # a multirun job's directory: Hydra's files only
            rundir.remove_hydra_leftovers(Path(hydra_dir))
            if HydraConfig.get().mode == RunMode.MULTIRUN:  # and a sweep that ran no job
                rundir.remove_sweep_leftovers(Path(HydraConfig.get().sweep.dir))
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # which job of the sweep (its overrides)
            hc = HydraConfig.get()
            why = f"sweep job {hc.job.num + 1} ({' '.join(hc.overrides.task)}): {why}"
        sys.exit(_refused(why))
    except KeyboardInterrupt:
        import signal

        from flowrl.runtime.io.supervisor_dir import ENV as SUPERVISOR_ENV

        # a terminal's Ctrl-C reaches every rank and torchrun's agent, which forwards it again:
        # a second one must not break the teardown below with a traceback per rank
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not os.environ.get(SUPERVISOR_ENV):  # else the launcher says it once, last
            print(f"\nflowrl train: interrupted; {rundir.resume_hint(Path(out_dir), hydra_dir)}",
                  file=sys.stderr)
        sys.exit(130)
    except BaseException as e:  # SIGTERM, a dead peer, a full disk, a diverged step...
        if isinstance(e, SystemExit):
            raise
        code = report_crash(e, out_dir)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN and code == 1:
            # one job's crash (a diverged lr of a sweep over lr) does not cancel the jobs after
            # it, which never ran and were never said to (fresh-user report); SIGTERM still
            # stops the sweep, and its end says which jobs stopped
            _SWEEP_STOPPED.append(f"job {hc.job.num + 1} ({' '.join(hc.overrides.task)}): "
                                  f"{type(e).__name__}")
            return
        sys.exit(code)
    finally:
        if "torch.distributed" in sys.modules:  # a config rejected before torch loaded: nothing
            from flowrl.runtime.io.distributed import teardown

            teardown()


_SWEEP_STOPPED: list[str] = []  # the jobs of this process's sweep that stopped (_run)


def _hydra_app() -> None:
    import hydra

    from flowrl.config import register_configs

    register_configs()
    _SWEEP_STOPPED.clear()
    # absolute: Hydra resolves a relative path against the package when this module is imported
    hydra.main(version_base="1.3", config_path=str(REPO_ROOT / "conf"),
               config_name="train")(_run)()
    if _SWEEP_STOPPED:  # the others ran: the sweep's end says which did not finish
        n = len(_SWEEP_STOPPED)
        print(f"flowrl train: {n} sweep job{'s' * (n > 1)} stopped (the others ran): "
              f"{'; '.join(_SWEEP_STOPPED)}", file=sys.stderr)
        sys.exit(1)


__all__ = ["ConfigError", "RunSpec", "main", "prepare", "train"]


if __name__ == "__main__":
    main()
