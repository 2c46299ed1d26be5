"""The training job, written once for every placement.

    flowrl train ...  (flowrl/train.py: the Hydra entry)
        │
        ▼  train.prepare, once: config composed · fields · machine defaults · graph → plan ·
        │  placement · model folder + every data row (runtime/control/preflight.check_run) = RunSpec
        ▼  (runtime/control/spec.py); no model loaded
    run_job(spec)    process group · run directory claimed (one run per directory)
        │            placement=auto: runtime/control/auto.py re-plans between phases, each one
        │            a run_placement resuming the previous one's checkpoint
        ▼
    run_placement    this rank, one PlacementPlan:
        │  RankPlacement ◄── colocated (Colocated, below) | partitioned (runtime/control/partitioned.py)
        │                    = the part of the plan this rank runs, its pool, how batches and
        │                      weights cross pools
        ├─ setup    tokenizer · PromptSource(pool shard) · build_engines(pool's roles) ·
        │           Executor(the rank's plan) ─► op states (ops/state.py, declared per op)
        ├─ resume   checkpoint ─► trainable engines + RNG · prompt sampler · op states · history
        ├─ start    weights to the rollout engine (load, or broadcast version start-1)
        ├─ eval     before ─► metrics.jsonl step 0
        ├─ loop     placement.step(s) ──record(s, metrics)──► logger · history
        │                             ──reached(v)─────────► checkpoint v (every rank joins;
        │                                                     async, perf/checkpoint_s)
        ├─ eval     after
        └─ summary  summary.json; engines closed on the way out, error or not

What differs between placements is only what a :class:`RankPlacement` supplies; what a
checkpoint holds, when it is written, how a run resumes, evaluates and reports is here, so a
fix lands in every placement at once. A rank *reaches* version v when it holds (or, on a
partitioned rollout rank, has received) the weights after update v: every rank of the job
joins the save of a checkpoint step at that point (DCP saves are collective), which is where
the other ranks wait for it, so saving never deadlocks a pool's queue.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from flowrl.compiler.modes import format_placement, mode_of
from flowrl.compiler.placement import Mode
from flowrl.runtime.control import mps
from flowrl.runtime.control.colocated import Colocated
from flowrl.runtime.control.events import JobEvents
from flowrl.runtime.control.health import RunHealth
from flowrl.runtime.control.preflight import (
    ConfigError,
    attach_estimate,
    load_prompts,
    measured_prompt_tokens,
)

if TYPE_CHECKING:
    from flowrl.compiler.placement import PlacementPlan
    from flowrl.compiler.plan import ExecutionPlan
    from flowrl.config import TrainConfig
    from flowrl.ops.context import DistInfo
    from flowrl.runtime.control.spec import RunSpec
    from flowrl.runtime.io.checkpoint import CheckpointManager
    from flowrl.runtime.step.evaluate import Evaluator
    from flowrl.runtime.step.executor import Executor
    from flowrl.runtime.step.resources import Engines

log = logging.getLogger("flowrl")

# the console's machine line: what trainer.offload resolved to (the Executor's swap)
OFFLOAD_WORDS = {"all": "on", "generate": "rollout only", "none": "off"}
OP_STATE_KEY = "op_state"  # trainer_state.json: every stateful op's state dict, by its key
LEGACY_OP_STATE = ("kl_controller",)  # written at the top level before op_state existed
HISTORY_KEYS = ("reward/mean", "reward/accuracy", "perf/step_s", "placement/version_lag",
                # the health counters continue across a resume (runtime/control/health.py)
                "train/skipped_steps", "train/optimizer_steps", "reward/constant_steps",
                "train/unscorable_steps")


class RankPlacement(Protocol):
    """What one placement supplies to the job on this rank.

    Attributes:
        name: ``colocated`` | ``partitioned`` (recorded in the checkpoint).
        plan: the part of the plan this rank runs. dist: its pool's data-parallel rank, size and
            process group (prompt shard, seed offset, the ops' collectives).
        sends: keys this rank's pool hands to the other pool after each step.
        engine_ranks / engine_group: ``build_engines``'s ``world_size`` / ``group`` (None: world).
        logs: this rank logs metrics and writes ``summary.json``.
        holds_state: its engines hold the training state (checkpointed tensors, torch RNG).
        samples: it samples prompts (its prompt sampler is restored on resume).
        sampling_ranks: ranks of the job that sample prompts each step (for tokens/s).
        overlaps: the rollout of the next step runs beside this step's update on the same
            devices (``runtime/control/overlap.py``): the rollout engine holds weights of its own
            and nothing is offloaded.
    """

    name: str
    plan: "ExecutionPlan"
    dist: "DistInfo"
    sends: list[str]
    engine_ranks: Optional[int]
    engine_group: Any
    logs: bool
    holds_state: bool
    samples: bool
    sampling_ranks: int
    overlaps: bool

    def header(self, cfg: "TrainConfig", out_dir: Path) -> str:
        """The run's first console line."""

    def start(self, executor: "Executor", engines: "Engines", start: int, resumed: bool) -> None:
        """Bring the rollout engine to the weights of version ``start - 1``."""

    def step(self, step: int, events: JobEvents) -> None:
        """Run training step ``step`` on this rank; report through ``events``."""

    def finish(self, events: JobEvents) -> None:
        """After the last step: report what is still to be reached; let the other pool finish."""

    def prompt_state(self, prompts: Any) -> Any:
        """The prompt sampler state this rank puts into a checkpoint (read from rank 0's)."""

    def evaluator(self, cfg: "TrainConfig", plan: "ExecutionPlan", engines: "Engines",
                  prompts: Any, tokenizer: Any) -> Optional[Evaluator]:
        """Greedy eval on this rank (None: it takes no part)."""

    def summary_fields(self, earlier: dict[str, Any], start: int) -> dict[str, Any]:
        """Placement fields of ``summary.json`` at the start (``earlier``: a resumed run's)."""

    def final_fields(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Placement fields of ``summary.json`` after the last step."""


def rank_placement(cfg: "TrainConfig", pp: "PlacementPlan", dinfo: "DistInfo") -> RankPlacement:
    """This rank's part of ``pp`` (partitioned: creates the pool groups, a collective)."""
    if mode_of(pp.mode).concurrent_pools:
        from flowrl.runtime.control.partitioned import partitioned_rank

        return partitioned_rank(cfg, pp, dinfo)
    if pp.overlapped:  # placement.staleness=1: the next rollout beside this update
        from flowrl.runtime.control.overlap import Overlapped

        return Overlapped(cfg, pp, dinfo)
    return Colocated(pp, dinfo)


# ---- the job --------------------------------------------------------------------------------------
def run_job(spec: "RunSpec") -> dict[str, Any]:
    """Run a pre-flighted training job (``flowrl.train.prepare``) on this rank; returns the
    summary also written to ``summary.json``.

    Raises:
        ConfigError: an impossible placement on the world the job got (when that is not the one
            ``spec`` was placed on). RunDirError: the run directory holds a previous run
            (``trainer.resume`` / ``trainer.overwrite``) or another run.
    """
    from flowrl.runtime.io import distributed as fdist
    from flowrl.runtime.io import rundir
    from flowrl.runtime.step.resources import set_job_began, since_launch_s, since_start

    cfg, plan = spec.config, spec.plan
    set_job_began(spec.startup_began_s)  # a sweep's later job: its lines count from its start
    to_job = since_launch_s()  # prepare's parts, then the run directory and Hydra's job files
    t0 = time.perf_counter()
    dinfo = fdist.init_distributed(cfg.trainer.device, timeout_s=cfg.launcher.collective_timeout_s,
                                   heartbeat_timeout_s=cfg.launcher.heartbeat_timeout_s)
    if dinfo.world_size == 1 and cfg.trainer.engine.strategy == "fsdp" and \
            {"actor", "critic"} & set(plan.roles):
        dinfo = fdist.init_single_process(cfg.trainer.device)  # FSDP2 needs a (1-rank) group
    group_s = time.perf_counter() - t0
    rank0 = dinfo.rank == 0
    if rank0:
        for r in spec.resolved:  # the machine's defaults, before anything loads
            log.info("resolved %s", r)
        if spec.startup:
            # what prepare timed, then what came between it and the job (on the H200 the first
            # console line came 7.8 s after prepare's parts ended, unexplained)
            job_parts = (("run directory, Hydra's job and the job's imports",
                          max(to_job - spec.startup_began_s - sum(s for _, s in spec.startup),
                              0.0)),
                         ("process group", group_s))
            log.info("start-up: checked %.1f s since the %s started (%s)", *since_start(),
                     spec.startup_line(job_parts))
    # the job got another world than the configured one (train() outside torchrun): place again
    pp = spec.placement if spec.placement.world_size == dinfo.world_size else \
        placement_for(cfg, plan, dinfo.world_size)
    # start-up lines once per pool, not once per rank: the first rank of each pool speaks (a
    # partitioned run's rollout pool builds engines rank 0 never has)
    fdist.quiet_other_ranks(dinfo.rank, speakers={min(p.ranks) for p in pp.pools.values() if p.ranks})
    if (pool := other_pool_speaker(pp, dinfo.rank)) is not None:  # whose line is whose
        fdist.tag_rank_lines(f"{pool} pool")
    # ranks' Hydra run dirs can differ by a timestamp second: all use rank 0's (DCP needs one dir)
    out_dir = Path(fdist.broadcast_object(cfg.trainer.output_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    if dinfo.world_size > 1:  # a silent peer stops this rank with the resume command
        from flowrl.runtime.control import recovery
        from flowrl.runtime.io import supervisor_dir

        recovery.stop_on_silent_peer(out_dir)
        if rank0:
            supervisor_dir.announce_run_dir(out_dir)
    lock = rundir.claim_run_dir(out_dir, cfg.trainer, rank0=rank0)  # one run per directory
    try:
        if cfg.placement.mode is Mode.AUTO and dinfo.world_size > 1:
            done = finished_run(cfg, out_dir, rank0)
            if done is not None:
                return done
            from flowrl.runtime.control import auto  # profile colocated, choose, continue

            return auto.run_auto(cfg, plan, dinfo, out_dir, run_placement)
        return run_placement(cfg, plan, pp, dinfo, out_dir)
    finally:
        lock.release()


def placement_for(cfg: "TrainConfig", plan: "ExecutionPlan", world_size: int) -> "PlacementPlan":
    """The placement on ``world_size`` ranks, another world than pre-flight placed the job on.

    Raises:
        ConfigError: the placement is impossible on ``world_size`` ranks (nothing loaded).
    """
    from flowrl.runtime.control.preflight import prepare_placement

    try:
        return prepare_placement(cfg, plan, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def finished_run(cfg: "TrainConfig", out_dir: Path, rank0: bool) -> Optional[dict[str, Any]]:
    """A resumed run whose newest checkpoint is at ``trainer.total_steps``: say so once and
    return its summary (load nothing); else None."""
    from flowrl.runtime.io.rundir import finished_run_summary

    if not cfg.trainer.resume:
        return None
    done = finished_run_summary(out_dir, cfg.trainer.total_steps)
    if done is None:
        return None
    if rank0:
        print(f"run already complete at step {done[0]} (trainer.total_steps="
              f"{cfg.trainer.total_steps}); raise trainer.total_steps to train further", flush=True)
    return done[1]


def start_checkpoints(ckpts: "CheckpointManager", resume: bool):
    """Start-up of the run's checkpoint folder: stale ``.tmp`` saves removed; with ``resume``,
    the checkpoint to continue from (a corrupt newest one falls back to the previous).

    Raises:
        ConfigError: a tampered or unloadable checkpoint; nothing was loaded or written.
    """
    from flowrl.runtime.io.checkpoint import CorruptCheckpointError, UnsafeCheckpointError

    try:
        ckpts.remove_stale()
        return ckpts.resume_point() if resume else None
    except (UnsafeCheckpointError, CorruptCheckpointError) as e:
        raise ConfigError(f"trainer.resume: {e}") from e


def run_placement(cfg: "TrainConfig", plan: "ExecutionPlan", pp: "PlacementPlan",
                  dinfo: "DistInfo", out_dir: Path, *, intro: Optional[str] = None,
                  closing: bool = True) -> dict[str, Any]:
    """The job on this rank for one placement (see the module docstring); returns the summary.
    ``placement=auto`` runs it per phase: ``intro``, a console line before the phase's header;
    ``closing=False``, no closing ``checkpoint: ...`` line (the profile phase is not the end).

    Every engine is closed on the way out, error or not: vLLM engine processes must not outlive
    the run (torchrun would wait for them)."""
    from flowrl.runtime.io.checkpoint import CheckpointManager
    from flowrl.runtime.step.resources import Engines

    # a tampered or corrupt checkpoint is refused (ConfigError) before anything reads it further
    ckpts = CheckpointManager(out_dir / "checkpoints", keep_last=cfg.trainer.keep_last)
    resume_from = start_checkpoints(ckpts, cfg.trainer.resume)  # before anything writes here
    done = finished_run(cfg, out_dir, dinfo.rank == 0)  # a finished run: say so once, load nothing
    if done is not None:
        return done
    engines = Engines()
    try:
        job = _Job(cfg, plan, pp, dinfo, out_dir, ckpts, engines)
        job.intro, job.closing = intro, closing
        return job.run(resume_from)
    finally:
        engines.close()  # vLLM's shutdown destroys process groups: before the job's teardown


class _Job:
    """One :func:`run_placement`: the state the loop shares with the placement's events."""

    def __init__(self, cfg: "TrainConfig", plan: "ExecutionPlan", pp: "PlacementPlan",
                 dinfo: "DistInfo", out_dir: Path, ckpts: "CheckpointManager", engines: "Engines"):
        self.cfg, self.full, self.pp, self.dinfo = cfg, plan, pp, dinfo
        self.out_dir, self.ckpts, self.engines = out_dir, ckpts, engines
        self.history: list[dict[str, Any]] = []
        self.health: Optional[RunHealth] = None  # made at the first step (after a resume)
        self.save_steps: set[int] = set()
        self.logger: Any = None
        self.intro: Optional[str] = None  # placement=auto's phase line before the header
        self.closing = True  # the closing "checkpoint: ..." line (not after auto's profile)

    def run(self, resume_from: Optional[Path]) -> dict[str, Any]:
        import torch
        from omegaconf import OmegaConf

        from flowrl.models.loading import load_tokenizer
        from flowrl.runtime.io import distributed as fdist
        from flowrl.runtime.io.checkpoint import CorruptCheckpointError
        from flowrl.runtime.io.metrics import MetricsLogger
        from flowrl.runtime.io.profiling import StepProfiler
        from flowrl.runtime.step.evaluate import eval_line
        from flowrl.runtime.step.executor import Executor
        from flowrl.runtime.step.resources import (
            RunResources,
            Swap,
            build_engines,
            peak_rss_gib,
            resolve_offload,
            run_device,
            since_start,
            use_fsdp,
        )

        cfg, dinfo, out_dir, T = self.cfg, self.dinfo, self.out_dir, self.cfg.trainer.total_steps
        place = self.place = rank_placement(cfg, self.pp, dinfo)
        torch.manual_seed(cfg.trainer.seed)

        # ---- setup: this rank's engines, resources, executor; a console line for each phase
        # as it ends, from the first second (a file gets them as a terminal does)
        say = _Say(place.logs and cfg.logger.console, log_files=place.logs)
        # the setup lines of a pool the logging rank is not in (a partitioned run's rollout pool
        # builds engines the train pool never has), said by that pool's first rank, tagged
        pool = other_pool_speaker(self.pp, dinfo.rank)
        setup_say = say if pool is None else _Say(cfg.logger.console, prefix=f"{pool} pool: ")
        if self.intro:
            say(self.intro)
        say(place.header(cfg, out_dir))
        t0 = time.perf_counter()
        # what only the tokenizer can tell (every prompt over data.max_prompt_tokens, a chat
        # template that fails on a row) is refused in one line like any input check, no model
        # loaded, and the run directory left as it was found (plan.txt comes after)
        tokenizer, prompts = load_prompts(cfg, place.dist.rank, place.dist.world_size)
        setup_say(f"setup: data {len(prompts)} prompts in {time.perf_counter() - t0:.1f} s")
        if cfg.trainer.resume and resume_from is not None and place.samples:
            check_resumed_prompts(resume_from, prompts, cfg)  # before any model loads
        if dinfo.rank == 0:
            # what `flowrl plan` prints for this run: a partitioned run's pools and transfers,
            # with the cost model's predictions for the prompts just rendered
            try:
                if self.pp.estimate is None:  # P as flowrl plan measures it (auto has its own)
                    attach_estimate(cfg, self.full, self.pp,
                                    measured_prompt_tokens(cfg, self.pp.notes, tokenizer))
            except Exception as e:  # noqa: BLE001 - the predictions inform, they never stop a run
                self.pp.notes.append(f"no predictions: {type(e).__name__}: {e}")
            (out_dir / "plan.txt").write_text(format_placement(self.pp, "text") + "\n")
        t0 = time.perf_counter()
        built = build_engines(cfg, place.plan, tokenizer, world_size=place.engine_ranks,
                              group=place.engine_group, rollout_apart=place.overlaps)
        for f in dataclasses.fields(built):  # into the engines the caller closes
            setattr(self.engines, f.name, getattr(built, f.name))
        load_s = time.perf_counter() - t0
        log.info("engines built in %.1f s (%.1f s since the %s started); host peak RSS so "
                 "far %.2f GiB", load_s, *since_start(), peak_rss_gib())
        if (line := mps.serving_line()) is not None:  # launcher.mps: did the contexts join?
            log.info(line)
        setup_say(f"setup: model and engines ({', '.join(place.plan.roles)}) in {load_s:.1f} s, "
                  f"host peak RSS {peak_rss_gib():.2f} GiB")
        resources = RunResources(
            tokenizer=tokenizer, prompts=prompts, algorithm=cfg.algorithm,
            sampling=cfg.rollout.sampling, trainer=cfg.trainer,
            genrm_tokenizer=(load_tokenizer(cfg.reward.genrm.model or cfg.model)
                             if "genrm" in place.plan.roles else None))
        swap: Swap = "none"
        if place.overlaps:  # both halves run at once: nothing may leave the device
            why_swap = f"placement.staleness={self.pp.staleness}: the rollout runs beside the update"
        else:
            swap, why_swap = resolve_offload(cfg, self.engines)
        # the pool rank offsets the seed: pool rank 0 draws what colocated rank 0 draws, and
        # rank 0 keeps the run seed (world size 1 unchanged)
        executor = self.executor = Executor(
            place.plan, self.engines, resources.for_ops(),
            seed=cfg.trainer.seed + 1_000_003 * place.dist.rank, dist=place.dist,
            sends=place.sends, swap=swap, verify_sync=cfg.rollout.verify_sync,
            verify_sync_every=cfg.rollout.verify_sync_every)

        # ---- resume
        start, earlier = 1, dict[str, Any]()
        if cfg.trainer.resume and resume_from is not None:
            t0 = time.perf_counter()
            try:
                start, earlier, changed = self.resume(resume_from, prompts)
            except CorruptCheckpointError as e:  # its files' content: try the one before it
                resume_from, (start, earlier, changed) = self.resume_previous(resume_from, e, prompts,
                                                                              say)
            say(f"setup: resumed from {resume_from} in {time.perf_counter() - t0:.1f} s: "
                f"continuing at step {start} of {T}")
            if changed:  # allowed (a lower lr to go on with), but never silently
                say(f"setup: settings changed since {resume_from.name}: {'; '.join(changed)}")
        elif cfg.trainer.resume:
            # on the console, not only in the log: auto-resume of a requeued job wants this, and a
            # mistyped trainer.output_dir would otherwise go unnoticed until the run ends
            say(f"setup: trainer.resume=true but no checkpoint in {self.ckpts.root}: starting "
                "at step 1")
        self.save_steps = {s for s in range(start, T + 1)
                           if s == T or (cfg.trainer.save_every and s % cfg.trainer.save_every == 0)}
        summary: dict[str, Any] = place.summary_fields(earlier, start)
        summary.update({"model_load_s": load_s, "plan_order": self.pp.full.order})
        finished = start > T  # resumed a run that had already completed

        self.prompts = prompts
        place.start(executor, self.engines, start, resumed=start > 1)
        ev = cfg.trainer.eval
        evaluate = place.evaluator(cfg, self.full, self.engines, prompts, tokenizer)
        run_config = OmegaConf.to_container(OmegaConf.structured(cfg))
        assert isinstance(run_config, dict)  # a structured config's container is a dict
        self.logger = logger = MetricsLogger(
            out_dir, cfg.logger, T, enabled=place.logs, first_step=start,
            run_config=run_config)
        # the strategy the engines were built with (auto: fsdp above one rank, else local)
        strategy = "fsdp" if use_fsdp(cfg, place.engine_ranks) else "local"
        with logger:
            logger.print(f"machine: device={cfg.trainer.device} rollout={cfg.rollout.backend} "
                         f"dtype={cfg.model.dtype} strategy={strategy} "
                         f"offload={OFFLOAD_WORDS[swap]} ({why_swap})")
            if evaluate is not None and ev.before and start == 1:
                before = evaluate(out_dir / "eval_before.jsonl", logger.eval_progress("eval before"))
                if before is not None:  # the rank that evaluated
                    summary["eval_before"] = before
                    if before:
                        logger.log(0, before)
                        logger.print(f"eval before: {eval_line(before)}")
            logger.set_progress(start - 1)
            profiler = StepProfiler(cfg.trainer.profile, out_dir, dinfo.rank, run_device(cfg), start)
            first_done = last_done = None
            for step in range(start, T + 1):
                fdist.mark_step(step)  # the peer monitor names a rank that stops making progress
                with profiler.step(step):  # trainer.profile.steps; a no-op on the others
                    place.step(step, self)
                last_done = since_start()[0]
                if step == start:
                    first_done = last_done
                    if dinfo.rank == 0:  # time to first step: what a user waits before
                        # training shows (once, not once per rank)
                        log.info("step %d done %.1f s since the %s started", step, *since_start())
                self.ckpts.poll()
                if evaluate is not None and ev.every and step % ev.every == 0 and \
                        (step < T or not ev.after):  # the last step's is the eval after
                    mid = evaluate(None, logger.eval_progress(f"eval step {step}"))
                    if mid:  # the rank that evaluated: a held-out accuracy curve in metrics.jsonl
                        logger.log(step, mid)
                        logger.print(f"eval step {step}: {eval_line(mid)}")
            place.finish(self)
            self.ckpts.wait()
            if finished:
                logger.print(f"run already complete at step {start - 1} (trainer.total_steps="
                             f"{T}); raise trainer.total_steps to train further")
            if evaluate is not None and ev.after and not finished:
                after = evaluate(out_dir / "eval_after.jsonl", logger.eval_progress("eval after"))
                if after is not None:
                    summary["eval_after"] = after
                    if after:
                        logger.log(T, after)
                        logger.print(f"eval after: {eval_line(after)}")
            if self.ckpts.latest() is not None and not finished and self.closing:
                logger.print(f"checkpoint: {self.ckpts.latest()}")
            if first_done is not None and last_done is not None and self.closing:
                # the run's wall time, said at its end: where start-up, steps and the rest went
                total, what = since_start()
                steps = (f"step {T} finished at {last_done:.1f} s" if start == T else
                         f"step {start} finished at {first_done:.1f} s, step {T} at "
                         f"{last_done:.1f} s")
                logger.print(f"done: {total:.1f} s since the {what} started ({steps})")
        summary["history"] = self.history
        summary.update(place.final_fields(summary))
        summary["checkpoint"] = str(self.ckpts.latest())
        if place.logs:
            (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    # ---- resume --------------------------------------------------------------------------------
    def resume(self, path: Path, prompts: Any) -> tuple[int, dict[str, Any], list[str]]:
        """Load ``path`` into this rank's engines, sampler and op states; returns (first step,
        the earlier part's summary, the settings this run changed: ``rundir.changed_settings``).
        Collective: every rank loads (DCP), holding state or not."""
        from flowrl.runtime.io.rundir import changed_settings

        place, executor = self.place, self.executor
        tensors = self.engines.train_state() if place.holds_state else {}
        meta = self.ckpts.load(path, tensors)
        if place.holds_state:
            self.engines.load_train_state(tensors)
        if place.samples:  # another sampler layout (placement=auto's colocated profile) restarts
            prompts.load_state_dict(rescale_prompt_state(meta["prompts"], place.dist.world_size,
                                                         self.cfg.trainer.prompts_per_step))
        missing = executor.load_op_state_dict(saved_op_state(meta))
        if missing:
            log.warning("resume: %s holds no state for %s; starting from the initial value",
                        path.name, ", ".join(missing))
        start = int(meta["step"]) + 1
        self.history = meta.get("history", [])
        earlier: dict[str, Any] = {}
        if (self.out_dir / "summary.json").is_file():  # keep the record of the earlier part
            earlier = json.loads((self.out_dir / "summary.json").read_text())
        if "eval_before" not in earlier:  # an interrupted part wrote no summary: its step-0 row
            from flowrl.runtime.io.metrics import read_metrics

            row = read_metrics(self.out_dir).get(0)
            if row:
                earlier["eval_before"] = {k: v for k, v in row.items() if k.startswith("eval/")}
        return start, earlier, changed_settings(meta.get("settings"), self.cfg)

    def resume_previous(self, path: Path, error: Exception, prompts: Any,
                        say: "_Say") -> tuple[Path, tuple[int, dict[str, Any], list[str]]]:
        """``path`` passed :func:`verify_checkpoint` but its tensors did not load (``error``: a
        damaged shard of the right length): resume from the checkpoint before it and, once that
        one has loaded, set ``path`` aside as ``step_N.corrupt``. A checkpoint that cannot load
        for another reason (another model) fails the older one too: then nothing is moved.

        Raises:
            ConfigError: no older checkpoint, or it does not load either (nothing moved).
        """
        from flowrl.runtime.io.checkpoint import CorruptCheckpointError

        previous = self.ckpts.previous(path)
        if previous is None:
            raise ConfigError(f"trainer.resume: {error}; no older checkpoint to resume from "
                              "(nothing was moved)") from error
        try:
            got = self.resume(previous, prompts)  # every tensor loaded again: none kept of path's
        except CorruptCheckpointError as e:
            raise ConfigError(f"trainer.resume: {error}; {previous.name}, the one before it, does "
                              f"not load either ({e}): nothing was moved") from e
        bad = self.ckpts.set_aside(path, str(error))
        # the cause is in the set-aside warning above (log and console): here the outcome
        say(f"setup: resuming from {previous.name} instead ({path.name} set aside as {bad.name})")
        return previous, got

    # ---- JobEvents -----------------------------------------------------------------------------
    def record(self, step: int, m: dict[str, float]) -> None:
        gen_tokens = (m.get("response/length_mean", 0.0) * self.cfg.trainer.prompts_per_step
                      * self.cfg.algorithm.n * self.place.sampling_ranks)
        m["perf/tokens_per_s"] = gen_tokens / max(m["perf/step_s"], 1e-9)
        if self.health is None:  # after a resume has restored the history
            t = self.cfg.trainer
            self.health = RunHealth(t.max_skipped_steps, t.max_skipped_frac,
                                    t.constant_reward_steps, t.total_steps, self.history,
                                    max_unscorable_steps=t.max_unscorable_steps,
                                    speak=self.dinfo.rank == 0)
        try:
            self.health.update(step, m)  # raises RunStopped past the skipped-step budget
        finally:  # the step that broke the budget is in metrics.jsonl too
            self.logger.log(step, m)
            self.history.append({"step": step, **{k: m[k] for k in HISTORY_KEYS if k in m}})

    def reached(self, version: int) -> None:
        if version in self.save_steps:
            from torch.profiler import record_function

            with record_function("flowrl/checkpoint/save"):  # its share of a profiled step
                self.save(version)

    def save(self, step: int) -> None:
        """Checkpoint ``step`` (collective: every rank of the job calls it, in step order)."""
        from flowrl.runtime.io import distributed as fdist
        from flowrl.runtime.io.rundir import invocation_overrides, run_record
        from flowrl.runtime.step.resources import peak_rss_gib

        t0 = time.perf_counter()
        last = step == self.cfg.trainer.total_steps
        # global rank 0 writes the metadata, but the sampler state and the history are the
        # logging rank's (a partitioned train pool's rank 0, which need not be global rank 0);
        # op states: every rank's (a pool holds its own ops'), the lowest rank's of each key
        ranks = fdist.all_gather_objects({
            "logs": self.place.logs, "prompts": self.place.prompt_state(self.prompts),
            "history": self.history, "op_state": self.executor.op_state_dict()})
        logger = next(r for r in ranks if r["logs"])
        # what a resume is checked against before it loads anything (rundir.check_resume):
        # model, graph, trained roles, and this invocation's overrides to repeat
        meta = {"prompts": logger["prompts"], "history": logger["history"],
                "world_size": self.dinfo.world_size, "placement": self.place.name,
                **run_record(self.cfg, self.full.roles, invocation_overrides()),
                OP_STATE_KEY: merge_op_states([r["op_state"] for r in ranks])}
        tensors = self.engines.train_state() if self.place.holds_state else {}
        path = self.ckpts.save(step, tensors, meta,
                               async_save=self.cfg.trainer.async_save and not last)
        self.logger.print(f"checkpoint step {step}: {path}")
        # async: only the copy to host memory blocked the step
        self.logger.log(step, {"perf/checkpoint_s": time.perf_counter() - t0,
                               "perf/host_peak_rss_gib_after_checkpoint": peak_rss_gib()})


def other_pool_speaker(pp: "PlacementPlan", rank: int) -> Optional[str]:
    """The pool ``rank`` speaks for when it is the first rank of a pool the logging rank is not
    in (a partitioned run's rollout pool: the train pool's first rank logs the run), else None."""
    from flowrl.compiler.placement import TRAIN_POOL

    if len(pp.pools) < 2:  # colocated: one pool, its rank 0 logs
        return None
    return next((name for name, p in pp.pools.items()
                 if p.ranks and min(p.ranks) == rank and name != TRAIN_POOL), None)


class _Say:
    """Console lines before the metrics logger exists (the start-up phases), flushed at once;
    each also goes to the run's log files (``train.log``: Hydra's file handler) as plain text,
    so a line needs no ``log.info`` twin (the twin doubled it on the console). ``prefix``: the
    pool a rank speaks for (``rollout pool: ``)."""

    def __init__(self, enabled: bool, log_files: bool = True, prefix: str = ""):
        from rich.console import Console

        self.console = Console(soft_wrap=True) if enabled else None
        self.log_files, self.prefix = log_files, prefix

    def __call__(self, msg: str) -> None:
        msg = self.prefix + msg
        if self.console is not None:
            self.console.print(msg)
            self.console.file.flush()
        if self.log_files:
            from flowrl.runtime.io.distributed import POOL_TAGGED
            from flowrl.runtime.io.metrics import to_log_files

            to_log_files(msg, log.name, **{POOL_TAGGED: True})  # its prefix is in, not twice


def merge_op_states(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One state per op-state key from every rank's :meth:`Executor.op_state_dict` (rank order:
    the lowest rank holding a key wins; data-parallel ranks hold the same state)."""
    out: dict[str, Any] = {}
    for states in per_rank:
        for key, st in states.items():
            out.setdefault(key, st)
    return out


def saved_op_state(meta: dict[str, Any]) -> dict[str, Any]:
    """The op states of a checkpoint's ``trainer_state.json``: its ``op_state``; a checkpoint
    written before op states went through the registry keeps the KL controller's β at the top
    level (``kl_controller``), which is read the same way."""
    states = dict(meta.get(OP_STATE_KEY) or {})
    for key in LEGACY_OP_STATE:
        if key in meta and key not in states:
            states[key] = meta[key]
    return states


def check_resumed_prompts(checkpoint: Path, prompts: Any, cfg: "TrainConfig") -> None:
    """The checkpoint's place in the data (its prompt source state) must fit this run's prompts:
    checked after the tokenizer rendered them and before any model loads.

    Raises:
        ConfigError: naming the ``data.*`` settings changed since the checkpoint (its settings
            record) and why the place cannot be continued; nothing loaded or written. (It was a
            traceback after the model load, and the resume command it printed failed the same.)
    """
    from flowrl.runtime.io.rundir import changed_settings

    meta = json.loads((checkpoint / "trainer_state.json").read_text())
    if "prompts" not in meta:
        return
    try:
        prompts.check_state(meta["prompts"])
    except ValueError as e:
        data = [c for c in changed_settings(meta.get("settings"), cfg) if c.startswith("data.")]
        what = f" ({'; '.join(data)})" if data else ""
        raise ConfigError(
            f"trainer.resume: {checkpoint.name} drew its prompts from other data than this "
            f"run's{what}: its place in the data cannot be continued ({e}); resume with the "
            "checkpoint's data settings, or start a new run (another hydra.run.dir)") from e


def rescale_prompt_state(state: dict[str, Any], world_size: int,
                         prompts_per_step: Optional[int] = None) -> dict[str, Any]:
    """A prompt-source state saved at another world size: the shards differ, so the sampler
    restarts at the next epoch (every prompt seen again, in a new order); step and group-id
    offset carry over, so group ids stay unique. Same world size: returned unchanged. The
    warning says how the global batch moves (``prompts_per_step``: per sampling rank)."""
    saved = state["sampler"].get("world_size", world_size)
    if saved == world_size:
        return state
    batch = "" if prompts_per_step is None else (
        f"; a step now draws {prompts_per_step * world_size} prompts, not "
        f"{prompts_per_step * saved} (trainer.prompts_per_step={prompts_per_step} per rank)")
    log.warning("resuming a world-size-%d run on %d ranks: the prompt sampler restarts at epoch %d%s",
                saved, world_size, state["sampler"]["epoch"] + 1, batch)
    sampler = {**state["sampler"], "world_size": world_size,
               "epoch": state["sampler"]["epoch"] + 1, "position": 0}
    return {**state, "sampler": sampler}


__all__ = ["Colocated", "JobEvents", "OP_STATE_KEY", "RankPlacement",
           "check_resumed_prompts", "finished_run", "merge_op_states", "rank_placement",
           "rescale_prompt_state", "run_job", "run_placement", "saved_op_state",
           "start_checkpoints"]
