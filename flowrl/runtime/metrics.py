"""Per-step metrics to the console (rich), a JSONL file and TensorBoard (W&B/MLflow when asked)."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

log = logging.getLogger(__name__)

# what the one-line console summary shows, in this order
_CONSOLE_KEYS = [
    ("reward/mean", "reward", "{:.3f}"), ("reward/accuracy", "acc", "{:.3f}"),
    ("response/length_mean", "len", "{:.0f}"), ("response/truncated_frac", "trunc", "{:.2f}"),
    ("actor/pg_loss", "pg", "{:+.4f}"), ("actor/kl_loss", "kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.3f}"), ("actor/clipfrac", "clip", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"), ("rollout/logprob_mismatch", "Δlogp", "{:.1e}"),
    ("perf/step_s", "step_s", "{:.1f}"), ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    # intermediates held at most by the lifecycle manager vs keeping them all (device bytes on
    # a GPU run, where they live; all bytes on CPU)
    ("store/peak_bytes", "store", "{}"), ("eval/accuracy", "eval_acc", "{:.3f}"),
    ("eval/accuracy_math_verify", "eval_mv", "{:.3f}"), ("eval/format_frac", "eval_fmt", "{:.2f}"),
    ("eval/reward_mean", "eval_reward", "{:.3f}"), ("eval/response_length_mean", "eval_len", "{:.0f}"),
    ("eval/seconds", "eval_s", "{:.0f}"),
]


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


class MetricsLogger:
    """Args: out_dir: run dir (``metrics.jsonl`` and ``tb/`` go there); cfg: LoggerConfig;
    total_steps: for the progress bar; enabled: False on ranks other than 0."""

    def __init__(self, out_dir: str | Path, cfg, total_steps: int, *, enabled: bool = True,
                 run_config: Optional[dict] = None):
        self.cfg = cfg
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.console = Console(stderr=False)
        self._jsonl = self._tb = self._wandb = self._mlflow = None
        self._progress: Optional[Progress] = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            self._jsonl = open(self.out_dir / "metrics.jsonl", "a")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tb"))
        if cfg.wandb:
            import wandb  # optional dependency: fail loudly when asked for and missing

            self._wandb = wandb.init(project=cfg.project, config=run_config, dir=str(self.out_dir))
        if cfg.mlflow:
            import mlflow

            mlflow.set_experiment(cfg.project)
            self._mlflow = mlflow.start_run()
            if run_config:
                mlflow.log_params({k: str(v) for k, v in _flatten(run_config).items()})
        if cfg.progress:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}"), TextColumn("step {task.fields[step_s]}"),
                TimeRemainingColumn(), console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, reward="-", step_s="-")

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def set_progress(self, completed: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, **{k: (v if math.isfinite(v) else None)
                                                           for k, v in clean.items()}}) + "\n")
            self._jsonl.flush()
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
            parts = [f"{short}={_fmt(k, clean[k], spec, clean)}" for k, short, spec in _CONSOLE_KEYS if k in clean]
            if parts:
                self.console.print(f"[dim]step {step:>4}[/dim] " + " ".join(parts))
        if self._progress is not None and "perf/step_s" in clean:
            self._progress.update(self._task, advance=1,
                                  reward=f"{clean.get('reward/mean', float('nan')):.3f}",
                                  step_s=f"{clean['perf/step_s']:.1f}s")

    def print(self, msg: str) -> None:
        if self.enabled:
            self.console.print(msg)

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


def read_metrics(out_dir: Path) -> dict[int, dict[str, Any]]:
    """A run's ``metrics.jsonl`` as step → metrics, rows of one step merged (a step logs its
    training metrics, then e.g. ``perf/checkpoint_s``, then eval); ``{}`` when there is none."""
    rows: dict[int, dict[str, Any]] = {}
    path = Path(out_dir) / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return rows
