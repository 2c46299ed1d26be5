"""Per-step metrics to the console (rich), a JSONL file and TensorBoard (W&B/MLflow when asked)."""
from __future__ import annotations

import io
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)

# what the one-line console summary shows, in this order
_CONSOLE_KEYS = [
    ("reward/mean", "reward", "{:.3f}"), ("reward/accuracy", "acc", "{:.3f}"),
    ("response/length_mean", "len", "{:.0f}"), ("response/truncated_frac", "trunc", "{:.2f}"),
    ("actor/pg_loss", "pg", "{:+.4f}"), ("actor/kl_loss", "kl", "{:.4f}"),
    ("actor/sft_loss", "sft", "{:.4f}"),  # graph=sft_teacher's update (its line had no loss)
    ("actor/entropy", "ent", "{:.3f}"), ("actor/clipfrac", "clip", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"), ("rollout/logprob_mismatch", "Δlogp", "{:.1e}"),
    ("perf/step_s", "step_s", "{:.1f}"),
    # a partitioned run: of the step, what the train pool waited for the rollout pool's batch
    ("perf/recv_wait_s/train", "wait", "{:.2f}"), ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    # intermediates held at most by the lifecycle manager vs keeping them all (device bytes on
    # a GPU run, where they live; all bytes on CPU)
    ("store/peak_bytes", "store", "{}"), ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("eval/accuracy_math_verify", "eval_mv", "{:.3f}"), ("eval/format_frac", "eval_fmt", "{:.2f}"),
    ("eval/reward_mean", "eval_reward", "{:.3f}"), ("eval/response_length_mean", "eval_len", "{:.0f}"),
    ("eval/seconds", "eval_s", "{:.0f}"),
    # run health (runtime/control/health.py), shown only when not 0 (_QUIET_ZERO)
    ("train/skipped_steps", "skipped", "{:.0f}"), ("train/unscorable_frac", "unscorable", "{:.2f}"),
    ("rollout/empty_response_frac", "empty", "{:.2f}"), ("reward/constant_steps", "const_reward", "{:.0f}"),
]
_QUIET_ZERO = {"train/skipped_steps", "train/unscorable_frac", "rollout/empty_response_frac",
               "reward/constant_steps"}


# stdout in a file: an evaluation prints its progress at most this often (seconds)
_LINE_EVERY_S = 30.0


def human_bytes(n: float) -> str:
    """``1536`` → ``1.5KiB``: bytes in the largest binary unit that keeps the number >= 1."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


def _fmt(key: str, value: float, spec: str, row: dict | None = None) -> str:
    if key == "store/peak_bytes" and math.isfinite(value):
        row = row or {}
        dev = row.get("store/peak_device_bytes", 0.0)
        if dev:  # a GPU run: the store lives in device memory
            return f"{human_bytes(dev)}/{human_bytes(row.get('store/keep_all_device_bytes', dev))}dev"
        return f"{human_bytes(value)}/{human_bytes(row.get('store/keep_all_bytes', value))}"
    return spec.format(value) if math.isfinite(value) else str(value)


def _after_the_newest_event_file(tb: Path) -> None:
    """Wait, if needed, until the clock's second is past every event file's in ``tb``.

    TensorBoard reads a directory's event files in name order, and the purge of redone steps
    only works when the new file comes last. The name is ``events.out.tfevents.<second>.<host>.
    <pid>.<n>`` with ``n`` a per-process counter that is not zero-padded: two writers of one
    process in the same second sort 9 after 10 (seen in the test suite), and the new file's
    events were then read first and hidden by the old one's. A later second sorts first, so at
    most one second is waited, and only for a writer that purges."""
    newest = 0
    for f in tb.glob("events.out.tfevents.*"):
        part = f.name.split(".")[3]
        if part.isdigit():
            newest = max(newest, int(part))
    while int(time.time()) <= newest:
        time.sleep(0.05)


def to_log_files(msg: str, name: str = "flowrl", **extra: Any) -> None:
    """``msg`` (rich markup) as a plain INFO line into the root logger's file handlers only
    (``train.log``: Hydra's file handler; the console printed it already), so the run's log
    holds what its console said: the step lines, checkpoints and evals (it stopped at
    "step 1 done"). ``extra``: the record's extra attributes."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return
    from rich.text import Text

    record = logging.getLogger(name).makeRecord(name, logging.INFO, __file__, 0,
                                                Text.from_markup(msg).plain, (), None, extra=extra)
    for h in files:
        if record.levelno >= h.level:
            h.handle(record)


class MetricsLogger:
    """Per-step metrics: console lines, a progress display, ``metrics.jsonl``, TensorBoard, W&B
    and MLflow.

    ``metrics.jsonl`` holds exactly one row per step: metrics logged again for the step of the
    last row (checkpoint time, the eval after the last step) are merged into that row in place.
    A run that starts at ``first_step`` > 1 (a resume) first drops the rows of steps
    >= ``first_step`` that the interrupted run logged after its checkpoint; a run from step 1
    starts the file empty. TensorBoard hides those steps' events the same way (``purge_step``).

    Args: out_dir: run dir (``metrics.jsonl`` and ``tb/`` go there); cfg: LoggerConfig;
    total_steps: for the progress display; enabled: False on ranks other than 0; run_config: the
    config for W&B/MLflow; first_step: the first step this run trains.
    """

    def __init__(self, out_dir: str | Path, cfg, total_steps: int, *, enabled: bool = True,
                 run_config: Optional[dict] = None, first_step: int = 1):
        self.cfg = cfg
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.total_steps = total_steps
        # soft wrap: a line is never cut at the console width (80 columns when stdout is a file)
        self.console = Console(stderr=False, soft_wrap=True)
        self._jsonl: Optional[io.BufferedRandom] = None
        self._tb: Optional[SummaryWriter] = None
        self._wandb: Any = None  # a wandb run (wandb ships no types)
        self._mlflow: Any = None  # an mlflow ActiveRun (mlflow ships no types)
        self._last: Optional[tuple[int, dict, int]] = None  # (step, row, file offset) of the last row
        self._progress: Optional[Progress] = None
        self._task: Optional[TaskID] = None
        self._train_t0: Optional[float] = None
        self._train_first = 0  # steps already done when this run's training began
        # stdout in a file: rich draws a progress bar only when it stops (the ETA came at the
        # very end), so a file gets the same progress as plain lines, printed as they happen
        self._lines = False
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            self._jsonl = _open_jsonl(self.out_dir / "metrics.jsonl", first_step)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = self.out_dir / "tb"
            # events an interrupted run wrote for the steps this one redoes are hidden
            purge = (first_step if first_step > 1 else 0) if tb.is_dir() and any(tb.iterdir()) else None
            if purge is not None:
                _after_the_newest_event_file(tb)
            self._tb = SummaryWriter(str(tb), purge_step=purge)
        if cfg.wandb:
            import wandb  # optional dependency: fail loudly when asked for and missing

            self._wandb = wandb.init(project=cfg.project, config=run_config, dir=str(self.out_dir))
        if cfg.mlflow:
            import mlflow

            mlflow.set_experiment(cfg.project)
            self._mlflow = mlflow.start_run()
            if run_config:
                mlflow.log_params({k: str(v) for k, v in _flatten(run_config).items()})
        if cfg.progress and not self.console.is_terminal:
            self._lines = True
        elif cfg.progress:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                console=self.console, transient=False)

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def set_progress(self, completed: int) -> None:
        """Training begins with ``completed`` steps already done (a resume): the train bar shows
        from here on (not during the eval before), and the ETA counts from now."""
        self._train_t0, self._train_first = time.perf_counter(), completed
        if self._progress is not None:
            if self._task is None:
                self._task = self._progress.add_task("train", total=self.total_steps, info="")
            self._progress.update(self._task, completed=completed)

    def eval_progress(self, label: str) -> Callable[[int, int], None]:
        """A callback ``(answers done, answers in total)`` that shows an evaluation as its own
        progress line (``label``: "eval before"); removed when the last answer is scored."""
        task = None
        t0 = time.perf_counter()

        last = [-math.inf]  # when the last plain progress line was printed (stdout in a file)

        def update(done: int, total: int) -> None:
            nonlocal task
            if self._lines and (done in (0, total) or time.perf_counter() - last[0] >= _LINE_EVERY_S):
                last[0] = time.perf_counter()
                self.console.print(f"{label} {done}/{total} " + (
                    "greedy decoding" if done == 0 else
                    f"done in {last[0] - t0:.0f} s" if done >= total else
                    f"eta {_clock(_eta(t0, done, total))}"))
            if self._progress is None:
                return
            if task is None:
                task = self._progress.add_task(label, total=total, info="greedy decoding")
            self._progress.update(task, completed=done, info=(
                "greedy decoding" if done == 0 else f"eta {_clock(_eta(t0, done, total))}"))
            if done >= total:
                self._progress.remove_task(task)

        return update

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write ``metrics`` of ``step`` everywhere (nothing for an empty dict); a step equal to
        the last row's is merged into that row."""
        if not self.enabled or not metrics:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        if self._jsonl:
            self._write_row(self._jsonl, step, {k: (v if math.isfinite(v) else None) for k, v in clean.items()})
        if self._tb:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb:
            self._wandb.log(clean, step=step)
        if self._mlflow:
            import mlflow

            mlflow.log_metrics({k.replace("/", "."): v for k, v in clean.items() if math.isfinite(v)}, step=step)
        if self.cfg.console:
            parts = [f"{short}={_fmt(k, clean[k], spec, clean)}" for k, short, spec in _CONSOLE_KEYS
                     if k in clean and not (k in _QUIET_ZERO and clean[k] == 0)]
            if parts:
                line = f"[dim]step {step:>4}[/dim] " + " ".join(parts)
                self.console.print(line)
                to_log_files(line)
        if "perf/step_s" in clean and self._train_t0 is not None:
            done = step - self._train_first
            eta = _eta(self._train_t0, done, self.total_steps - self._train_first)
            info = (f"reward {clean.get('reward/mean', float('nan')):.3f}  "
                    f"step {clean['perf/step_s']:.1f}s  eta {_clock(eta)}")
            if self._progress is not None and self._task is not None:
                self._progress.update(self._task, completed=step, info=info)
            elif self._lines:
                self.console.print(f"train {step}/{self.total_steps}  {info}")

    def _write_row(self, f: io.BufferedRandom, step: int, row: dict[str, Any]) -> None:
        if self._last is not None and self._last[0] == step:  # same step: rewrite the last row
            row = {**self._last[1], **row}
            offset = self._last[2]
            f.seek(offset)
            f.write(_row_bytes(step, row))
            f.truncate()
        else:
            f.seek(0, os.SEEK_END)
            offset = f.tell()
            f.write(_row_bytes(step, row))
        f.flush()
        self._last = (step, row, offset)

    def print(self, msg: str) -> None:
        """A console line of the run (a checkpoint, an eval's result), in ``train.log`` too."""
        if self.enabled:
            self.console.print(msg)
            to_log_files(msg)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._tb:
            self._tb.close()
            self._tb = None
        if self._wandb:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow:
            import mlflow

            mlflow.end_run()
            self._mlflow = None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _row_bytes(step: int, row: dict[str, Any]) -> bytes:
    return (json.dumps({"step": step, **{k: v for k, v in row.items() if k != "step"}}) + "\n").encode()


def _rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; a last line cut short by a killed process is left out."""
    rows = []
    lines = path.read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1 and any(x.strip() for x in lines[i + 1:]):
                raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
            log.warning("%s: dropped a last line cut short (%d bytes)", path, len(line))
    return rows


def _open_jsonl(path: Path, first_step: int) -> io.BufferedRandom:
    """``metrics.jsonl`` opened for :class:`MetricsLogger`: rows of steps before ``first_step``
    kept (all dropped when ``first_step`` is 1: the eval at step 0 is redone too), one row per
    step (earlier files could hold several), rewritten atomically."""
    kept: dict[int, dict[str, Any]] = {}
    if first_step > 1 and path.is_file():
        for row in _rows(path):
            if row["step"] < first_step:
                kept.setdefault(row["step"], {}).update(row)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(_row_bytes(s, kept[s]) for s in sorted(kept)))
    os.replace(tmp, path)
    return open(path, "r+b")


def _eta(t0: float, done: int, total: int) -> Optional[float]:
    """Seconds left at the mean pace since ``t0`` (None before the first item is done)."""
    if done <= 0:
        return None
    return (time.perf_counter() - t0) / done * max(total - done, 0)


def _clock(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def read_metrics(out_dir: Path) -> dict[int, dict[str, Any]]:
    """A run's ``metrics.jsonl`` as step → metrics (step 0: the eval before training); rows of
    one step are merged (files of older versions held several per step); ``{}`` when there is
    none."""
    rows: dict[int, dict[str, Any]] = {}
    path = Path(out_dir) / "metrics.jsonl"
    if path.is_file():
        for row in _rows(path):
            rows.setdefault(row["step"], {}).update(row)
    return rows
