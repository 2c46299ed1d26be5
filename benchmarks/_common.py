"""Shared helpers of the benchmark scripts: machine/version facts, a child-process runner that
measures the child's own peak RSS (and, with a ``TreeMonitor``, the peak memory of its whole process
tree and of a GPU), and a markdown table writer.

Kept generic on purpose: a benchmark imports what it needs, nothing here knows about flowrl's API.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
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
    """Short commit of ``repo`` plus ``+dirty`` when the working tree has uncommitted changes.

    ``FLOWRL_COMMIT`` in the environment wins (scripts/device/session.sh sets it from the carried
    ``.flowrl_commit``): the lent GPU machine's copy of the tree carries a stale .git, so git
    there names an old commit."""
    if os.environ.get("FLOWRL_COMMIT"):
        return os.environ["FLOWRL_COMMIT"] + " (FLOWRL_COMMIT)"
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
    """returncode; peak_rss_bytes: the child's maximum resident set size from ``wait4`` (per child,
    unlike ``RUSAGE_CHILDREN`` which is a max over every child so far; Linux folds the child's own
    reaped descendants in as a max, so it is the largest single process of that tree, never a sum);
    wall_s: seconds from spawn to exit; timed_out: killed at ``timeout_s``; monitor: the
    ``TreeMonitor`` peaks when one was given (else None)."""

    returncode: int
    peak_rss_bytes: int
    wall_s: float
    timed_out: bool = False
    monitor: Optional[dict] = None


class TreeMonitor:
    """Peak memory of a process and all its descendants, sampled every ``interval_s`` seconds in a
    thread: the sum of their RSS and of their PSS (proportional set size: shared pages split between
    the processes that map them, so a sum does not count shared libraries once per process), and the
    used memory of one GPU as NVML reports it (every process on the device, CUDA contexts included)
    and the part of it NVML charges to the tree's own processes (``gpu_tree_peak_bytes``).
    A sampled peak can miss a spike shorter than the interval.

    Args:
        interval_s: seconds between samples.
        gpu_index: NVML index of the GPU to watch; None = none (also when pynvml or a driver is
            missing: the GPU fields are then None).
        pss_every: read PSS (``/proc/<pid>/smaps``, costly) every this many samples; RSS every
            sample.
    """

    def __init__(self, interval_s: float = 0.25, gpu_index: Optional[int] = None,
                 pss_every: int = 8) -> None:
        self.interval_s = interval_s
        self.pss_every = max(1, pss_every)
        self.gpu_index = gpu_index
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._peaks = {"tree_rss_peak_bytes": 0, "tree_pss_peak_bytes": 0, "tree_procs_max": 0,
                       "gpu_used_peak_bytes": None, "gpu_used_start_bytes": None,
                       "gpu_tree_peak_bytes": None, "samples": 0}

    def _gpu_handle(self):
        if self.gpu_index is None:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            return pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
        except Exception:  # no nvidia-ml-py, no driver: GPU fields stay None
            return None

    @staticmethod
    def _tree_gpu_bytes(handle, pids: set[int]) -> Optional[int]:
        """Device memory NVML charges to the processes ``pids`` (None when NVML names none of them:
        e.g. a container whose pid namespace differs from the driver's, or no per-process
        accounting)."""
        import pynvml

        try:
            found = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                     if p.pid in pids and p.usedGpuMemory is not None]
        except Exception:  # NVML without per-process accounting
            return None
        return sum(found) if found else None

    def start(self, pid: int) -> None:
        import psutil

        handle = self._gpu_handle()
        if handle is not None:
            import pynvml

            self._peaks["gpu_used_start_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)

        def sample() -> None:
            try:
                root = psutil.Process(pid)
            except psutil.Error:
                return
            while not self._stop.is_set():
                try:
                    procs = [root, *root.children(recursive=True)]
                except psutil.Error:
                    break
                rss = pss = 0
                # PSS walks /proc/<pid>/smaps under the process's mmap lock (it can hold up the
                # measured process's own mmaps, e.g. cudaMalloc): read it every pss_every-th
                # sample only; RSS (statm) every sample
                full_read = self._peaks["samples"] % self.pss_every == 0
                for p in procs:
                    try:
                        if full_read:
                            full = p.memory_full_info()
                            rss, pss = rss + full.rss, pss + getattr(full, "pss", full.rss)
                        else:
                            rss += p.memory_info().rss
                    except psutil.Error:  # exited between the listing and the read
                        pass
                pk = self._peaks
                pk["tree_rss_peak_bytes"] = max(pk["tree_rss_peak_bytes"], rss)
                if full_read:
                    pk["tree_pss_peak_bytes"] = max(pk["tree_pss_peak_bytes"], pss)
                pk["tree_procs_max"] = max(pk["tree_procs_max"], len(procs))
                if handle is not None:
                    import pynvml

                    used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
                    pk["gpu_used_peak_bytes"] = max(pk["gpu_used_peak_bytes"] or 0, used)
                    tree = self._tree_gpu_bytes(handle, {q.pid for q in procs})
                    if tree is not None:
                        pk["gpu_tree_peak_bytes"] = max(pk["gpu_tree_peak_bytes"] or 0, tree)
                pk["samples"] += 1
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=sample, name="tree-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return dict(self._peaks)


def run_child(cmd: Sequence[str], env: Optional[Mapping[str, str]] = None,
              cwd: Optional[Path] = None, *, timeout_s: Optional[float] = None,
              monitor: Optional[TreeMonitor] = None) -> ChildResult:
    """Run ``cmd`` to completion (output goes to this process's stdout/stderr) and measure it.

    Linux reports ``ru_maxrss`` in KiB (macOS in bytes). With ``timeout_s`` the child runs in a
    session of its own and the whole session (its own children too) is SIGKILLed at the timeout;
    ``monitor`` is started on the child's pid and stopped when it exits.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None,
                            cwd=str(cwd) if cwd else None, start_new_session=timeout_s is not None)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout_s, kill) if timeout_s is not None else None
    if timer is not None:
        timer.start()
    if monitor is not None:
        monitor.start(proc.pid)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        kill() if timeout_s is not None else proc.kill()
        proc.wait()
        raise
    finally:
        if timer is not None:
            timer.cancel()
        peaks = monitor.stop() if monitor is not None else None
    proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait on a reaped pid
    scale = 1 if sys.platform == "darwin" else 1024
    return ChildResult(proc.returncode, usage.ru_maxrss * scale, time.perf_counter() - t0,
                       timed_out.is_set(), peaks)


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
