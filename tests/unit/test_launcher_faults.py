"""A dead or frozen rank ends a ``launcher.nproc=2`` job with a last line naming the rank (its
number, pid, exit signal or silence) and the resume command (issue 27): torchrun's agent runs
in the launcher process (``runtime/control/supervise.py``), the ranks' peer monitors stop the job
once a heartbeat is silent for ``launcher.heartbeat_timeout_s``."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrl.runtime.control.supervise import Failure, root_cause

REPO = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()


def test_the_heartbeat_timeout_is_a_launcher_setting():
    from flowrl.config import LauncherConfig
    from flowrl.runtime.io.distributed import PeerMonitor

    assert LauncherConfig().heartbeat_timeout_s == 60.0
    with pytest.raises(ValueError, match="launcher.heartbeat_timeout_s must be > 0, got 0"):
        LauncherConfig(heartbeat_timeout_s=0)
    mon = PeerMonitor(None, 0, 2, timeout_s=600.0, heartbeat_timeout_s=LauncherConfig().heartbeat_timeout_s)
    assert (mon.stale_s, mon.interval_s) == (60.0, 5.0)
    mon = PeerMonitor(None, 0, 2, timeout_s=600.0, heartbeat_timeout_s=10.0)
    assert (mon.stale_s, mon.interval_s) == (10.0, 2.0)
    mon = PeerMonitor(None, 0, 2, timeout_s=8.0, heartbeat_timeout_s=10.0)  # capped at T / 2
    assert (mon.stale_s, mon.interval_s) == (4.0, 0.8)


def test_a_rank_that_finished_is_never_silent(peer_pair):
    a, b = peer_pair
    b.stop()  # rank 1 finished; rank 0 still writes its last checkpoint
    assert [a.check(float(t)) for t in range(2, 30, 2)] == [{}] * 14
    assert a.report() == ""


def test_root_cause_names_the_rank_that_died_not_the_survivor():
    beats = {1: {"host": "n1", "pid": 41, "step": 3}}
    failures = {0: Failure(0, 40, 1), 1: Failure(1, 41, -9)}
    assert root_cause(failures, {}, beats, set()) == (
        "rank 1 (host n1, pid 41, last at step 3) died of SIGKILL (exit code -9: killed from "
        "outside, e.g. kill -9 or the OOM killer, or crashed); the other ranks were stopped")
    # torchrun's own SIGTERM of the survivors is never the cause
    assert root_cause({0: Failure(0, 40, -15), 1: Failure(1, 41, -11)}, {}, {}, set()) == (
        "rank 1 (pid 41) died of SIGSEGV (exit code -11: killed from outside, e.g. kill -9 or "
        "the OOM killer, or crashed); the other ranks were stopped")
    # a dead rank is silent too once the heartbeat timeout passed: still named as dead
    silent = {1: {"host": "n1", "pid": 41, "step": 3, "quiet_s": 4.0, "limit_s": 3.0}}
    assert root_cause(failures, silent, beats, set()) == root_cause(failures, {}, beats, set())
    assert root_cause({0: Failure(0, 40, -15), 1: Failure(1, 41, 1)}, {}, {}, set()) == (
        "rank 1 (pid 41) exited with status 1 (its error is above)")


def test_root_cause_names_the_silent_rank_before_the_one_that_reported_it():
    silent = {1: {"host": "n1", "pid": 41, "step": 2, "quiet_s": 60.4, "limit_s": 60.0}}
    failures = {0: Failure(0, 40, 1), 1: Failure(1, 41, -9)}
    assert root_cause(failures, silent, {}, {1}) == (
        "rank 1 (host n1, pid 41, last at step 2) sent no heartbeat for 60 s (frozen by SIGSTOP, "
        "or stuck outside Python; launcher.heartbeat_timeout_s=60); the launcher killed it "
        "(SIGKILL)")


def _checkpoint(run: Path, step: int) -> None:
    d = run / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text('{"step": %d}' % step)
    (d / ".metadata").write_bytes(b"")


def _supervised(tmp_path: Path, mode: str) -> tuple[int, str, float]:
    run = tmp_path / "run"
    _checkpoint(run, 2)
    code = ("import sys; from flowrl.runtime.control.supervise import supervise; sys.exit(supervise("
            f"['--standalone', '--nproc_per_node=2', {str(REPO / 'tests/distributed/fault_worker.py')!r}, "
            f"{mode!r}, {str(run)!r}], ['launcher.nproc=2', 'hydra.run.dir={run}', 'model=tiny']))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=120)
    return proc.returncode, proc.stderr, time.monotonic() - t0


def _last_line(err: str) -> str:
    return [ln for ln in err.splitlines() if ln.strip()][-1]


def _resume(run: Path) -> str:
    return (f"Continue from step_000002 with: flowrl train hydra.run.dir={run} "
            "trainer.resume=true launcher.nproc=2 model=tiny")


@pytest.mark.slow  # three processes import torch: ~20 s on 2 loaded cores
def test_a_dead_rank_ends_the_job_naming_it_and_the_resume_command(tmp_path):
    rc, err, _ = _supervised(tmp_path, "dead")
    line = _last_line(err)
    assert rc == 1
    pid = re.search(r"rank 1 \(host [^,]+, pid (\d+), last at step 3\) died of SIGKILL", line)
    assert pid, line
    assert line == (f"flowrl train: stopped: rank 1 (host {HOST}, pid {pid.group(1)}, last at "
                    "step 3) died of SIGKILL (exit code -9: killed from outside, e.g. kill -9 or "
                    f"the OOM killer, or crashed); the other ranks were stopped. "
                    f"{_resume(tmp_path / 'run')}")
    # the survivor's own line (unless torchrun's SIGTERM came first): no gloo traceback
    assert ("flowrl train: stopped: lost the connection to another rank (gloo: " in err
            or "flowrl train: stopped by SIGTERM." in err)
    assert "Traceback" not in err


@pytest.mark.slow  # three processes import torch: ~20 s on 2 loaded cores
def test_a_frozen_rank_stops_the_job_at_the_heartbeat_timeout(tmp_path):
    rc, err, took = _supervised(tmp_path, "frozen")
    line = _last_line(err)
    assert rc == 1
    m = re.search(r"rank 1 \(host [^,]+, pid (\d+), last at step 3\) sent no heartbeat for (\d+) s",
                  line)
    assert m, line
    assert line == (f"flowrl train: stopped: rank 1 (host {HOST}, pid {m.group(1)}, last at step "
                    f"3) sent no heartbeat for {m.group(2)} s (frozen by SIGSTOP, or stuck outside "
                    "Python; launcher.heartbeat_timeout_s=3); the launcher killed it (SIGKILL). "
                    f"{_resume(tmp_path / 'run')}")
    assert 3 <= int(m.group(2)) <= 5
    # stopped by the heartbeat, not torchrun's 30 s SIGTERM grace nor the 120 s collective timeout
    assert took < 60, took
    with pytest.raises(ProcessLookupError):
        os.kill(int(m.group(1)), 0)  # the frozen rank is gone
