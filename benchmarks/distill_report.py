"""Report of the distillation measurement (issue 28): (a) on-policy distillation, (b) RL from the
same start (the teacher's own run) and (c) SFT on teacher samples, on held-out accuracy.

Reads finished (or cut-off) ``flowrl train`` run directories — each one's ``metrics.jsonl``
(per-step rows; step 0 = the greedy eval before; ``eval/*`` on the steps of
``trainer.eval.every`` and the last), and ``wall_s.txt`` when the device script wrote one — and
writes

- ``<stem>.md``: command, commit, machine, date; the teacher's level (its run's last held-out
  greedy accuracy) and the target, 90% of it; per arm: held-out accuracy before → last, the first
  eval step whose held-out accuracy reaches the target, the training seconds (sum of
  ``perf/step_s``) and the elapsed seconds (training + the evals on the way, ``eval/seconds``) up
  to that step; the held-out accuracy of every arm at every eval step; and, as a second view, the
  steps each arm needs until the rolling mean of its per-step accuracy on that step's fresh
  training prompts (``reward/accuracy`` on the student's own samples) reaches 90% of the teacher's;
- ``<stem>.png``: held-out accuracy per eval step, one line per arm, the target dashed (needs
  matplotlib; skipped with a note without it);
- ``<stem>_<arm>/``: each run's metrics.jsonl, summary.json and plan.txt, kept beside the report.

Run (what ``scripts/device/distill_run.sh`` does on the GPU):
    python benchmarks/distill_report.py --teacher RUN_RL --run a_distill=RUN_A --run c_sft=RUN_C \
        --run b_rl=RUN_RL --out-stem benchmarks/results/distill --command "..." --commit abc1234
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, git_revision, machine_info, markdown_table, utc_now  # noqa: E402

from flowrl.runtime.io.metrics import read_metrics  # noqa: E402

HELD_OUT = "eval/accuracy"
TRAIN_ACC = "reward/accuracy"
TARGET_FRACTION = 0.9
ARMS = {
    "a_distill": "(a) on-policy distillation",
    "b_rl": "(b) RL from the same start",
    "c_sft": "(c) SFT on teacher samples",
}


def held_out(run: Path) -> list[tuple[int, float, float, float]]:
    """(step, held-out greedy accuracy, training seconds, elapsed seconds) of every eval of
    ``run``: step 0 = before the first step; training seconds = Σ ``perf/step_s`` of the steps
    up to it, elapsed = that + Σ ``eval/seconds`` of the evals up to and including it."""
    rows, out, train_s, evals_s = read_metrics(run), [], 0.0, 0.0
    for step in sorted(rows):
        row = rows[step]
        train_s += float(row.get("perf/step_s", 0.0))
        if HELD_OUT in row:
            evals_s += float(row.get("eval/seconds", 0.0))
            out.append((step, float(row[HELD_OUT]), train_s, train_s + evals_s))
    return out


def first_reach(
    curve: list[tuple[int, float, float, float]], target: float
) -> Optional[tuple[int, float, float, float]]:
    """The first eval of ``curve`` whose accuracy is >= ``target``; None if none is."""
    return next((e for e in curve if e[1] >= target), None)


def per_step(run: Path, key: str = TRAIN_ACC) -> list[tuple[int, float]]:
    """(step, ``key``) of every training step (step >= 1) that logged it."""
    rows = read_metrics(run)
    return [(s, float(rows[s][key])) for s in sorted(rows) if s >= 1 and key in rows[s]]


def rolling(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    return [
        sum(values[max(0, i + 1 - window) : i + 1]) / len(values[max(0, i + 1 - window) : i + 1])
        for i in range(len(values))
    ]


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except ImportError:
        return ""


def _f(v: Optional[float], spec: str = "{:.3f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)


def _wall(run: Path) -> str:
    p = run / "wall_s.txt"
    return p.read_text().strip() if p.is_file() else "-"


def plot(
    curves: dict[str, list[tuple[int, float, float, float]]],
    target: float,
    teacher_level: float,
    png: Path,
) -> Optional[str]:
    """The held-out curves as a PNG; None, or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no matplotlib: no PNG"
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ax.plot([e[0] for e in c], [e[1] for e in c], marker="o", label=ARMS.get(name, name))
    ax.axhline(teacher_level, ls=":", c="black", label=f"teacher {teacher_level:.3f}")
    ax.axhline(target, ls="--", c="gray", label=f"90% of teacher {target:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return None


def report(
    teacher: Path, runs: dict[str, Path], stem: Path, window: int, command: str, commit: str
) -> str:
    """Write ``<stem>.md`` (+ ``.png``, the kept runs) and return the markdown.

    Raises:
        SystemExit: the teacher run has no held-out eval.
    """
    t_curve = held_out(teacher)
    if not t_curve:
        raise SystemExit(f"{teacher}: no {HELD_OUT} rows (was trainer.eval.limit 0?)")
    teacher_level = t_curve[-1][1]
    target = TARGET_FRACTION * teacher_level
    m = machine_info()
    lines = [
        "# On-policy distillation vs RL vs SFT on teacher samples (held-out accuracy)",
        "",
        f"- Command: `{command}`",
        f"- Date: {utc_now()} · commit {commit}",
        f"- Machine: {gpu_name()} {m.get('cpu', '')}".strip(),
        f"- Teacher: the RL run `{teacher}` (arm b) at its step {t_curve[-1][0]}: held-out "
        f"greedy accuracy {teacher_level:.3f}; target = {TARGET_FRACTION:.0%} of it = "
        f"{target:.3f}",
        "- Held-out: greedy accuracy on the task's test split (`eval/accuracy`), before the "
        "first step, every `trainer.eval.every` steps and after the last. Training s = Σ "
        "`perf/step_s` up to that step; elapsed s = that + the evals on the way.",
        "",
    ]
    curves = {name: held_out(run) for name, run in runs.items()}
    rows = []
    for name, c in curves.items():
        hit = first_reach(c, target)
        rows.append(
            [
                ARMS.get(name, name),
                _f(c[0][1] if c else None),
                f"{_f(c[-1][1] if c else None)} (step {c[-1][0] if c else '-'})",
                hit[0] if hit else "not reached",
                _f(hit[2] if hit else None, "{:.0f}"),
                _f(hit[3] if hit else None, "{:.0f}"),
                _wall(runs[name]),
            ]
        )
    lines += [
        f"## Steps and time to {TARGET_FRACTION:.0%} of the teacher ({target:.3f} held out)",
        "",
        markdown_table(
            [
                "arm",
                "before",
                "last",
                "first eval step >= target",
                "training s",
                "elapsed s",
                "run wall s (exit)",
            ],
            rows,
        ),
        "",
    ]
    steps = sorted({e[0] for c in curves.values() for e in c})
    by_step = {n: {e[0]: e[1] for e in c} for n, c in curves.items()}
    lines += [
        "## Held-out greedy accuracy per eval step",
        "",
        markdown_table(
            ["step", *(ARMS.get(n, n) for n in curves)],
            [[s, *(_f(by_step[n].get(s)) for n in curves)] for s in steps],
        ),
        "",
    ]
    t_train = per_step(teacher)
    if t_train:
        t_final = sum(a for _, a in t_train[-window:]) / len(t_train[-window:])
        rows = []
        for name, run in runs.items():
            c = per_step(run)
            smooth = rolling([a for _, a in c], window)
            hit = next((s for (s, _), r in zip(c, smooth) if r >= TARGET_FRACTION * t_final), None)
            rows.append(
                [
                    ARMS.get(name, name),
                    len(c),
                    _f(smooth[-1] if smooth else None),
                    hit if hit is not None else "not reached",
                ]
            )
        lines += [
            f"## Second view: `{TRAIN_ACC}` on each step's training prompts",
            "",
            f"The student's own samples at the rollout temperature (arm c too: its rollout "
            f"stage trains nothing), rolling mean over {window} steps; teacher's last "
            f"{window} steps {t_final:.3f}, target {TARGET_FRACTION * t_final:.3f}.",
            "",
            markdown_table(
                ["arm", "steps", f"last rolling {window}", "first step >= target"], rows
            ),
            "",
        ]
    png = stem.with_suffix(".png")
    why = plot(curves, target, teacher_level, png)
    lines.append(f"({why})" if why else f"![held-out accuracy per step]({png.name})")
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    for name, run in runs.items():  # keep the runs' metrics beside the report
        keep = stem.parent / f"{stem.name}_{name}"
        keep.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "summary.json", "plan.txt", "command.txt", "wall_s.txt"):
            if (run / f).is_file():
                (keep / f).write_bytes((run / f).read_bytes())
    (stem.parent / f"{stem.name}_meta.json").write_text(
        json.dumps(
            {
                "command": command,
                "commit": commit,
                "date": utc_now(),
                "machine": m,
                "teacher_level": teacher_level,
                "target": target,
            },
            indent=1,
        )
    )
    return text


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", type=Path, required=True, help="the teacher's RL run directory")
    ap.add_argument("--run", action="append", default=[], help="name=RUN_DIR (repeatable)")
    ap.add_argument("--out-stem", type=Path, default=REPO_ROOT / "benchmarks/results/distill")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--command", default="?")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    runs = dict(r.split("=", 1) for r in a.run) if a.run else {}
    if str(a.teacher) not in runs.values():
        runs.setdefault("b_rl", str(a.teacher))
    a.out_stem.parent.mkdir(parents=True, exist_ok=True)
    print(
        report(
            a.teacher,
            {k: Path(v) for k, v in runs.items()},
            a.out_stem,
            a.window,
            a.command,
            a.commit or git_revision(),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
