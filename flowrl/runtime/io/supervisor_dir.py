"""The files the ranks of a ``flowrl train launcher.nproc=N`` job leave for the launcher
(``runtime/control/supervise.py``) in the private folder named by ``FLOWRL_SUPERVISOR_DIR`` in their
environment (none: nothing is written, e.g. under a plain ``torchrun``):

- ``run_dir``: rank 0's run directory (:func:`announce_run_dir`), for the resume command;
- ``silent_<rank>.json``: a rank whose heartbeat stopped (:func:`report_silent`, from the peer
  monitor of ``runtime/io/distributed.py``);
- ``peers_<rank>.json``: the last heartbeat a crashing rank saw of every peer
  (:func:`report_peers`, from ``runtime/control/recovery.report_crash``).

No torch, no other flowrl module: the runtime's lowest modules import it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

ENV = "FLOWRL_SUPERVISOR_DIR"


def _folder() -> Optional[Path]:
    d = os.environ.get(ENV)
    return Path(d) if d and Path(d).is_dir() else None


def _write(name: str, payload: Any) -> None:
    """Write ``name`` atomically into the supervisor's folder (no folder: nothing). Never
    raises: reporting must not turn into a second failure."""
    d = _folder()
    if d is None:
        return
    try:
        tmp = d / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(payload if isinstance(payload, str) else json.dumps(payload))
        os.replace(tmp, d / name)
    except OSError:
        pass


def announce_run_dir(path: str | Path) -> None:
    """Rank 0: the run directory the resume command names."""
    _write("run_dir", str(path))


def report_silent(rank: int, beat: Mapping[str, Any], quiet_s: float, limit_s: float) -> None:
    """A peer monitor found ``rank`` silent for ``quiet_s`` (>= ``limit_s``); ``beat``: its last
    heartbeat (``host``, ``pid``, ``step``; empty when it never sent one)."""
    _write(f"silent_{rank}.json", {"rank": rank, **beat, "quiet_s": quiet_s, "limit_s": limit_s})


def report_peers(beats: Mapping[int, Mapping[str, Any]]) -> None:
    """A crashing rank: the last heartbeat it saw of every peer (rank -> host/pid/step)."""
    _write(f"peers_{os.environ.get('RANK', 'x')}.json", {str(r): dict(b) for r, b in beats.items()})
