"""Shared helpers of the benchmark scripts: machine/version facts, a child-process runner that
measures the child's own peak RSS, and a markdown table writer.

Kept generic on purpose: a benchmark imports what it needs, nothing here knows about flowrl's API.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent


def lscpu() -> dict[str, str]:
    """``lscpu`` as ``{field: value}`` (empty when the command is missing, e.g. on macOS)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def machine_info() -> dict[str, str]:
    """CPU model, logical CPUs, physical cores, memory, OS and Python of this machine."""
    cpu = lscpu()
    cores = "?"
    if cpu.get("Core(s) per socket", "").isdigit() and cpu.get("Socket(s)", "").isdigit():
        cores = str(int(cpu["Core(s) per socket"]) * int(cpu["Socket(s)"]))
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpu": cpu.get("Model name", platform.processor() or "?"),
            "logical_cpus": str(os.cpu_count()), "physical_cores": cores, "memory": mem,
            "os": platform.platform(), "python": platform.python_version()}


def versions(packages: Iterable[str]) -> dict[str, str]:
    """Installed distribution versions (``"not installed"`` for a missing one)."""
    out = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_revision(repo: Path = REPO_ROOT) -> str:
    """Short commit of ``repo`` plus ``+dirty`` when the working tree has uncommitted changes."""
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return rev + ("+dirty" if dirty else "")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command that ran this script, relative to the repo root when possible, shell-quoted."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    try:
        argv[0] = str(script.relative_to(REPO_ROOT))
    except ValueError:
        pass
    return "python " + " ".join(shlex.quote(a) for a in argv)


@dataclass
class ChildResult:
    """returncode; peak_rss_bytes: the child's own maximum resident set size (``wait4`` rusage,
    so it is per child, unlike ``RUSAGE_CHILDREN`` which is a max over every child so far);
    wall_s: seconds from spawn to exit."""

    returncode: int
    peak_rss_bytes: int
    wall_s: float


def run_child(cmd: Sequence[str], env: Optional[Mapping[str, str]] = None,
              cwd: Optional[Path] = None) -> ChildResult:
    """Run ``cmd`` to completion (output goes to this process's stdout/stderr) and measure it.

    Linux reports ``ru_maxrss`` in KiB (macOS in bytes).
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None,
                            cwd=str(cwd) if cwd else None)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait on a reaped pid
    scale = 1 if sys.platform == "darwin" else 1024
    return ChildResult(proc.returncode, usage.ru_maxrss * scale, time.perf_counter() - t0)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; cells are ``str()``-ed and ``|`` is escaped."""
    def cell(v: object) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """The same table aligned for a terminal."""
    rows = [[str(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(headers)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join([fmt.format(*map(str, headers)), fmt.format(*("-" * w for w in widths)),
                      *(fmt.format(*r) for r in rows)])
