"""Report of arith learning runs (issue 25): held-out greedy accuracy before/after, its curve per
step, reward per step, and full fine-tuning beside LoRA (step time, peak device memory, weight-sync
bytes).

Reads finished (or cut-off) ``flowrl train`` run directories, each named (``full=DIR``,
``lora=DIR``): ``metrics.jsonl`` (step 0 = eval before; ``eval/*`` on the steps of
``trainer.eval.every`` and on the last step = eval after; training rows), ``summary.json``,
``.hydra/`` (config and overrides) and the device script's ``command.txt`` / ``wall_s.txt`` /
``commit.txt``, and writes

- ``<stem>.md``: per run the command, config, before/after table with a 95% interval, the
  held-out accuracy per eval step; then the runs side by side;
- ``<stem>.png``: train reward and held-out accuracy per step, one line per run (matplotlib);
- ``<stem>/<name>/``: the kept run files, so ``python benchmarks/arith_learning.py
  full=<stem>/full lora=<stem>/lora`` re-renders it.

Run: python benchmarks/arith_learning.py full=runs/arith_gpu
     python benchmarks/arith_learning.py full=/tmp/arith_runs/full lora=/tmp/arith_runs/lora \\
         --out-stem $OUT/learning_h200
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, command_line, markdown_table, versions  # noqa: E402
from gsm8k_learning import _delta_ci, _get, _machine, _read_config  # noqa: E402

from flowrl.runtime.io.metrics import read_metrics  # noqa: E402

DEFAULT_STEM = REPO_ROOT / "benchmarks/results/learning_h200"
KEPT = ("metrics.jsonl", "summary.json", "plan.txt", "console.log", "eval_before.jsonl",
        "eval_after.jsonl", "command.txt", "wall_s.txt", "commit.txt")


def load_run(path: Path) -> dict[str, Any]:
    """A run's rows and facts: ``steps`` (training rows), ``evals`` (step -> eval metrics, step 0
    = before), ``cfg``, ``overrides``, ``summary`` and the device script's text files."""
    cfg, overrides = _read_config(path)
    metrics = read_metrics(path)
    steps = [m | {"step": s} for s, m in sorted(metrics.items()) if s > 0 and "perf/step_s" in m]
    evals = {s: {k: v for k, v in m.items() if k.startswith("eval/")}
             for s, m in sorted(metrics.items()) if "eval/accuracy" in m}
    text = {n: (path / f"{n}.txt").read_text().strip() if (path / f"{n}.txt").is_file() else None
            for n in ("command", "wall_s", "commit")}
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    return {"path": path, "cfg": cfg, "overrides": overrides, "steps": steps, "evals": evals,
            "summary": summary, **text}


def _f(v: Any, spec: str) -> str:
    return spec.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def headline(run: dict[str, Any]) -> dict[str, float]:
    """Before / after held-out accuracy, their difference and its 95% half-width, the best eval,
    and the run's costs (mean step time, peak device memory, weight-sync bytes per step)."""
    evals = run["evals"]
    steps = run["steps"]
    b = evals.get(0, {})
    last = max(evals) if evals else 0
    a = evals.get(last, {}) if last > 0 else {}
    out = {"before": b.get("eval/accuracy", math.nan), "after": a.get("eval/accuracy", math.nan),
           "n_before": b.get("eval/n", math.nan), "n_after": a.get("eval/n", math.nan),
           "after_step": float(last), "steps": float(len(steps)),
           "step_s": _mean(steps, "perf/step_s"),
           "peak_device_gib": max((r["perf/peak_device_gib"] for r in steps
                                   if r.get("perf/peak_device_gib") is not None), default=math.nan),
           "sync_bytes": _mean(steps, "perf/weight_sync_bytes"),
           "reward_first": _mean(steps[:10], "reward/mean"), "reward_last": _mean(steps[-10:], "reward/mean")}
    out["delta"] = out["after"] - out["before"]
    out["delta_ci"] = (_delta_ci(out["before"], out["after"], out["n_before"], out["n_after"])
                       if a and b else math.nan)
    out["best"] = max((e["eval/accuracy"] for e in evals.values()), default=math.nan)
    return out


def plot(runs: dict[str, dict[str, Any]], path: Path) -> Optional[str]:
    """Train reward and held-out accuracy per step, a line per run; why no PNG, or None."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, run in runs.items():
        steps = run["steps"]
        line, = ax.plot([r["step"] for r in steps], [r.get("reward/mean", math.nan) for r in steps],
                        lw=1.2, label=f"{name}: train reward (T>0 samples)")
        ev = sorted(run["evals"].items())
        ax2.plot([s for s, _ in ev], [e["eval/accuracy"] for _, e in ev], marker="o",
                 color=line.get_color(), label=f"{name}: held-out greedy accuracy")
    ax.set(xlabel="step", ylabel="mean reward", title="arith: train reward per step", ylim=(0, 1))
    ax2.set(xlabel="step", ylabel="accuracy", title="arith: held-out greedy accuracy", ylim=(0, 1))
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _config_line(cfg: dict) -> str:
    lora = _get(cfg, "model.lora", None)
    return (f"graph `{_get(cfg, 'graph.path')}`, data `{_get(cfg, 'data.name')}` "
            f"({_get(cfg, 'data.arith.digits')}-digit x {_get(cfg, 'data.arith.num_operands')} "
            f"operands over `{_get(cfg, 'data.arith.ops')}`, {_get(cfg, 'data.arith.test_size')} "
            f"held-out items), model `{_get(cfg, 'model.path')}`"
            f"{' (tiny random: numbers meaningless)' if _get(cfg, 'model.tiny', None) else ''}"
            f"{f', LoRA {lora}' if lora else ', full fine-tuning'}, rollout `{_get(cfg, 'rollout.backend')}`, "
            f"{_get(cfg, 'trainer.total_steps')} steps x {_get(cfg, 'trainer.prompts_per_step')} prompts x "
            f"{_get(cfg, 'algorithm.n')} samples, T = {_get(cfg, 'rollout.sampling.temperature')}, "
            f"<= {_get(cfg, 'rollout.sampling.max_new_tokens')} new tokens, lr {_get(cfg, 'trainer.engine.lr')}, "
            f"kl_coef {_get(cfg, 'algorithm.kl_coef')}; eval every {_get(cfg, 'trainer.eval.every')} steps, "
            f"limit {_get(cfg, 'trainer.eval.limit')}")


def render(runs: dict[str, dict[str, Any]], stem: Path, png_note: Optional[str]) -> str:
    """The markdown report of ``runs`` (name -> :func:`load_run`)."""
    heads = {name: headline(run) for name, run in runs.items()}
    side = [[name, _f(h["before"], "{:.3f}"), _f(h["after"], "{:.3f}"),
             f"{_f(100 * h['delta'], '{:+.1f}')} ± {_f(100 * h['delta_ci'], '{:.1f}')}",
             _f(h["best"], "{:.3f}"), f"{h['steps']:.0f}", _f(h["reward_first"], "{:.3f}"),
             _f(h["reward_last"], "{:.3f}"), _f(h["step_s"], "{:.2f}"),
             _f(h["peak_device_gib"], "{:.1f}"), _f(h["sync_bytes"] / 2**20, "{:.0f}"),
             runs[name]["wall_s"] or "-"] for name, h in heads.items()]
    side_headers = ["run", "held-out acc. before", "after", "Δ pts (95%)", "best eval", "steps",
                    "reward, first 10 steps", "last 10", "step s", "peak device GiB",
                    "weight sync MiB/step", "wall s (exit)"]
    parts = []
    for name, run in runs.items():
        curve = [[s, _f(e.get("eval/accuracy"), "{:.3f}"), _f(e.get("eval/format_frac"), "{:.2f}"),
                  _f(e.get("eval/response_length_mean"), "{:.0f}"), _f(e.get("eval/truncated_frac"), "{:.2f}"),
                  _f(e.get("eval/n"), "{:.0f}")] for s, e in sorted(run["evals"].items())]
        cmd = run["command"] or ("python -m flowrl.train " + " ".join(run["overrides"]))
        parts.append(f"""## `{name}`

- Command: `{cmd}`
- Commit: {run['commit'] or '?'}
- Config (composed): {_config_line(run['cfg'])}

{markdown_table(['step', 'held-out accuracy', '#### share', 'answer tokens', 'truncated', 'items'], curve)}
""")
    goal = [f"`{n}`: {_f(100 * h['delta'], '{:+.1f}')} points ({'meets' if h['delta'] >= 0.2 else 'misses'} "
            "the issue's +20)" for n, h in heads.items() if math.isfinite(h["delta"])]
    png = f"![reward and held-out accuracy per step]({stem.name}.png)" if png_note is None else f"(no PNG: {png_note})"
    v = versions(["torch", "transformers", "vllm", "peft"])
    return f"""# Learning on the H200: GRPO on `arith` with SmolLM2-135M-Instruct, full fine-tuning and LoRA

- Report: `{command_line()}`
- Machine: {_machine()}
- Versions: {', '.join(f'{k} {x}' for k, x in v.items())}
- Task: `data=arith` (`flowrl/data/arith.py`), scored exactly by the graph's `reward.rule gsm8k`
  verifier (the number after the last `####`, else the last number of the answer, equals the sum;
  no format bonus). Held-out accuracy: greedy, on the fixed `test` split, never trained on.
  Baseline of the task: `benchmarks/results/task_baseline_cpu.md`. Run files: `{stem.name}/`.

{markdown_table(side_headers, side)}

Goal: {'; '.join(goal) if goal else 'no finished before/after pair'}.

{png}

{chr(10).join(parts)}"""


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR (a flowrl run dir or a kept <stem>/NAME)")
    ap.add_argument("--out-stem", type=Path, default=DEFAULT_STEM,
                    help="writes <stem>.md, <stem>.png and <stem>/NAME/ (default: %(default)s)")
    args = ap.parse_args(argv)
    stem = args.out_stem.resolve()
    runs: dict[str, dict[str, Any]] = {}
    for spec in args.runs:
        name, _, folder = spec.partition("=")
        path = Path(folder).resolve()
        if not name or not (path / "metrics.jsonl").is_file():
            print(f"{spec}: expected NAME=RUN_DIR with a metrics.jsonl")
            return 2
        keep = stem / name
        if keep != path:  # keep the run's record beside the report (re-rendering reads it back)
            keep.mkdir(parents=True, exist_ok=True)
            for f in KEPT:
                if (path / f).is_file():
                    shutil.copy2(path / f, keep / f)
            for f in ("config.yaml", "overrides.yaml"):
                for d in (path / ".hydra", path):
                    if (d / f).is_file():
                        shutil.copy2(d / f, keep / f)
                        break
        runs[name] = load_run(keep)
    png_note = plot(runs, stem.with_suffix(".png"))
    md = render(runs, stem, png_note)
    stem.with_suffix(".md").write_text(md)
    print(md.split("\n## ")[0])
    print(f"wrote {stem.with_suffix('.md')}" + ("" if png_note else f" and {stem.with_suffix('.png')}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
