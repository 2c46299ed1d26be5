"""Torch threads under CPU contention: the step time of one ``flowrl train`` process with
``OMP_NUM_THREADS`` = 1, = the CPU count, and = the CPU count with OpenMP's passive wait
(``OMP_WAIT_POLICY=PASSIVE``: idle threads sleep instead of spinning), alone and beside busy
neighbours (other processes doing torch matmuls with their own default threads, as a second run
or a test job would).

    python benchmarks/threads.py --out benchmarks/results/threads_cpu.md

Each run: a tiny Llama widened to be compute-bound (hidden 256, 4 layers, the 49k-token SmolLM2
vocabulary), GRPO, ``--steps`` steps of 2 prompts x 4 samples x ``--max-new-tokens`` tokens, no
eval, no checkpoint. Reported: the median ``perf/step_s`` over the steps after the first (warm-up),
per configuration, each the median over ``--repeats`` runs (interleaved, so a slow minute of the
shared machine hits every configuration alike), and the load average around the whole benchmark.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
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

# a busy neighbour; it stops by itself when the benchmark dies (its parent changes)
NEIGHBOUR = """
import os, torch
parent = os.getppid()
a = torch.randn(512, 512)
while os.getppid() == parent:
    for _ in range(20):
        a = (a @ a).tanh_()
"""


def configs(cpus: int) -> dict[str, dict[str, str]]:
    """name -> environment of the training process (set before torch starts its thread pool)."""
    # "" = libgomp's default (spin a while, then sleep): what flowrl ran with before it set
    # PASSIVE (flowrl/__init__.py only sets the variable when it is absent)
    return {"1 thread": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": ""},
            f"{cpus} threads, spin (libgomp default)": {"OMP_NUM_THREADS": str(cpus),
                                                        "OMP_WAIT_POLICY": ""},
            f"{cpus} threads, passive wait (flowrl default)": {"OMP_NUM_THREADS": str(cpus),
                                                               "OMP_WAIT_POLICY": "PASSIVE"}}


def run_once(args, config_env: dict[str, str], out: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # only the config's
    env.update(HF_HUB_OFFLINE="1", **config_env)
    cmd = [sys.executable, "-m", "flowrl.train", "model=tiny", "model.tiny.hidden_size=256",
           "model.tiny.num_hidden_layers=4", "model.tiny.intermediate_size=512",
           f"trainer.total_steps={args.steps}", "trainer.prompts_per_step=2", "algorithm.n=4",
           f"rollout.sampling.max_new_tokens={args.max_new_tokens}", "trainer.eval.limit=0",
           "trainer.save_every=0", "logger.progress=false", "logger.console=false",
           "logger.tensorboard=false", f"hydra.run.dir={out}", "trainer.device=cpu"]
    res = run_child(cmd, env=env, cwd=REPO_ROOT)
    if res.returncode != 0:
        raise SystemExit(f"flowrl train failed ({res.returncode}): {' '.join(cmd)}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["perf/step_s"] for r in rows if r["step"] > 1 and "perf/step_s" in r)


def report(args, cpus: int, cfgs: dict, runs: list, load_before: tuple) -> None:
    """Print the table of medians and (``--out``) write it with every run's time and load."""
    headers = ["busy neighbours", *[f"s/step, {name}" for name in cfgs]]
    rows = []
    for k in args.neighbours:
        med = [statistics.median([r[3] for r in runs if r[1] == k and r[2] == name] or [math.nan])
               for name in cfgs]
        if not all(math.isnan(m) for m in med):
            rows.append([k, *[f"{m:.2f} ({m / med[0]:.2f}x)" for m in med]])
    print(text_table(headers, rows))
    if not args.out:
        return
    m = machine_info()
    every = markdown_table(["repeat", "busy neighbours", "config", "s/step", "load average (1 min) at start"],
                           [[r[0], r[1], r[2], f"{r[3]:.2f}", f"{r[4]:.1f}"] for r in runs])
    args.out.write_text(f"""# Torch threads under CPU contention

- Command: `{command_line()}`
- Date: {utc_now()} · commit {git_revision()}
- Machine: {m.get('cpu', '?')}, {m.get('logical_cpus', cpus)} logical CPUs, {m.get('memory', '?')}, {m.get('os', '?')}, Python {m.get('python', '?')}
- Versions: {', '.join(f'{k} {v}' for k, v in versions(['torch', 'transformers']).items())}
- Load average (1 min) before / now: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}
  (a shared machine: other jobs are neighbours too, see the load of every run below)
- Workload: `flowrl train` on a tiny Llama (hidden 256, 4 layers, 49k vocab), {args.steps} steps
  of 2 prompts x 4 samples x {args.max_new_tokens} new tokens; median `perf/step_s` after the
  first step, median over {args.repeats} interleaved repeats (in brackets: relative to 1 thread).
  A neighbour is a process running 512x512 matmuls in a loop with torch's default threads ({cpus}).
  {len(runs)} runs done.

{markdown_table(headers, rows)}

Every run:

{every}
""")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--neighbours", type=int, nargs="+", default=[0, 1],
                    help="busy neighbour processes (each with torch's default threads)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cpus = os.cpu_count() or 1
    cfgs = configs(cpus)
    load_before = os.getloadavg()
    runs: list[tuple[int, int, str, float, float]] = []  # repeat, neighbours, config, s, load
    tmp = Path(tempfile.mkdtemp(prefix="flowrl_threads_"))
    for rep in range(args.repeats):
        for k in args.neighbours:
            procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(k)]
            try:
                for i, (name, env) in enumerate(cfgs.items()):
                    load = os.getloadavg()[0]
                    s = run_once(args, env, tmp / f"r{rep}_n{k}_c{i}")
                    runs.append((rep, k, name, s, load))
                    print(f"repeat {rep}: {k} neighbour(s), {name}: {s:.2f} s/step "
                          f"(load {load:.1f})", flush=True)
                    report(args, cpus, cfgs, runs, load_before)  # kept if a later run is cut
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
