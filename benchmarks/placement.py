"""Colocated vs partitioned placement (k = 0 and k = 1) on 2 devices, one GRPO graph whose reward
stage itself generates (graphs/genrm_grpo.yaml: a judge model scores every response).

    # the lent 2-GPU machine
    python benchmarks/placement.py --device cuda --model smollm2 --steps 6 \
        --out benchmarks/results/placement_2gpu.md
    # 2 gloo processes on CPU (orientation only: both "devices" share the same cores)
    python benchmarks/placement.py --device cpu --model tiny --steps 4 \
        --out benchmarks/results/placement_cpu.md

Every configuration runs ``torchrun --nproc_per_node=2 -m flowrl.train`` with the same global
batch: colocated = 2 data-parallel ranks of ``--prompts`` prompts each (FSDP actor, every rank
generates, judges and trains in turn); partitioned = train pool [0] + rollout pool [1] with
``2 × --prompts`` prompts on the rollout rank. Reported from each run's metrics.jsonl, over the
steps after ``--warmup``:

- step time (median ``perf/step_s``) and the ratio colocated / partitioned (goal >= 1.25x);
- busy fraction per pool: ``perf/busy_s/<pool> / perf/step_s`` (seconds inside stages and weight
  transfers; colocated: the summed stage times ``time/*`` of the one pool);
- what ``placement=auto`` picks for this job and why (the cost model's notes; no model loaded).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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
    utc_now,
    versions,
)

CONFIGS = {  # name → extra overrides
    "colocated": ["placement=colocated"],
    "partitioned k=0": ["placement=partitioned", "placement.staleness=0"],
    "partitioned k=1": ["placement=partitioned", "placement.staleness=1"],
}


def overrides(args, name: str, out: Path) -> list[str]:
    prompts = args.prompts * (2 if name != "colocated" else 1)  # same global batch
    return ["graph=genrm_grpo", f"model={args.model}", f"trainer.device={args.device}",
            f"trainer.total_steps={args.steps}", f"trainer.prompts_per_step={prompts}",
            f"algorithm.n={args.n}", f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
            "trainer.eval.before=false", "trainer.eval.after=false", "trainer.save_every=0",
            "logger.progress=false", "logger.tensorboard=false", f"trainer.output_dir={out}",
            *CONFIGS[name], *args.extra]


def steady(rows: list[dict], warmup: int, key: str) -> list[float]:
    return [r[key] for r in rows if r.get("step", 0) > warmup and key in r]


def summarize(name: str, out: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r]
    step_s = statistics.median(steady(rows, warmup, "perf/step_s"))
    res = {"name": name, "step_s": step_s, "steps": len(rows)}
    if name == "colocated":
        busy = [sum(v for k, v in r.items() if k.startswith("time/")) for r in rows
                if r["step"] > warmup]
        res["busy"] = {"all": statistics.median(busy) / step_s}
    else:
        res["busy"] = {p: statistics.median(steady(rows, warmup, f"perf/busy_s/{p}")) / step_s
                       for p in ("train", "rollout")}
        res["lags"] = [int(r["placement/version_lag"]) for r in rows]
    return res


def auto_choice(args) -> str:
    """What placement=auto picks for the colocated job's config on 2 ranks, with its notes."""
    try:
        from flowrl.config import compose
        from flowrl.runtime.control.preflight import prepare_placement
        from flowrl.train import prepare

        spec = prepare(compose(overrides(args, "colocated", Path(tempfile.mkdtemp()))
                                    [:-1] + ["placement=auto", "launcher.nproc=2"]))
        cfg, plan = spec.config, spec.plan
        pp = prepare_placement(cfg, plan, 2)
        return f"{pp.mode}: " + "; ".join(pp.notes)
    except Exception as e:  # auto is another engineer's seam: report, do not fail the benchmark
        return f"(placement=auto failed: {type(e).__name__}: {e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", default="smollm2", help="model config group (tiny, smollm2, ...)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out of the medians")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step per colocated rank")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--only", nargs="*", default=list(CONFIGS), help="subset of configurations")
    ap.add_argument("--out", type=Path, help="markdown report path")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for every run")
    args = ap.parse_args()
    if args.warmup >= args.steps:
        ap.error("--warmup must be < --steps")

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            out = Path(tmp) / name.replace(" ", "_").replace("=", "")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=2", "-m", "flowrl.train", *overrides(args, name, out)]
            print(f"== {name}: {' '.join(cmd[3:])}", flush=True)
            child = run_child(cmd, env=env, cwd=REPO_ROOT)
            if child.returncode != 0:
                raise SystemExit(f"{name} failed with exit code {child.returncode}")
            results.append({**summarize(name, out, args.warmup), "wall_s": child.wall_s})
    base = next((r["step_s"] for r in results if r["name"] == "colocated"), None)
    rows = []
    for r in results:
        busy = ", ".join(f"{p} {v:.2f}" for p, v in r["busy"].items())
        ratio = f"{base / r['step_s']:.2f}x" if base else "-"
        rows.append([r["name"], f"{r['step_s']:.2f}", ratio, busy, r.get("lags", "-"),
                     f"{r['wall_s']:.0f}"])
    table = markdown_table(["placement", "step s (median)", "colocated / this", "busy fraction",
                            "version lags", "wall s"], rows)
    m = machine_info()
    report = "\n".join([
        f"# Placement: colocated vs partitioned ({args.device}, {args.model}, graph genrm_grpo)", "",
        f"- command: `{command_line()}`", f"- date: {utc_now()}, commit {git_revision()}",
        f"- machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}; "
        f"versions: {versions(['torch', 'transformers'])}",
        f"- batch: {args.prompts} prompts × n={args.n} per colocated rank (partitioned: "
        f"{2 * args.prompts} on the rollout rank), {args.max_new_tokens} new tokens, "
        f"{args.steps} steps, medians over steps > {args.warmup}", "",
        table, "", f"placement=auto picks: {auto_choice(args)}", ""])
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
