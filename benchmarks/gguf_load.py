"""Cold load of the SmolLM2 GGUF (no dequantized-weights cache): transformers' own load against
flowrl's ``gguf_parsed_once`` (one parse of the file, one tensor-name map per arguments).

Why: a user's first run on a machine (and every run with ``model.gguf_cache=false``) dequantizes
the GGUF; on the H200's first-step run that was 14.9 s of a cold 81 s to step 1
(first_step_h200.md). Each load runs in a fresh child process (imports done before the clock
starts), variants interleaved round by round (A, B, A, B, ...); reported: median, min-max, and the
ratio of medians. The load is host work, so a CPU machine's ratio carries over; its absolute
seconds do not.

Usage::

    python benchmarks/gguf_load.py --rounds 3 --md-out benchmarks/results/gguf_load_cpu.md
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO_ROOT,
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    utc_now,
    versions,
)

CHILD = r"""
import contextlib, json, sys, time
import torch
from flowrl.models import loading
torch.set_num_threads(int(sys.argv[2]))
if sys.argv[1] == "transformers":
    loading.gguf_parsed_once = contextlib.nullcontext
cfg = loading.ModelConfig(path="smollm2", gguf_cache=False)
t0 = time.perf_counter()
model = loading.load_model(cfg)
s = time.perf_counter() - t0
print(json.dumps({"load_s": s, "params": sum(p.numel() for p in model.parameters())}))
"""
VARIANTS = ("transformers", "parsed_once")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    p.add_argument("--md-out")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS:
            out = subprocess.run([sys.executable, "-c", CHILD, v, str(args.threads)], cwd=REPO_ROOT,
                                 capture_output=True, text=True, check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            times[v].append(res["load_s"])
            print(f"round {r + 1}: {v:<13} {res['load_s']:.2f} s ({res['params']:,} parameters)")
    med = {v: statistics.median(t) for v, t in times.items()}
    rows = [(v, f"{med[v]:.2f}", f"{min(t):.2f}-{max(t):.2f}", " / ".join(f"{x:.2f}" for x in t))
            for v, t in times.items()]
    table = markdown_table(("variant", "load s (median)", "min-max", "rounds"), rows)
    ratio = med["parsed_once"] / med["transformers"]
    m = machine_info()
    text = "\n".join([
        "# Cold SmolLM2 GGUF load: transformers' own against `gguf_parsed_once`", "",
        f"- command: `{command_line()}`",
        f"- date: {utc_now()}; flowrl commit {git_revision()}",
        f"- machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}; "
        f"{args.threads} torch threads per child",
        f"- versions: {', '.join(f'{k} {v}' for k, v in versions(('torch', 'transformers', 'gguf')).items())}",
        f"- {args.rounds} interleaved rounds, a fresh process per load, `model.gguf_cache=false`", "",
        table, "", f"ratio of medians (parsed_once / transformers): **{ratio:.2f}×**", ""])
    print(text)
    if args.md_out:
        Path(args.md_out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
