"""How long a rejected command takes to answer: ``flowrl graph validate graphs/grpo.yaml`` and a
config typo (``flowrl train algorithm.n=0``), for one or more flowrl checkouts side by side.

    python benchmarks/preflight.py --tree before=/path/to/old/checkout --tree after=. \\
        --out benchmarks/results/preflight_cpu.md

Each command runs as ``python -m flowrl.cli ...`` (what the ``flowrl`` script runs) with
``PYTHONPATH=<tree>``, from an empty working directory (nothing of a checkout is picked up from
there), ``--repeats`` times, the trees interleaved so a busy minute of the shared machine hits
each alike. Reported per tree and command: median and best wall-clock seconds, median CPU seconds
(user + system of the child; on a loaded machine the wall clock also counts waiting for a core),
the exit status, and whether torch was imported before the answer (one more run with
``python -X importtime``). The load average is recorded around the whole benchmark.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    text_table,
    utc_now,
    versions,
)

COMMANDS = {  # name -> (flowrl arguments, expected exit status); {tree} = the checkout
    "flowrl graph validate graphs/grpo.yaml": (["graph", "validate", "{tree}/graphs/grpo.yaml"], 0),
    "flowrl train algorithm.n=0": (["train", "algorithm.n=0"], 2),
}


def run_once(tree: Path, args: list[str], cwd: Path, importtime: bool = False) -> dict:
    """One child ``python -m flowrl.cli <args>``: wall seconds, exit status, stdout, stderr."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "flowrl.cli",
           *[a.format(tree=tree) for a in args]]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate()
    return {"wall": time.perf_counter() - t0, "rc": proc.returncode, "out": out, "err": err}


def cpu_seconds(fn) -> tuple[dict, float]:
    """Run ``fn()`` and return its result with the CPU seconds its children used."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return res, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imports_torch(tree: Path, args: list[str], cwd: Path) -> bool:
    res = run_once(tree, args, cwd, importtime=True)
    return any(line.split("|")[-1].strip() == "torch" for line in res["err"].splitlines()
               if line.startswith("import time:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True,
                    help="LABEL=PATH of a flowrl checkout (repeat the option for several)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, help="write the Markdown report here")
    args = ap.parse_args()
    trees = {}
    for spec in args.tree:
        label, _, path = spec.partition("=")
        trees[label] = Path(path).resolve()
    load_before = os.getloadavg()
    rows: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for _ in range(args.repeats):
            for label, tree in trees.items():
                for name, (cargs, _) in COMMANDS.items():
                    res, cpu = cpu_seconds(lambda tree=tree, cargs=cargs: run_once(tree, cargs, cwd))
                    r = rows.setdefault((label, name), {"wall": [], "cpu": [], "rc": set(),
                                                        "err": res["err"].strip().splitlines()})
                    r["wall"].append(res["wall"])
                    r["cpu"].append(cpu)
                    r["rc"].add(res["rc"])
        for (label, name), r in rows.items():
            r["torch"] = imports_torch(trees[label], COMMANDS[name][0], cwd)
        assert not any(cwd.iterdir()), "a rejected command left files behind"
    load_after = os.getloadavg()
    table = [["tree", "commit", "command", "wall s (median)", "wall s (best)", "CPU s (median)",
              "exit", "imports torch"]]
    for (label, name), r in rows.items():
        table.append([label, git_revision(trees[label]), f"`{name}`",
                      f"{statistics.median(r['wall']):.2f}", f"{min(r['wall']):.2f}",
                      f"{statistics.median(r['cpu']):.2f}",
                      "/".join(str(c) for c in sorted(r["rc"])), "yes" if r["torch"] else "no"])
    print(text_table(table[0], table[1:]))
    if args.out is None:
        return
    m = machine_info()
    answers = "\n".join(f"- {label}, `{name}`: `{(r['err'] or ['(stdout only)'])[-1]}`"
                        for (label, name), r in rows.items())
    args.out.write_text(f"""# Pre-flight answer times (CPU)

How long flowrl takes to answer a graph check and to reject a config typo, before and after the
entry layer stopped importing torch, transformers and the op modules first (issue 14,
"pre-flight in one place, run once, fast"). Each command is the `flowrl` script's
`python -m flowrl.cli ...` with `PYTHONPATH=<checkout>`, run from an empty directory,
{args.repeats} times per checkout, interleaved.

- Command: `{command_line()}`
- Trees: {", ".join(f"{label} = `{path}` ({git_revision(path)})" for label, path in trees.items())}
- Date: {utc_now()}
- Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}, {m['os']}, Python {m['python']}
- Versions: {", ".join(f"{k} {v}" for k, v in versions(["torch", "transformers", "hydra-core", "networkx"]).items())}
- Load average (1, 5, 15 min) before: {", ".join(f"{x:.1f}" for x in load_before)}; after: {", ".join(f"{x:.1f}" for x in load_after)}
  (the machine is shared: wall-clock seconds include waiting for a core; CPU seconds do not)

{markdown_table(table[0], table[1:])}

The answers (last line of stderr, or stdout):

{answers}
""")


if __name__ == "__main__":
    main()
