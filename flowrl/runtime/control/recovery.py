"""What a stopped run tells its operator: why it stopped and the one command that continues it.

``flowrl train`` ends every way but a clean finish or a rejected config (Ctrl-C, SIGTERM from
torchrun after another rank died, a dead or silent peer, a full disk, a diverged step) through
:func:`report_crash`: the traceback (not for Ctrl-C / SIGTERM), the ranks that stopped
heartbeating (``runtime/io/distributed.py``), the last complete checkpoint, and the
``trainer.resume=true`` command line. A SIGKILL of the only process cannot print anything; under
torchrun the surviving ranks print it.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Optional

from flowrl.errors import RunStopped


class Terminated(BaseException):
    """SIGTERM arrived (torchrun stopping the group, a scheduler's preemption): unwind, so the
    ``finally`` blocks run and the resume command is printed. BaseException, like
    KeyboardInterrupt, so no ``except Exception`` in user code swallows it."""


def _on_sigterm(signum, frame):  # pragma: no cover - runs in the signal handler
    raise Terminated()


def stop_on_sigterm() -> None:
    """Turn SIGTERM into :class:`Terminated` (main thread only; elsewhere a no-op)."""
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def last_checkpoint(out_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint of a run directory (no verification, no side effect)."""
    from flowrl.runtime.io.checkpoint import CheckpointManager

    done = CheckpointManager(Path(out_dir) / "checkpoints").complete()
    return done[-1] if done else None


def resume_hint(out_dir: str | Path, overrides: Optional[list[str]] = None) -> str:
    """The line that tells how to continue the run in ``out_dir`` or, before its first
    checkpoint, how to start it over (the run directory then refuses a plain fresh run, so the
    line says ``trainer.overwrite=true``, as ``runtime/io/rundir.resume_hint`` does after Ctrl-C).
    The command repeats this invocation's ``overrides`` (default: Hydra's, when a Hydra job
    runs; unknown: "plus your overrides"). Reads no checkpoint (a crash report must not fail on
    a tampered one)."""
    from flowrl.runtime.io.rundir import invocation_overrides, repeat_overrides

    overrides = invocation_overrides() if overrides is None else overrides
    rest = " (plus your overrides)" if overrides is None else "".join(
        f" {o}" for o in repeat_overrides(overrides))
    ckpt = last_checkpoint(out_dir)
    if ckpt is None:
        return (f"No checkpoint was written yet, so there is nothing to continue; start again "
                f"with: flowrl train hydra.run.dir={out_dir} trainer.overwrite=true{rest}")
    return (f"Continue from {ckpt.name} with: flowrl train hydra.run.dir={out_dir} "
            f"trainer.resume=true{rest}")


def disk_full(e: BaseException) -> Optional[str]:
    """One line for a write the disk refused (a checkpoint that does not fit, ENOSPC / EDQUOT
    from any writer: metrics, TensorBoard), else None. The 26-line traceback that came before
    the checkpoint's own clear message showed flowrl's internals, not the cause."""
    import errno

    from flowrl.runtime.io.checkpoint import CheckpointWriteError

    if isinstance(e, CheckpointWriteError):
        return " ".join(str(e).split()).rstrip(".")
    seen: set[int] = set()
    while e is not None and id(e) not in seen:  # the OSError may be the cause of another error
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" writing {e.filename}" if e.filename else ""
            return f"no space left on the device{where} ({e.strerror or 'ENOSPC'}): free space"
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return None


# how a collective reports a peer that went away (gloo's TCP pair; NCCL's watchdog / abort)
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Connection refused",
              "Broken pipe", "remote process exited", "NCCL communicator was aborted")


def peer_lost(e: BaseException) -> Optional[str]:
    """A clause for a collective that failed because another rank went away (the launcher's
    last line names which: ``runtime/control/supervise.py``), else None. The backend's text
    ("[../gloo/transport/tcp/pair.cc:534] Connection reset by peer [127.0.0.1]:41234") and a
    traceback into the collective name no rank and no cause."""
    if not isinstance(e, RuntimeError):  # DistBackendError, DistNetworkError are RuntimeErrors
        return None
    from flowrl.runtime.io.transport import PoolPeerError

    if isinstance(e, PoolPeerError):  # partitioned pools: it names the pool and rank itself
        return " ".join(str(e).split())
    text = str(e)
    hit = next((m for m in _PEER_LOST if m in text), None)
    if hit is None:
        return None
    backend = "gloo" if "gloo" in text else "NCCL" if "NCCL" in text else "the process group"
    return f"lost the connection to another rank ({backend}: {hit}): it died or was stopped"


def stop_on_silent_peer(out_dir: str | Path) -> None:
    """When the peer monitor finds a rank silent (``launcher.heartbeat_timeout_s``), print the
    crash line with the resume command and end this process at once (exit status 1): its main
    thread may be blocked in a collective that would wait for ``collective_timeout_s``."""
    from flowrl.runtime.io.distributed import PeerMonitor

    def stop(what: str) -> None:  # pragma: no cover - ends the process (the launcher's tests)
        import os

        print(f"\nflowrl train: stopped: {what}. {resume_hint(out_dir)}", file=sys.stderr,
              flush=True)
        os._exit(1)

    PeerMonitor.on_silent = stop


def report_crash(e: BaseException, out_dir: str | Path) -> int:
    """Print why the run stopped and how to continue it (stderr); returns the exit status
    (130 Ctrl-C, 143 SIGTERM, 1 anything else). A :class:`RunStopped` is one line (its
    message names what to change), anything else adds the traceback. SystemExit is re-raised
    unchanged. Also hands the launcher the last heartbeat seen of each peer
    (``runtime/control/supervise.report_peers``)."""
    import threading

    if isinstance(e, SystemExit):
        raise e

    if threading.current_thread() is not threading.main_thread():
        return _report_crash(e, out_dir)
    # torchrun SIGTERMs the survivors of a dead rank: let this report finish (its SIGKILL
    # follows after 30 s) instead of a second traceback from inside it
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return _report_crash(e, out_dir)
    finally:
        signal.signal(signal.SIGTERM, old)


def _report_crash(e: BaseException, out_dir: str | Path) -> int:
    from flowrl.runtime.io.distributed import PeerMonitor, peer_report
    from flowrl.runtime.io.supervisor_dir import report_peers

    if PeerMonitor.current is not None:  # for the launcher's line naming a dead peer
        report_peers(PeerMonitor.current.last_beats())
    if isinstance(e, KeyboardInterrupt):
        what, code = "interrupted", 130
    elif isinstance(e, Terminated):
        what, code = "stopped by SIGTERM", 143
    elif isinstance(e, RunStopped):  # the message says what to change; no internals
        what, code = f"stopped: {' '.join(str(e).split()).rstrip('.')}", 1
    elif disk_full(e) is not None:  # the file system, not flowrl: no traceback either
        what, code = f"stopped: {disk_full(e)}", 1
    elif peer_lost(e) is not None:  # another rank's end, not this one's error: no traceback
        what, code = f"stopped: {peer_lost(e)}", 1
    else:
        traceback.print_exception(e)
        first = (str(e).strip().splitlines() or [""])[0][:500].rstrip(".")
        what, code = f"stopped by {type(e).__name__}: {first}", 1
    from flowrl.runtime.io.supervisor_dir import ENV as SUPERVISOR_ENV

    if isinstance(e, (KeyboardInterrupt, Terminated)) and os.environ.get(SUPERVISOR_ENV):
        # a rank of `flowrl train launcher.nproc=N`: Ctrl-C reaches every rank and the launcher,
        # which says it once, last (runtime/control/supervise.py)
        return code
    peers = peer_report()
    print(f"\nflowrl train: {what}." + (f" {peers}." if peers else "") +
          f" {resume_hint(out_dir)}", file=sys.stderr, flush=True)
    return code
