"""Run the default job exactly as the README's Quick start does and record what it printed.

Runs ``flowrl train`` (no overrides, or the ones given after ``--``) in a fresh process, keeps its
console output, then writes the reward curve, before/after greedy accuracy, step and stage times and
peak RSS to ``benchmarks/results/default_job_cpu.md`` with the command, machine and date.

Run: python benchmarks/default_job.py                      (the ~15-minute default job)
     python benchmarks/default_job.py -- trainer=long      (any flowrl train overrides)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO_ROOT,
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    run_child,
    text_table,
    utc_now,
    versions,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/default_job_cpu.md")
    ap.add_argument("overrides", nargs="*", help="flowrl train overrides (after --)")
    args = ap.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="flowrl_default_job_"))
    flowrl = shutil.which("flowrl") or "flowrl"
    cmd = [flowrl, "train", f"hydra.run.dir={run_dir}", *args.overrides]
    load_before = os.getloadavg()
    log_path = run_dir.with_suffix(".log")
    with open(log_path, "w") as log:
        # the child's console output goes to a file we quote; rich renders the bar as plain lines
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            res = run_child(cmd, env={**os.environ, "COLUMNS": "120"}, cwd=REPO_ROOT)
        finally:
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    load_after = os.getloadavg()
    console = log_path.read_text()
    if res.returncode != 0:
        print(console[-4000:])
        print(f"flowrl train failed with exit code {res.returncode}")
        return res.returncode
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "perf/step_s" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})

    headers = ["step", "reward mean", "reward std", "accuracy", "resp. len", "truncated",
               "pg loss", "grad norm", "Δlogp (rollout vs trainer)", "step s", "rollout s", "update s"]
    table = [[r["step"], f"{r['reward/mean']:.4f}", f"{r['reward/std']:.4f}",
              f"{r['reward/accuracy']:.3f}", f"{r['response/length_mean']:.0f}",
              f"{r['response/truncated_frac']:.2f}", f"{r['actor/pg_loss']:+.4f}",
              f"{r['actor/grad_norm']:.3f}", f"{r['rollout/logprob_mismatch']:.1e}",
              f"{r['perf/step_s']:.1f}", f"{r.get('time/rollout', float('nan')):.1f}",
              f"{r.get('time/update', float('nan')):.1f}"] for r in steps]
    half = max(len(steps) // 2, 1)
    first, last = steps[:half], steps[half:] or steps[-1:]
    mean = lambda rs, k: statistics.fmean(r[k] for r in rs)  # noqa: E731
    facts = [
        [f"greedy accuracy before (held-out, first {before.get('eval/n', float('nan')):.0f})",
         f"{before.get('eval/accuracy', float('nan')):.3f}"],
        ["greedy accuracy after", f"{after.get('eval/accuracy', float('nan')):.3f}"],
        ["held-out accuracy per eval step", ", ".join(
            f"{r['step']}: {r['eval/accuracy']:.3f}" for r in rows if "eval/accuracy" in r)],
        ["mean reward, first half of steps", f"{mean(first, 'reward/mean'):.4f}"],
        ["mean reward, second half of steps", f"{mean(last, 'reward/mean'):.4f}"],
        ["mean step time (s)", f"{mean(steps, 'perf/step_s'):.1f}"],
        ["mean generated tokens/s (rollout stage)", f"{mean(steps, 'perf/rollout_tokens_per_s'):.1f}"],
        ["model load (s)", f"{summary.get('model_load_s', float('nan')):.1f}"],
        ["whole job wall time (s)", f"{res.wall_s:.0f}"],
        ["peak RSS", f"{res.peak_rss_bytes / 2**30:.2f} GiB"],
        ["load average before / after", f"{load_before[0]:.2f} / {load_after[0]:.2f}"],
    ]
    print(text_table(["quantity", "value"], facts))
    print(text_table(headers, table))
    import yaml

    cfg = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    m = machine_info()
    v = versions(["torch", "transformers", "flowrl"])
    printed = "\n".join(l for l in console.splitlines()
                        if l.startswith(("step", "eval", "flowrl")) or "clip=" in l)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = cfg["data"]["name"] if not cfg["data"].get("path") else cfg["data"]["path"]
    args.out.write_text(f"""# The default job on CPU: GRPO on `{data}` with SmolLM2-135M-Instruct

- Command: `{command_line()}` — it runs `flowrl train {' '.join(args.overrides)}`, the README's
  Quick-start job (run directory `hydra.run.dir` in a temp folder)
- Date: {utc_now()} · commit {git_revision()}
- Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}, {m['os']}, Python {m['python']}
- Versions: {', '.join(f'{k} {x}' for k, x in v.items())}
- Config (composed, from the run's `.hydra/config.yaml`): graph `{cfg['graph']['path']}`,
  model `{cfg['model']['path']}`{' (tiny random)' if cfg['model'].get('tiny') else ''},
  {cfg['trainer']['total_steps']} steps × {cfg['trainer']['prompts_per_step']} prompts ×
  {cfg['algorithm']['n']} samples, T = {cfg['rollout']['sampling']['temperature']},
  ≤ {cfg['rollout']['sampling']['max_new_tokens']} new tokens, AdamW lr {cfg['trainer']['engine']['lr']},
  kl_coef {cfg['algorithm']['kl_coef']}; data `{data}` {cfg['data'].get('arith', '') if data == 'arith' else ''};
  reward (graph `reward` stage): 1 for a right answer (the number after the last `####`, else
  the last number of the response; no format bonus), 0 otherwise; eval: greedy on the first
  {cfg['trainer']['eval']['limit']} held-out items, before, every {cfg['trainer']['eval'].get('every', 0)} steps and after.

## Summary

{markdown_table(['quantity', 'value'], facts)}

## Per step (from metrics.jsonl)

{markdown_table(headers, table)}

## What the console printed

```
{printed}
```
""")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
