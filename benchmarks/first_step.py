"""Time to first step: ``flowrl train`` as a user starts it, with every console line timestamped
from the command's start (issue 24: "reaches step 1 in <= 45 s, finishes the default job in <= 90 s").

Each variant is one fresh ``python -m flowrl.train`` process (the default job plus the variant's
overrides); the script reads its console as it is printed and takes the wall time (from spawning the
process) at which each start-up milestone appeared:

- ``checked``: "start-up: checked" (the interpreter, imports, config, machine and input checks;
  the line itemizes them),
- ``model``: "start-up: model loaded" (data and the policy's weights),
- ``train engines``: "start-up: ... built" (actor / reference copies, FSDP),
- ``rollout engine``: "engines built" (vLLM's start-up; with its own "resolved" lines),
- ``eval before``: the greedy eval's line, ``step 1``: "step 1 done", ``end``: the process exits.

Variants run in the order given (``--rounds`` repeats the list: A, B, A, B, ...). vLLM's
torch.compile cache lives in ``~/.cache/vllm``: a CUDA-graph variant run first compiles cold, later
ones find it warm; the table says which round each run was. ``--fresh-caches`` gives every run
empty compile caches of its own (vLLM's, Triton's, TorchInductor's, FlashInfer's and flowrl's
GGUF cache, through their environment variables), so a cold start can be measured again and
again on one machine, interleaved with its alternative; it also drops the OS page cache
before each run where the process may (root, a writable ``/proc/sys/vm/drop_caches``: the
table's "page cache" column says which). What it cannot make cold: the driver's and the
GPU's state.

Run (GPU):  python benchmarks/first_step.py --variants default,graphs --rounds 1 \\
                --md-out benchmarks/results/first_step_h200.md
            python benchmarks/first_step.py --variants default -- trainer.total_steps=3   (overrides)
            python benchmarks/first_step.py --variants default,v1runner --rounds 3 --fresh-caches
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO_ROOT,
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    text_table,
    utc_now,
    versions,
)

# the overrides of each variant on top of the default job (and the user's own after --)
VARIANTS: dict[str, list[str]] = {
    "default": [],  # the job-sized engine: what `flowrl train` picks with no overrides
    # one in-process engine with CUDA graphs (vLLM compiles and captures)
    "graphs": ["rollout.vllm.engine_procs=0", "rollout.vllm.enforce_eager=false"],
    # the defaults before issue 24 (cc93675): 4 engine processes, vLLM-sized caches (one after the
    # other), CUDA graphs up to max_num_seqs (2,048)
    "before": ["rollout.vllm.engine_procs=4", "rollout.vllm.enforce_eager=false",
               "rollout.vllm.max_cudagraph_capture_size=2048"],
    # the same, cut to 10 steps and the before/after evals: its start-up and step times only
    "graphs10": ["rollout.vllm.engine_procs=0", "rollout.vllm.enforce_eager=false",
                 "trainer.total_steps=10", "trainer.eval.every=0"],
    "hf": ["rollout=hf"],
    # the default job with vLLM's torch.compile on (the job-sized default turns it off for a job
    # this short): its start-up cost against its step times
    "compile": ["rollout.vllm.torch_compile=true"],
    # the default job on vLLM's V1 model runner (environment below): vLLM 0.26's V2 runner
    # JIT-compiles its Triton kernels after graph capture, 16.3 s of a cold H100 start (a033fa5)
    "v1runner": [],
    # liger-kernel's kernels on (auto leaves them off for a job this short: their import)
    "liger": ["model.liger_kernel=true"],
}
# the environment of each variant on top of this process's
VARIANT_ENV: dict[str, dict[str, str]] = {"v1runner": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
# each compile cache's environment variable (--fresh-caches points every one at an empty folder)
CACHE_ENV = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLOWRL_CACHE",
             "FLASHINFER_WORKSPACE_BASE", "XDG_CACHE_HOME")
MILESTONES = {
    "checked": re.compile(r"start-up: checked"),
    "model": re.compile(r"start-up: model loaded"),
    "train engines": re.compile(r"start-up: .* built in"),
    "rollout engine": re.compile(r"engines built in"),
    "eval before": re.compile(r"eval before:"),
    "step 1": re.compile(r"step 1 done"),
}


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session``): the run and
    every process it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def drop_page_cache() -> str:
    """Write back and drop the OS page cache (what a machine's first run reads from disk), where
    this process may: "dropped", else why not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "dropped"
    except OSError as e:
        return f"kept ({e.strerror or e})"


def run_variant(name: str, overrides: list[str], timeout_s: float, *,
                fresh_caches: bool = False) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"flowrl_first_step_{name}_"))
    cmd = [sys.executable, "-m", "flowrl.train", *VARIANTS[name], *overrides,
           f"hydra.run.dir={run_dir}", "logger.progress=false"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **VARIANT_ENV.get(name, {})}
    caches = None
    page_cache = "-"
    if fresh_caches:
        caches = Path(tempfile.mkdtemp(prefix=f"flowrl_first_step_caches_{name}_"))
        env.update({k: str(caches / k.lower()) for k in CACHE_ENV})
        page_cache = drop_page_cache()
    t0 = time.perf_counter()
    # a session of its own: at the timeout (or after it ends) its whole process tree goes, engine
    # processes and a model-info prefetch included (killing the leader alone orphaned them)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    timer = threading.Timer(timeout_s, kill_tree, args=(proc,))  # also when it prints nothing
    timer.start()
    seen: dict[str, float] = {}
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            t = time.perf_counter() - t0
            lines.append(f"{t:7.1f}s | {line.rstrip()}")
            for key, pat in MILESTONES.items():
                if key not in seen and pat.search(line):
                    seen[key] = t
        rc = proc.wait()
    finally:
        timer.cancel()
        kill_tree(proc)  # whatever of its tree outlived it
    seen["end"] = time.perf_counter() - t0
    steps = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for row in map(json.loads, metrics.read_text().splitlines()):
            if "perf/step_s" in row:
                steps.append(row["perf/step_s"])
    resolved = [ln.split("| ", 1)[1].strip() for ln in lines
                if "resolved rollout" in ln or "vLLM engine" in ln or "start-up: checked" in ln]
    shutil.rmtree(run_dir, ignore_errors=True)
    if caches is not None:
        shutil.rmtree(caches, ignore_errors=True)
    return {"variant": name, "rc": rc, "milestones": seen, "step_s": steps, "cmd": cmd,
            "resolved": resolved, "log": lines, "env": VARIANT_ENV.get(name, {}),
            "caches": "fresh" if fresh_caches else "as found", "page_cache": page_cache}


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def summarize(results: list[dict]) -> tuple[list[str], list[list]] | None:
    """Per variant with 2+ runs that finished: the median [min-max] of "step 1" and "end", and
    each against the first variant's medians (headers, rows); None with fewer."""
    by: dict[str, list[dict]] = {}
    for res in results:
        if res["rc"] == 0 and "step 1" in res["milestones"]:
            by.setdefault(res["variant"], []).append(res["milestones"])
    if not by or all(len(v) < 2 for v in by.values()):
        return None
    base = next(iter(by))
    headers = ["variant", "runs", "step 1 s", "end s", f"step 1 / {base}", f"end / {base}"]
    meds = {n: {k: statistics.median(m[k] for m in ms) for k in ("step 1", "end")}
            for n, ms in by.items()}
    rows = []
    for n, ms in by.items():
        cells = [f"{meds[n][k]:.1f} [{min(m[k] for m in ms):.1f}-{max(m[k] for m in ms):.1f}]"
                 for k in ("step 1", "end")]
        ratios = [f"{meds[n][k] / meds[base][k]:.2f}x" for k in ("step 1", "end")]
        rows.append([n, len(ms), *cells, *ratios])
    return headers, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="default", help=f"comma list of {sorted(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=400)
    ap.add_argument("--md-out", type=Path)
    ap.add_argument("--log-dir", type=Path, help="each run's timestamped console here")
    ap.add_argument("--fresh-caches", action="store_true", help="every run with empty compile "
                    "caches of its own (and the OS page cache dropped where allowed): cold starts")
    ap.add_argument("overrides", nargs="*", help="flowrl train overrides for every variant (after --)")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    results = []
    for r in range(args.rounds):
        for name in names:
            res = run_variant(name, args.overrides, args.timeout_s, fresh_caches=args.fresh_caches)
            res["round"] = r + 1
            results.append(res)
            m = res["milestones"]
            print(f"[round {r + 1}] {name}: rc={res['rc']} step 1 at {fmt(m.get('step 1'))} s, "
                  f"end at {fmt(m.get('end'))} s", flush=True)
            if args.log_dir:
                args.log_dir.mkdir(parents=True, exist_ok=True)
                (args.log_dir / f"first_step_{name}_r{r + 1}.log").write_text(
                    "\n".join(res["log"]) + "\n")
            if res["rc"] != 0:
                print("\n".join(res["log"][-30:]), flush=True)
    headers = ["round", "variant", "caches", "page cache", "rc", *MILESTONES, "end", "steps",
               "step s median (min-max)"]
    rows = []
    for res in results:
        m, st = res["milestones"], res["step_s"]
        med = (f"{statistics.median(st):.2f} ({min(st):.2f}-{max(st):.2f})" if st else "-")
        rows.append([res["round"], res["variant"], res["caches"], res["page_cache"], res["rc"],
                     *(fmt(m.get(k)) for k in MILESTONES), fmt(m.get("end")), len(st), med])
    print(text_table(headers, rows))
    summary = summarize(results)
    if summary:
        print(text_table(*summary))
    if args.md_out:
        info = machine_info()
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            gpu = "no GPU"
        vers = versions(["torch", "transformers", "vllm"])
        out = [f"# Time to first step: `flowrl train` from the command to step 1 ({utc_now()})", "",
               f"Command: `{command_line()}` at flowrl {git_revision()}; machine: {gpu}, "
               f"{info.get('cpu', '?')}, {info.get('logical_cpus', '?')} CPUs; "
               + ", ".join(f"{k} {v}" for k, v in vers.items()), "",
               "Seconds from spawning `python -m flowrl.train` to the console line of each "
               "milestone (see the script's docstring); steps = training steps in metrics.jsonl.", "",
               markdown_table(headers, rows), ""]
        if summary:
            out += ["Per variant, over its rounds: median [min-max] seconds.", "",
                    markdown_table(*summary), ""]
        for res in results:
            env = "".join(f"{k}={v} " for k, v in res["env"].items())
            out += [f"## round {res['round']}, {res['variant']}", "",
                    "`" + env + " ".join(res["cmd"][1:]) + "`", ""]
            out += [f"- {ln}" for ln in res["resolved"]] + [""]
        args.md_out.parent.mkdir(parents=True, exist_ok=True)
        args.md_out.write_text("\n".join(out))
        print(f"wrote {args.md_out}")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
