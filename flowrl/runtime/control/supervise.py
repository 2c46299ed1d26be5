"""The launcher process of ``flowrl train launcher.nproc=N``: torchrun's own agent
(``torch.distributed.run``, not a home-made launcher) run in this process, so that a failed job
ends with the lines that matter instead of a peer's ``Connection reset by peer``: which rank died
or went silent (rank, pid, host, exit signal, last step) and the command that continues the run.

    flowrl train launcher.nproc=2 model=tiny trainer=smoke
      == torchrun --standalone --nproc_per_node=2 -m flowrl.train launcher.nproc=2 model=tiny \
             trainer=smoke

Multi-node: the same command on every node (``launcher.nnodes``, ``launcher.rdzv_endpoint``,
``launcher.rdzv_id``: torchrun's c10d rendezvous pairs them up; on Slurm ``sbatch
scripts/slurm.sbatch``), with a ``trainer.output_dir`` every node sees (DCP checkpoints are
written by all ranks into one folder).

The ranks talk to it through files in a private folder (``FLOWRL_SUPERVISOR_DIR`` in their
environment; nothing is written without it, e.g. under a plain ``torchrun``):

``runtime/io/supervisor_dir.py`` writes them: rank 0's run directory (for the resume command), a
rank whose heartbeat stopped (this process then SIGKILLs it when it is one of its own workers: a
SIGSTOPped process ignores the SIGTERM torchrun sends first, and torchrun waits 30 s before its
SIGKILL), and the last heartbeat a crashing rank saw of every peer (the host and step of a rank
that died).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from flowrl.runtime.io.supervisor_dir import ENV
from flowrl.runtime.step.resources import COMMAND_START_ENV, since_launch_s

if TYPE_CHECKING:
    from flowrl.config import LauncherConfig


@dataclass
class Failure:
    """One worker's end as torchrun saw it (``ProcessFailure``): exitcode < 0 is -signal."""

    rank: int
    pid: int
    exitcode: int

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


# the signals torchrun stops the rest of a failed group with (SIGKILL only after a grace period)
_STOPPED_BY_TORCHRUN = (signal.SIGTERM, signal.SIGINT)


def root_cause(failures: Mapping[int, Failure], silent: Mapping[int, Mapping[str, Any]],
               beats: Mapping[int, Mapping[str, Any]], killed: set[int]) -> str:
    """The clause naming why the group failed, from what torchrun saw (``failures``: global
    rank -> Failure), the silent ranks the peer monitors reported, the last heartbeats a
    crashing rank saw (``beats``) and the ranks this process killed (``killed``: silent ones).

    Order: a silent rank this process killed or that is still alive (the others' errors follow
    from it); a rank killed by a signal other than the SIGTERM/SIGINT torchrun stops the group
    with (kill -9, the OOM killer, a segfault; silent too by then, but dead, not frozen);
    the rank that exited with an error first (lowest rank among equals); any failure."""
    def where(rank: int, pid: Optional[int]) -> str:
        b = {**beats.get(rank, {}), **silent.get(rank, {})}
        parts = [f"pid {pid if pid is not None else b.get('pid', '?')}"]
        if b.get("host"):
            parts.insert(0, f"host {b['host']}")
        if b.get("step") is not None:
            parts.append(f"last at step {b['step']}")
        return f"rank {rank} ({', '.join(parts)})"

    by_signal = [f for f in failures.values()
                 if f.exitcode < 0 and -f.exitcode not in [s.value for s in _STOPPED_BY_TORCHRUN]
                 and f.rank not in killed]
    for r in sorted(silent):
        s = silent[r]
        f = failures.get(r)
        if f in by_signal:  # silent because it died (not a SIGSTOP this process ended)
            continue
        end = ("; the launcher killed it (SIGKILL)" if r in killed
               else f"; it ended by {f.signal_name}" if f is not None and f.exitcode < 0
               else f"; it exited with status {f.exitcode}" if f is not None else "")
        return (f"{where(r, f.pid if f else s.get('pid'))} sent no heartbeat for "
                f"{s.get('quiet_s', 0):.0f} s (frozen by SIGSTOP, or stuck outside Python; "
                f"launcher.heartbeat_timeout_s={s.get('limit_s', 0):g}){end}")
    if by_signal:
        f = min(by_signal, key=lambda x: x.rank)
        return (f"{where(f.rank, f.pid)} died of {f.signal_name} (exit code {f.exitcode}: killed "
                f"from outside, e.g. kill -9 or the OOM killer, or crashed); the other ranks "
                f"were stopped")
    errors = [f for f in failures.values() if f.exitcode > 0]
    if errors:
        f = min(errors, key=lambda x: x.rank)
        return f"{where(f.rank, f.pid)} exited with status {f.exitcode} (its error is above)"
    if failures:
        f = min(failures.values(), key=lambda x: x.rank)
        return f"{where(f.rank, f.pid)} ended by {f.signal_name}"
    return "the worker group failed"


class _Watcher(threading.Thread):
    """SIGKILLs each worker of this process a peer monitor reports silent (polls the folder)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(name="flowrl-supervisor", daemon=True)
        self.folder, self.done = folder, threading.Event()
        self.killed: set[int] = set()

    def run(self) -> None:
        import psutil

        while not self.done.wait(0.2):
            for path in self.folder.glob("silent_*.json"):
                rank = int(path.stem.split("_", 1)[1])
                if rank in self.killed:
                    continue
                try:
                    info = json.loads(path.read_text())
                    pid = int(info["pid"])
                    ours = info.get("host") in (None, socket.gethostname()) and \
                        psutil.Process(pid).ppid() == os.getpid()
                except (OSError, ValueError, KeyError, TypeError, psutil.Error):
                    continue
                self.killed.add(rank)
                if ours:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def torchrun_args(cfg: "LauncherConfig", overrides: list[str]) -> list[str]:
    """torchrun's arguments (its argv without the program) that run ``python -m flowrl.train
    <overrides>`` on ``cfg``'s processes: ``--standalone`` on one node (a free local port),
    else the c10d rendezvous of ``cfg``."""
    args = [f"--nproc_per_node={cfg.nproc}"]
    if cfg.nnodes == 1:
        args.append("--standalone")
    else:
        args += [f"--nnodes={cfg.nnodes}", f"--rdzv_backend={cfg.rdzv_backend}",
                 f"--rdzv_endpoint={cfg.rdzv_endpoint}", f"--rdzv_id={cfg.rdzv_id}"]
        if cfg.node_rank is not None:
            args.append(f"--node_rank={cfg.node_rank}")
    if cfg.max_restarts:
        args.append(f"--max_restarts={cfg.max_restarts}")
    return args + ["-m", "flowrl.train", *overrides]


def supervise(args: list[str], overrides: list[str]) -> int:
    """Run ``torchrun <args>`` (its argv without the program: :func:`torchrun_args`) in this
    process; returns the exit status (0, or 1 with the ``flowrl train: stopped: ...`` line and
    the resume command on stderr once the group failed)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from flowrl.runtime.control.recovery import resume_hint

    with tempfile.TemporaryDirectory(prefix="flowrl-supervisor-") as tmp:
        folder = Path(tmp)
        os.environ[ENV] = tmp  # the workers inherit it
        # and the command's start, so a rank's "since the command started" counts from it
        os.environ[COMMAND_START_ENV] = f"{time.time() - since_launch_s():.3f}"
        watcher = _Watcher(folder)
        watcher.start()
        # the hint names the run directory itself; Hydra's own overrides are not the job's
        repeat = [o for o in overrides if not o.lstrip("+~").startswith("hydra.run.dir=")]
        try:
            run(parse_args(args))
            return 0
        except SignalException as e:
            # Ctrl-C (or a SIGTERM) reached torchrun's agent, which stopped the ranks: one line,
            # the job's last (the ranks leave theirs to this process), not the agent's traceback
            run_dir = (folder / "run_dir").read_text().strip() if (folder / "run_dir").is_file() \
                else None
            what = "interrupted" if e.sigval == signal.SIGINT else f"stopped by {e.sigval.name}"
            hint = resume_hint(run_dir, repeat) if run_dir else \
                "No run directory was created yet: nothing to continue."
            print(f"\nflowrl train: {what}. {hint}", file=sys.stderr, flush=True)
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            failures = {int(r): Failure(int(r), int(f.pid), int(f.exitcode))
                        for r, f in e.failures.items()}
            cause = failure_message(folder, failures, watcher.killed)
            run_dir = (folder / "run_dir").read_text().strip() if (folder / "run_dir").is_file() \
                else None
            hint = resume_hint(run_dir, repeat) if run_dir else \
                "No run directory was created yet: nothing to continue."
            print(f"\nflowrl train: stopped: {cause}. {hint}", file=sys.stderr, flush=True)
            return 1
        finally:
            watcher.done.set()
            os.environ.pop(ENV, None)
            os.environ.pop(COMMAND_START_ENV, None)


def failure_message(folder: Path, failures: Mapping[int, Failure], killed: set[int]) -> str:
    """:func:`root_cause` of what the ranks left in ``folder``."""
    silent = {int(p.stem.split("_", 1)[1]): _read_json(p) for p in folder.glob("silent_*.json")}
    beats: dict[int, dict] = {}
    for p in sorted(folder.glob("peers_*.json")):
        for r, b in _read_json(p).items():
            beats.setdefault(int(r), b)
    return root_cause(failures, silent, beats, killed)
