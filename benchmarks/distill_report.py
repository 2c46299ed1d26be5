"""Report of the distillation measurement: on-policy distillation vs RL from the same start.

Reads finished (or cut-off) ``flowrl train`` run directories — each one's ``metrics.jsonl``
(per-step rows; step 0 = the greedy eval before) and ``summary.json`` — and writes

- ``<stem>.md``: command, commit, machine, date; per run: greedy eval accuracy before/after
  (strict ``#### n``, math-verify, ``#### n`` format share), and the steps and wall time (sum of
  ``perf/step_s``) each run needs until the rolling mean (``--window`` steps) of its per-step
  accuracy on that step's fresh training prompts (``reward/accuracy``, sampled at the rollout
  temperature) first reaches 90% of the teacher's (the mean of the teacher run's last
  ``--window`` steps); the per-step table;
- ``<stem>.png``: per-step accuracy curves (needs matplotlib; skipped with a note without it).

Run (what ``scripts/device/distill_run.sh`` does on the GPU):
    python benchmarks/distill_report.py --teacher RUN_RL --run distill=RUN_DISTILL \
        [--run rl=RUN_RL] --out-stem benchmarks/results/distill --command "..." --commit abc1234
The teacher run is GRPO from the student's starting point, so it is also curve (b), "RL from the
same start". (c), SFT on teacher samples, is not measured: flowrl has no SFT graph yet.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, git_revision, machine_info, markdown_table, utc_now  # noqa: E402

from flowrl.runtime.metrics import read_metrics  # noqa: E402

ACC = "reward/accuracy"
# the per-step quantities compared: accuracy, and the reward (accuracy + format_score for a
# well-formed wrong answer: both graphs' reward stage gives 0.1), which shows format learning
METRICS = (ACC, "reward/mean")
EVAL = [("strict accuracy", "eval/accuracy_strict"), ("math-verify accuracy", "eval/accuracy_math_verify"),
        ("`#### n` format share", "eval/format_frac")]


def curve(run: Path, key: str = ACC) -> list[tuple[int, float, float]]:
    """(step, ``key`` on that step's training prompts, wall seconds up to and including it)."""
    rows, out, wall = read_metrics(run), [], 0.0
    for step in sorted(s for s in rows if s >= 1):
        row = rows[step]
        wall += float(row.get("perf/step_s", 0.0))
        if key in row:
            out.append((step, float(row[key]), wall))
    return out


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except ImportError:
        return ""


def rolling(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def first_reach(c: list[tuple[int, float, float]], target: float,
                window: int) -> Optional[tuple[int, float]]:
    """(step, wall seconds) where the rolling mean first reaches ``target``; None if never."""
    for (step, _, wall), r in zip(c, rolling([a for _, a, _ in c], window)):
        if r >= target:
            return step, wall
    return None


def evals(run: Path) -> tuple[dict, dict]:
    """(greedy eval before, after): step 0's and the last step's ``eval/*`` keys."""
    rows = read_metrics(run)
    before = {k: v for k, v in rows.get(0, {}).items() if k.startswith("eval/")}
    last = max(rows) if rows else 0
    after = {k: v for k, v in rows.get(last, {}).items() if k.startswith("eval/")} if last else {}
    return before, after


def report(teacher: Path, runs: dict[str, Path], stem: Path, window: int, command: str,
           commit: str) -> str:
    m = machine_info()
    lines = ["# On-policy distillation vs RL from the same start", "",
             f"- Command: `{command}`", f"- Date: {utc_now()} · commit {commit}",
             f"- Machine: {gpu_name()} {m.get('cpu', '')}".strip(),
             f"- Teacher: the RL run `{teacher}` (also curve `rl`, RL from the student's start); "
             f"its level of a quantity = the mean of its last {window} steps; target = 90% of it",
             f"- Per step: `{ACC}` and `reward/mean` on each step's fresh training prompts (sampled "
             f"at the rollout temperature), rolling mean over {window} steps; wall = sum of "
             "`perf/step_s`. Greedy eval: before the first step and after the last.",
             "- (c) SFT on teacher samples: not measured (flowrl has no SFT graph).", ""]
    for key in METRICS:
        tc = curve(teacher, key)
        if not tc:
            raise SystemExit(f"{teacher}: no per-step {key} rows")
        t_final = sum(a for _, a, _ in tc[-window:]) / len(tc[-window:])
        target = 0.9 * t_final
        lines += [f"## Steps and wall time to 90% of the teacher's `{key}` "
                  f"({t_final:.3f} → target {target:.3f})", ""]
        rows = []
        for name, run in runs.items():
            c = curve(run, key)
            hit = first_reach(c, target, window)
            rows.append([name, len(c), f"{hit[0]}" if hit else "not reached",
                         f"{hit[1]:.0f}" if hit else "-"])
        lines += [markdown_table(["run", "steps", "steps to 90%", "wall s to 90%"], rows), ""]
    lines += ["## Greedy eval (test split)", ""]
    rows = []
    for name, run in runs.items():
        before, after = evals(run)
        rows.append([name, *(f"{before.get(k, float('nan')):.3f} → {after.get(k, float('nan')):.3f}"
                             for _, k in EVAL)])
    lines.append(markdown_table(["run", *(f"{label} before → after" for label, _ in EVAL)], rows))
    t_acc = curve(teacher)
    target = 0.9 * sum(a for _, a, _ in t_acc[-window:]) / len(t_acc[-window:])
    lines += ["", "## Per-step accuracy (rolling mean)", ""]
    curves = {name: curve(run) for name, run in runs.items()}
    steps = sorted({s for c in curves.values() for s, _, _ in c})
    smooth = {n: dict(zip([s for s, _, _ in c], rolling([a for _, a, _ in c], window)))
              for n, c in curves.items()}
    lines.append(markdown_table(["step", *curves],
                                [[s, *(f"{smooth[n][s]:.3f}" if s in smooth[n] else "" for n in curves)]
                                 for s in steps]))
    png = stem.with_suffix(".png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for n, c in curves.items():
            ax.plot([s for s, _, _ in c], rolling([a for _, a, _ in c], window), label=n)
        ax.axhline(target, ls="--", c="gray", label="90% of teacher")
        ax.set_xlabel("step")
        ax.set_ylabel(f"{ACC} (rolling {window})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        lines += ["", f"![accuracy per step]({png.name})"]
    except ImportError:
        lines += ["", "(no matplotlib: no PNG)"]
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    for name, run in runs.items():  # keep the runs' metrics beside the report
        keep = stem.parent / f"{stem.name}_{name}"
        keep.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "summary.json", "plan.txt"):
            if (run / f).is_file():
                (keep / f).write_bytes((run / f).read_bytes())
    (stem.parent / f"{stem.name}_meta.json").write_text(json.dumps(
        {"command": command, "commit": commit, "date": utc_now(), "machine": m}, indent=1))
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
    runs.setdefault("rl", str(a.teacher))
    a.out_stem.parent.mkdir(parents=True, exist_ok=True)
    print(report(a.teacher, {k: Path(v) for k, v in runs.items()}, a.out_stem, a.window,
                 a.command, a.commit or git_revision()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
