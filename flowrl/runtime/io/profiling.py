"""``trainer.profile``: torch.profiler over chosen training steps, written to the run directory.

Why: a step's stage times (``time/<stage>`` in ``metrics.jsonl``) say *which* stage is slow, not
*why*. A profiled step names the operators and kernels: a Triton JIT compile, an allocator retry, a
host sync inside the micro-batch loop, an NCCL wait. ``trainer.profile.steps=[2,3]`` profiles steps
2 and 3 of the run on every rank (the way torchtitan's ``profiling`` section does it). Nothing
is recorded on the other steps. The Executor wraps every plan action in a
``torch.profiler.record_function`` range (``flowrl/<kind>/<name>``: ``flowrl/run/update``,
``flowrl/sync/rollout``, ...), and a checkpoint written inside the step is
``flowrl/checkpoint/save``, so the table gives each part's share of the step.

Written per profiled step and rank, under ``trainer.profile.dir`` (default ``<run dir>/profile``):

- ``step_NNNNNN/rank<R>.txt``: the step's wall seconds, the seconds of each ``flowrl/...``
  range (host wall time, children included), then the ``row_limit`` operators with the most self
  time (device time on CUDA, host time on CPU): ``torch.autograd.profiler_util`` key averages;
  on CUDA a second table of the same operators by host time (a host-bound step: launch
  overhead, Python in autograd functions);
- ``step_NNNNNN/rank<R>.trace.json.gz`` with ``trace=true``: the Chrome / Perfetto trace
  (``chrome://tracing``, https://ui.perfetto.dev), gzip-compressed.

Only this process is profiled: vLLM engine processes (``rollout.vllm.engine_procs`` > 0) show up
as the parent's wait for them.
"""
from __future__ import annotations

import contextlib
import gzip
import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

log = logging.getLogger("flowrl")

RANGE_PREFIX = "flowrl/"  # the Executor's record_function ranges: flowrl/<kind>/<name>
# only those (with_stack=true adds Python frames such as "flowrl/runtime/step/executor.py(345)")
_RANGE = re.compile(r"flowrl/(run|sync|offload|onload|checkpoint)/[^/()]+")


@dataclass
class ProfileConfig:
    """``trainer.profile``: which training steps torch.profiler records, and what is written.

    Attributes:
        steps: training steps to profile (1-based, as in ``metrics.jsonl``); empty = off.
        dir: where the files go; None = ``<run dir>/profile``.
        trace: also write the Chrome / Perfetto trace (``rank<R>.trace.json.gz``; a 0.5B GPU step
            is tens of MB before compression).
        record_shapes: record operator input shapes (the table then has one row per operator
            and input shapes).
        with_stack: record Python stacks (large traces; for "who called this kernel"). On CPU
            with torch 2.13, a step that also writes a checkpoint could not be read back with
            stacks (torch's parser raised UnicodeDecodeError): that step is then skipped with a
            warning.
        row_limit: operators listed in the text summary.
    """

    steps: list[int] = field(default_factory=list)
    dir: Optional[str] = None
    trace: bool = True
    record_shapes: bool = False
    with_stack: bool = False
    row_limit: int = 40

    def __post_init__(self) -> None:
        bad = [s for s in self.steps if not isinstance(s, int) or s < 1]
        if bad:
            raise ValueError(f"trainer.profile.steps takes training steps >= 1, got {bad}")
        if self.row_limit < 1:
            raise ValueError(f"trainer.profile.row_limit must be >= 1, got {self.row_limit}")


class StepProfiler:
    """Profiles the steps of ``cfg.steps``; every other step runs untouched.

    Args:
        cfg: the run's ``trainer.profile``.
        run_dir: the run directory (``dir`` None writes under ``run_dir / "profile"``).
        rank: this process's global rank (the file names).
        device: the trainer's device; CUDA adds device activity and a synchronize before the
            profiler stops, so the step's kernels are in the record.
    """

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: Any,
                 start: int = 1) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.root = (Path(cfg.dir) if cfg.dir else Path(run_dir) / "profile").resolve()
        self.steps = set(cfg.steps)
        done = sorted(s for s in self.steps if s < start)
        if done and rank == 0:  # a resumed run: those steps ran before the checkpoint
            log.warning("trainer.profile.steps %s were done before this run resumed at step %d: "
                        "they are not profiled", done, start)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run the body of training step ``step`` under the profiler when it is one of
        ``steps``; writes its files when the body returns (not when it raises: a failed step's
        partial record would mislead). A failure of the profiler itself is a warning: the run
        goes on without that step's files."""
        if step not in self.steps:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = getattr(self.device, "type", str(self.device)) == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities, record_shapes=self.cfg.record_shapes,
                       with_stack=self.cfg.with_stack)
        prof.__enter__()
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                prof.__exit__(None, None, None)
            raise
        if cuda:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        # reading the record back takes seconds (11-14 s after a SmolLM2 smoke step on 2 CPU
        # cores): said, so the pause after the step is not a silent one
        log.info("profile: step %d took %.2f s; reading the profiler's record", step, wall)
        try:
            prof.__exit__(None, None, None)
            self._write(prof, step, wall, cuda)
        except Exception as e:  # the profiler's own failure never stops the training run
            # seen: torch's kineto parser raising UnicodeDecodeError on a with_stack=true record
            # of a step that saved a checkpoint
            log.warning("profile: step %d could not be recorded (%s: %s); the run goes on "
                        "without it", step, type(e).__name__, str(e).splitlines()[0][:200])

    def _write(self, prof: Any, step: int, wall_s: float, cuda: bool) -> None:
        averages = prof.key_averages(group_by_input_shape=self.cfg.record_shapes)
        ranges = stage_seconds(averages)
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        lines = [f"step {step}, rank {self.rank}: wall {wall_s:.3f} s "
                 f"({'CUDA' if cuda else 'CPU'} profile; sorted by {sort})", "",
                 "flowrl ranges (host wall s, children included):"]
        lines += [f"  {name:<40} {s:9.3f}" for name, s in ranges.items()]
        lines += ["", averages.table(sort_by=sort, row_limit=self.cfg.row_limit)]
        if cuda:  # a host-bound step shows in the host's own time, which the table above hides
            lines += ["", "sorted by self_cpu_time_total (host time per operator):", "",
                      averages.table(sort_by="self_cpu_time_total", row_limit=self.cfg.row_limit)]
        out = self.root / f"step_{step:06d}"  # made once the record has been read
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{self.rank}.txt").write_text("\n".join(lines) + "\n")
        if self.cfg.trace:
            raw = out / f"rank{self.rank}.trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
        top = ", ".join(f"{n.removeprefix(RANGE_PREFIX)} {s:.2f} s" for n, s in
                        list(ranges.items())[:4])
        log.info("profile: step %d, rank %d (%.2f s; %s) written to %s", step, self.rank, wall_s,
                 top or "no ranges", out)


def stage_seconds(averages: Any) -> dict[str, float]:
    """Seconds of each ``flowrl/...`` range in ``averages`` (``prof.key_averages()``): host wall
    time with children (``cpu_time_total``, µs → s), the longest first."""
    found: dict[str, float] = {}
    for e in averages:  # grouped by shape, a range may come in several rows: summed
        if _RANGE.fullmatch(e.key):
            found[e.key] = found.get(e.key, 0.0) + e.cpu_time_total / 1e6
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


__all__ = ["ProfileConfig", "RANGE_PREFIX", "StepProfiler", "stage_seconds"]
