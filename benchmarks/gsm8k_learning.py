"""Report of a GSM8K learning run: eval before/after (strict, math-verify, format), curves, reading.

Reads a finished (or cut-off) ``flowrl train`` run directory — ``metrics.jsonl`` (per-step rows,
step 0 = eval before), ``summary.json`` (``eval_before`` / ``eval_after``), ``.hydra/`` (the
composed config and the command-line overrides) — and writes

- ``<stem>.md``: command, commit, machine, date, config, greedy accuracy on the eval split before
  and after (strict ``#### n``, math-verify, share of answers with a ``#### n`` line), the split of
  the strict gain into format learning vs accuracy, and the per-step reward/accuracy table;
- ``<stem>.png``: reward and accuracy curves (needs matplotlib; skipped with a note without it);
- ``<stem>/``: the run's ``metrics.jsonl``, ``summary.json``, config and ``meta.json`` (command,
  commit, machine, date), so the report can be re-rendered from it later with the same facts.

Run: python benchmarks/gsm8k_learning.py runs/gsm8k_gpu
     python benchmarks/gsm8k_learning.py RUN_DIR --out-stem $OUT/gsm8k_smollm2_gpu --commit abc1234 \
         --command "python -m flowrl.train trainer=gsm8k_gpu rollout=vllm ..."
     python benchmarks/gsm8k_learning.py benchmarks/results/gsm8k_smollm2_gpu   (re-render)
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO_ROOT,
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    text_table,
    versions,
)

from flowrl.runtime.io.metrics import read_metrics  # noqa: E402

DEFAULT_STEM = REPO_ROOT / "benchmarks/results/gsm8k_smollm2_gpu"
KEPT = ("metrics.jsonl", "summary.json", "plan.txt", "console.log", "eval_before.jsonl",
        "eval_after.jsonl")
# (label, eval key) rows of the before/after table; every value is a fraction of eval/n answers
EVAL_ROWS = [
    ("strict accuracy (`#### n` right)", "eval/accuracy_strict"),
    ("math-verify accuracy (any format)", "eval/accuracy_math_verify"),
    ("answers with a `#### n` line", "eval/format_frac"),
    ("right under math-verify, no `#### n` line", "eval/math_verify_unformatted_frac"),
    ("truncated (hit max_new_tokens)", "eval/truncated_frac"),
]


# ----------------------------------------------------------------------------- reading the run
def _read_config(run: Path) -> tuple[dict, list[str]]:
    """The composed config and the overrides (Hydra's ``.hydra/`` or a kept copy); {} / []."""
    import yaml

    for d in (run / ".hydra", run):
        if (d / "config.yaml").is_file():
            over = d / "overrides.yaml"
            return (yaml.safe_load((d / "config.yaml").read_text()) or {},
                    yaml.safe_load(over.read_text()) or [] if over.is_file() else [])
    return {}, []


def _get(d: dict, dotted: str, default: Any = "?") -> Any:
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _machine() -> str:
    m = machine_info()
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            gpu = f"{n} x {torch.cuda.get_device_name(0)}, "
    except ImportError:
        pass
    return f"{gpu}{m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}, {m['os']}, Python {m['python']}"


def _meta(run: Path, args, overrides: list[str]) -> dict[str, str]:
    """Command, commit, machine, date, versions: flags, else the run's kept ``meta.json``, else
    what this process sees (the date: when ``metrics.jsonl`` was last written)."""
    kept = json.loads((run / "meta.json").read_text()) if (run / "meta.json").is_file() else {}
    metrics = run / "metrics.jsonl"
    date = (dt.datetime.fromtimestamp(metrics.stat().st_mtime, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            if metrics.is_file() else "?")
    v = versions(["torch", "transformers", "vllm", "math-verify"])
    if v["vllm"] == "not installed":  # an unpacked vLLM (the device's /tmp/vsite) may lack metadata
        import importlib.util

        if importlib.util.find_spec("vllm") is not None:
            import vllm

            v["vllm"] = getattr(vllm, "__version__", "?")
    seen = {"command": "python -m flowrl.train " + " ".join(overrides) if overrides else "?",
            "commit": git_revision(), "machine": _machine(), "date": date,
            "versions": ", ".join(f"{k} {x}" for k, x in v.items())}
    flags = {k: getattr(args, k) for k in ("command", "commit", "machine", "date", "wall_s")
             if getattr(args, k)}
    return {**seen, **kept, **flags}


# ----------------------------------------------------------------------------- numbers
def _se(p: float, n: float) -> float:
    """Binomial standard error of a fraction p over n answers."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def _delta_ci(b: float, a: float, n_b: float, n_a: float) -> float:
    """Half-width of a 95% interval of a - b, the two evals treated as independent samples (the
    same questions make the real interval narrower: this one is conservative)."""
    return 1.96 * math.sqrt(_se(b, n_b) ** 2 + _se(a, n_a) ** 2)


def decompose(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Split the strict-accuracy gain into format and accuracy-of-formatted-answers parts.

    strict = F · P, with F the share of answers carrying a ``#### n`` line and P the strict
    accuracy among them. Then (exactly) Δstrict = ΔF · P_before + F_after · ΔP: the first term is
    the gain from answering in the format at the old accuracy, the second the gain in accuracy of
    formatted answers. math-verify's change (format-free) is the arithmetic signal to hold it to.
    """
    F0, F1 = before["eval/format_frac"], after["eval/format_frac"]
    s0, s1 = before["eval/accuracy_strict"], after["eval/accuracy_strict"]
    P0 = s0 / F0 if F0 else 0.0
    P1 = s1 / F1 if F1 else 0.0
    n0, n1 = before["eval/n"], after["eval/n"]
    mv0, mv1 = before["eval/accuracy_math_verify"], after["eval/accuracy_math_verify"]
    return {"d_strict": s1 - s0, "d_strict_ci": _delta_ci(s0, s1, n0, n1),
            "format_part": (F1 - F0) * P0, "accuracy_part": F1 * (P1 - P0), "P0": P0, "P1": P1,
            "d_format": F1 - F0, "d_format_ci": _delta_ci(F0, F1, n0, n1),
            "d_mv": mv1 - mv0, "d_mv_ci": _delta_ci(mv0, mv1, n0, n1)}


def _pts(x: float) -> str:
    return f"{100 * x:+.1f} pts"


def reading(before: dict[str, float], after: dict[str, float]) -> list[str]:
    """The honest reading, as sentences computed from the two evals."""
    d = decompose(before, after)
    sig = lambda k: abs(d[k]) > d[k + "_ci"]  # noqa: E731
    lines = [
        f"- Strict accuracy moved {_pts(d['d_strict'])} (95% interval ±{100 * d['d_strict_ci']:.1f}): "
        f"{_pts(d['format_part'])} from answering in the `#### n` format more often (format share "
        f"{_pts(d['d_format'])}, at the old {100 * d['P0']:.1f}% accuracy of formatted answers) and "
        f"{_pts(d['accuracy_part'])} from formatted answers being right more often "
        f"({100 * d['P0']:.1f}% -> {100 * d['P1']:.1f}%).",
        f"- math-verify, which finds the final answer in any format, moved {_pts(d['d_mv'])} "
        f"(±{100 * d['d_mv_ci']:.1f}): this is the arithmetic signal.",
    ]
    if sig("d_strict") and not sig("d_mv"):
        verdict = ("The strict gain is format learning: the model now writes `#### n` for answers it "
                   "could already get right; its arithmetic did not measurably change.")
    elif sig("d_mv") and d["d_mv"] > 0:
        verdict = (f"Part of the gain is arithmetic: {_pts(d['d_mv'])} more answers are right in any "
                   f"format; the rest of the strict gain ({_pts(max(d['d_strict'] - d['d_mv'], 0.0))}) "
                   "is format.")
    elif sig("d_mv") and d["d_mv"] < 0:
        verdict = (f"Arithmetic got worse ({_pts(d['d_mv'])} under math-verify) while the strict "
                   f"score moved {_pts(d['d_strict'])}: the run traded correctness for format.")
    else:
        verdict = "Neither strict nor math-verify accuracy moved beyond noise."
    lines.append(f"- **Verdict:** {verdict}")
    lines.append("- Caveats: math-verify is lenient (an answer cut off mid-way is scored on its last "
                 "number), so it bounds \"right in some form\" from above; the accuracy among formatted "
                 "answers can also change because *which* answers get formatted changed.")
    return lines


# ----------------------------------------------------------------------------- plot
def plot(rows: list[dict], before: dict, after: dict, total: int, path: Path) -> Optional[str]:
    """Reward/accuracy curves and response length; returns why no PNG was written, or None."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for key, label in (("reward/mean", "train reward (mean)"),
                       ("reward/accuracy", "train accuracy (strict, T>0 samples)")):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=label, lw=1.4)
    for key, label, marker in (("eval/accuracy_strict", "eval strict", "o"),
                               ("eval/accuracy_math_verify", "eval math-verify", "s"),
                               ("eval/format_frac", "eval #### share", "^")):
        pts = [(s, e[key]) for s, e in ((0, before), (total, after)) if key in e]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="--", marker=marker, label=label)
    ax.set(xlabel="step", ylabel="fraction", title="GSM8K: reward and accuracy", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.plot(steps, [r.get("response/length_mean", float("nan")) for r in rows], color="tab:purple")
    ax2.set(xlabel="step", ylabel="tokens", title="mean response length")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------- report
def _f(v: Any, spec: str) -> str:
    return spec.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _limit(v: Any) -> str:
    return "null (the whole split)" if v is None else str(v)


def render(steps: list[dict], summary: dict, stem: Path, meta: dict[str, str], cfg: dict,
           png_note: Optional[str]) -> tuple[str, str]:
    """(markdown, terminal text) of the report; ``steps``: the training rows of metrics.jsonl."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    total = int(_get(cfg, "trainer.total_steps", len(steps)) or len(steps))
    done = len(steps)

    eval_rows = []
    for label, key in EVAL_ROWS:
        b, a = before.get(key), after.get(key)
        delta = a - b if b is not None and a is not None else None
        eval_rows.append([label, _f(b, "{:.3f}"), _f(a, "{:.3f}"), _f(delta, "{:+.3f}")])
    eval_rows.append(["answers scored (eval/n)", _f(before.get("eval/n"), "{:.0f}"),
                      _f(after.get("eval/n"), "{:.0f}"), ""])
    eval_rows.append(["mean answer length (tokens)", _f(before.get("eval/response_length_mean"), "{:.0f}"),
                      _f(after.get("eval/response_length_mean"), "{:.0f}"), ""])
    eval_rows.append(["eval seconds", _f(before.get("eval/seconds"), "{:.1f}"),
                      _f(after.get("eval/seconds"), "{:.1f}"), ""])
    eval_headers = ["greedy, eval split", "before", "after", "Δ"]

    have_both = all(k in e for e in (before, after) for _, k in EVAL_ROWS[:3]) and before and after
    read = reading(before, after) if have_both else [
        "- No before/after pair in summary.json (the run did not finish, or eval was off): "
        "no reading."]

    every = max(1, math.ceil(done / 25))  # at most ~25 rows in the table
    shown = [r for i, r in enumerate(steps) if i % every == 0 or i == done - 1]
    step_headers = ["step", "reward", "train acc", "resp. len", "truncated", "pg loss", "grad norm",
                    "Δlogp", "step s", "tok/s"]
    step_rows = [[r["step"], _f(r.get("reward/mean"), "{:.4f}"), _f(r.get("reward/accuracy"), "{:.3f}"),
                  _f(r.get("response/length_mean"), "{:.0f}"), _f(r.get("response/truncated_frac"), "{:.2f}"),
                  _f(r.get("actor/pg_loss"), "{:+.4f}"), _f(r.get("actor/grad_norm"), "{:.3f}"),
                  _f(r.get("rollout/logprob_mismatch"), "{:.1e}"), _f(r.get("perf/step_s"), "{:.2f}"),
                  _f(r.get("perf/tokens_per_s"), "{:.0f}")] for r in shown]
    if any("multi_turn/tool_calls_mean" in r for r in steps):  # graph=grpo_tools: the tool use
        step_headers += ["turns", "tool calls / traj", "tool errors / traj", "valid calls"]
        for row, r in zip(step_rows, shown):
            calls, errors = r.get("multi_turn/tool_calls_mean"), r.get("multi_turn/tool_errors_mean")
            valid = 1 - errors / calls if calls and errors is not None else None
            row += [_f(r.get("multi_turn/turns_mean"), "{:.2f}"), _f(calls, "{:.2f}"),
                    _f(errors, "{:.2f}"), _f(valid, "{:.2f}")]
    step_s = [r["perf/step_s"] for r in steps if r.get("perf/step_s") is not None]
    half = max(done // 2, 1)
    mean = lambda rs, k: (sum(r[k] for r in rs if r.get(k) is not None)  # noqa: E731
                          / max(1, sum(r.get(k) is not None for r in rs)))
    facts = [
        ["steps done / configured", f"{done} / {total}"],
        ["mean train reward, first / second half", f"{_f(mean(steps[:half], 'reward/mean'), '{:.4f}')} / "
                                                   f"{_f(mean(steps[half:], 'reward/mean'), '{:.4f}')}" if steps else "-"],
        ["mean train accuracy, first / second half", f"{_f(mean(steps[:half], 'reward/accuracy'), '{:.3f}')} / "
                                                     f"{_f(mean(steps[half:], 'reward/accuracy'), '{:.3f}')}" if steps else "-"],
        ["mean step time (s)", _f(sum(step_s) / len(step_s), "{:.2f}") if step_s else "-"],
        ["time in steps (s)", _f(sum(step_s), "{:.0f}") if step_s else "-"],
        ["model load and engine start (s)", _f(summary.get("model_load_s"), "{:.1f}")],
        ["whole `flowrl train` command, wall (s)", meta.get("wall_s", "-")],
        ["checkpoint", f"`{summary['checkpoint']}`" if summary.get("checkpoint") else "-"],
    ]
    config_line = (
        f"graph `{_get(cfg, 'graph.path')}`, model `{_get(cfg, 'model.path')}`"
        f"{' (tiny random: numbers meaningless)' if _get(cfg, 'model.tiny', None) else ''}, "
        f"rollout `{_get(cfg, 'rollout.backend')}`, {total} steps × {_get(cfg, 'trainer.prompts_per_step')} "
        f"prompts × {_get(cfg, 'algorithm.n')} samples, T = {_get(cfg, 'rollout.sampling.temperature')}, "
        f"≤ {_get(cfg, 'rollout.sampling.max_new_tokens')} new tokens; AdamW lr {_get(cfg, 'trainer.engine.lr')} "
        f"({_get(cfg, 'trainer.engine.lr_scheduler')}, warm-up {_get(cfg, 'trainer.engine.warmup_steps')}), "
        f"kl_coef {_get(cfg, 'algorithm.kl_coef')}; eval: greedy, split `{_get(cfg, 'trainer.eval.split')}`, "
        f"limit {_limit(_get(cfg, 'trainer.eval.limit'))}, ≤ {_get(cfg, 'trainer.eval.max_new_tokens')} tokens")
    png = (f"![reward and accuracy curves]({stem.name}.png)" if png_note is None
           else f"(no PNG: {png_note})")
    md = f"""# Learning run: `{_get(cfg, 'graph.path')}` on `data={_get(cfg, 'data.name')}` under `flowrl train`

- Command: `{meta['command']}`
- Report: `{command_line()}`
- Date: {meta['date']} · commit {meta['commit']}
- Machine: {meta['machine']}
- Versions: {meta['versions']}
- Config (composed): {config_line}
- Reward (graph `reward` stage; a graph file's `params.verifier` may replace the GSM8K rule,
  e.g. `math_verify`): 1 for a right answer (the number after the last `####`; since
  issue 25 also the last number of an answer without `####`, and no `format_score` unless the
  graph sets one), 0 otherwise. Eval: strict = the same rule (reward exactly 1); math-verify =
  `flowrl.rewards.math_verify_reward` (the final answer found in any format); `#### n` share = a
  parseable `#### <number>` line, right or wrong. Run files: `{stem.name}/` (`metrics.jsonl` kept).

## Greedy accuracy before and after

{markdown_table(eval_headers, eval_rows)}

## Format learning vs arithmetic

{chr(10).join(read)}

## Curves

{png}

{markdown_table(['quantity', 'value'], facts)}

## Per step (from metrics.jsonl{'' if every == 1 else f', every {every}th step and the last'})

{markdown_table(step_headers, step_rows)}
"""
    text = "\n\n".join([text_table(eval_headers, eval_rows), "\n".join(read),
                        text_table(["quantity", "value"], facts)])
    return md, text


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="flowrl train output dir (hydra.run.dir) or a kept <stem>/ dir")
    ap.add_argument("--out-stem", type=Path, default=DEFAULT_STEM,
                    help="writes <stem>.md, <stem>.png and <stem>/ (default: %(default)s)")
    ap.add_argument("--command", help="the command that ran the training (default: from .hydra/overrides.yaml)")
    ap.add_argument("--commit", help="flowrl commit of the run (default: git here)")
    ap.add_argument("--machine", help="machine of the run (default: this one)")
    ap.add_argument("--date", help="date of the run (default: metrics.jsonl's mtime)")
    ap.add_argument("--wall-s", help="wall-clock seconds of the whole flowrl train command")
    args = ap.parse_args(argv)
    run, stem = args.run_dir.resolve(), args.out_stem.resolve()
    if not (run / "metrics.jsonl").is_file():
        print(f"{run}: no metrics.jsonl (not a flowrl run directory)")
        return 2
    cfg, overrides = _read_config(run)
    meta = _meta(run, args, overrides)
    keep = stem
    if keep != run:  # copy the run's record next to the report (re-rendering reads it back)
        keep.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            if (run / name).is_file():
                shutil.copy2(run / name, keep / name)
        for name in ("config.yaml", "overrides.yaml"):
            for d in (run / ".hydra", run):
                if (d / name).is_file():
                    shutil.copy2(d / name, keep / name)
                    break
    (keep / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    metrics = read_metrics(run)
    rows = [m for s, m in sorted(metrics.items()) if s > 0 and "perf/step_s" in m]
    total = int(_get(cfg, "trainer.total_steps", len(rows)) or len(rows))
    if "eval_before" not in summary and 0 in metrics:
        # a run cut off before its end wrote no summary.json; step 0 of metrics.jsonl is the eval
        summary["eval_before"] = {k: v for k, v in metrics[0].items() if k.startswith("eval/")}
    png_note = plot(rows, summary.get("eval_before") or {}, summary.get("eval_after") or {}, total,
                    stem.with_suffix(".png"))
    md, text = render(rows, summary, stem, meta, cfg, png_note)
    stem.with_suffix(".md").write_text(md)
    print(text)
    print(f"wrote {stem.with_suffix('.md')}" + ("" if png_note else f", {stem.with_suffix('.png')}")
          + f" and {keep}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
