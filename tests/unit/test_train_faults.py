"""Training under faults (issue 15): the post-step parameter guard, the configurable collective
timeout, the peer monitor that names a frozen rank, and the resume command after any crash."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_engines import _train_batch, tiny_llama, token_mean_loss

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.guard import ParameterDivergenceError
from flowrl.engines.train.local import LocalTrainEngine

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ 4. post-step guard
def test_an_exploding_step_stops_with_a_clear_error():
    """lr=1e30 leaves finite weights ~1e30 after one AdamW step: caught right after it."""
    batch = _train_batch()
    eng = LocalTrainEngine(tiny_llama(), TrainEngineConfig(lr=1e30, micro_batch_size=2))
    with pytest.raises(ParameterDivergenceError,
                       match=r"grew from .* to 1e\+30, more than trainer.engine.max_param_growth"
                             r"=10x in one step \(lr=1e\+30\).*lower trainer.engine.lr"):
        eng.train_step(batch, token_mean_loss(batch), 1.0)


def test_non_finite_parameters_after_a_step_stop_the_run():
    batch = _train_batch()
    eng = LocalTrainEngine(tiny_llama(), TrainEngineConfig(lr=float("inf"), micro_batch_size=2,
                                                           max_param_growth=0))
    with pytest.raises(ParameterDivergenceError, match="no longer finite"):
        eng.train_step(batch, token_mean_loss(batch), 1.0)


def test_a_healthy_step_passes_the_guard():
    batch = _train_batch()
    eng = LocalTrainEngine(tiny_llama(), TrainEngineConfig(lr=1e-3, micro_batch_size=2))
    before = [p.detach().clone() for p in eng.model.parameters()]
    assert eng.train_step(batch, token_mean_loss(batch), 1.0)["skipped"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, eng.model.parameters()))


# ------------------------------------------------------------------ 8. collective timeout
def test_the_collective_timeout_is_a_launcher_setting_passed_to_the_process_group(tmp_path,
                                                                                   monkeypatch):
    from flowrl.config import LauncherConfig, compose
    from flowrl.runtime.io import distributed as fdist
    from flowrl.train import train

    assert LauncherConfig().collective_timeout_s == 600.0
    with pytest.raises(ValueError, match="collective_timeout_s must be > 0"):
        LauncherConfig(collective_timeout_s=0)
    seen = {}

    class Stop(Exception):
        pass

    def init(device, *, timeout_s, heartbeat_timeout_s):
        seen["timeout_s"], seen["heartbeat_timeout_s"] = timeout_s, heartbeat_timeout_s
        raise Stop
    monkeypatch.setattr(fdist, "init_distributed", init)
    with pytest.raises(Stop):
        train(compose(["model=tiny", f"trainer.output_dir={tmp_path}",
                       "launcher.collective_timeout_s=42", "launcher.heartbeat_timeout_s=7"]))
    assert (seen["timeout_s"], seen["heartbeat_timeout_s"]) == (42.0, 7.0)


def test_init_distributed_uses_the_timeout(monkeypatch):
    from flowrl.runtime.io import distributed as fdist

    captured = {}
    monkeypatch.setattr(fdist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(fdist.dist, "init_process_group",
                        lambda **kw: captured.update(kw))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(fdist, "dist_info", lambda: fdist.DistInfo())
    fdist.init_distributed("cpu", timeout_s=42.0, heartbeat_timeout_s=60.0)
    assert captured["timeout"] == datetime.timedelta(seconds=42)
    from flowrl.config import LauncherConfig

    fdist.init_distributed("cpu", timeout_s=LauncherConfig().collective_timeout_s,
                           heartbeat_timeout_s=LauncherConfig().heartbeat_timeout_s)
    assert captured["timeout"] == datetime.timedelta(seconds=600)  # LauncherConfig's default


def test_the_peer_monitor_names_the_rank_that_stopped_heartbeating():
    from torch.distributed import TCPStore

    from flowrl.runtime.io.distributed import PeerMonitor, mark_step, peer_report

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
    mons = [PeerMonitor(master, r, 3, timeout_s=20.0, heartbeat_timeout_s=60.0) for r in range(3)]  # stale after 10 s
    assert (mons[0].interval_s, mons[0].stale_s) == (2.0, 10.0)
    mark_step(5)
    t = 1000.0
    for m in mons:
        m._last_check = t
        m.beat()
    assert mons[0].check(t) == {}
    reports = {}
    for dt in (2.0, 4.0, 6.0, 8.0, 10.0, 12.0):  # rank 2 is frozen: it beats no more
        mons[0].beat()
        mons[1].beat()
        reports[dt] = mons[0].check(t + dt)
    assert [dt for dt, new in reports.items() if new] == [10.0]  # once, at stale_s
    assert list(mons[0].stale) == [2]
    assert reports[10.0][2] == (f"rank 2 (host {os.uname().nodename}, pid {os.getpid()}, last "
                                "at step 5) sent no heartbeat for 10 s")
    PeerMonitor.current = mons[0]
    try:
        assert peer_report().startswith("rank 2 (host")
    finally:
        PeerMonitor.current = None
    mons[2].beat()  # it came back (SIGCONT): no longer reported
    assert mons[0].check(t + 14.0) == {} and mons[0].stale == {}


def test_a_held_up_monitor_gives_no_verdict(peer_pair):
    """The monitor thread itself starved (e.g. the GIL held for long): it cannot tell a frozen
    peer from its own delay, so it restarts the clock instead of reporting."""
    a, b = peer_pair
    assert a.check(30.0) == {}  # 30 s since the last check > stale_s / 2: no verdict
    assert [a.check(30.0 + dt) != {} for dt in (2, 4, 6, 8, 10)] == [False] * 4 + [True]


# ------------------------------------------------------------------ 9. the resume command
def _checkpoint_dir(tmp_path: Path, step: int) -> None:
    d = tmp_path / "checkpoints" / f"step_{step:06d}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text('{"step": %d}' % step)
    (d / ".metadata").write_bytes(b"")


@pytest.mark.parametrize("exc, code, what", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), 1,
     "stopped by RuntimeError: CUDA error: an illegal memory access was encountered"),
    # another rank's death, not this rank's error: one line, no traceback into the collective
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:4242"), 1,
     "stopped: lost the connection to another rank (gloo: Connection closed by peer): it died "
     "or was stopped."),
    (OSError(28, "No space left on device", "/run/metrics.jsonl"), 1, "stopped: no space left on "
     "the device writing /run/metrics.jsonl (No space left on device): free space."),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_every_crash_prints_the_resume_command(tmp_path, capsys, exc, code, what):
    from flowrl.runtime.control.recovery import Terminated, report_crash

    _checkpoint_dir(tmp_path, 2)
    _checkpoint_dir(tmp_path, 4)
    assert report_crash(exc, tmp_path) == code
    err = capsys.readouterr().err
    assert f"flowrl train: {what}" in err
    assert (f"Continue from step_000004 with: flowrl train "
            f"hydra.run.dir={tmp_path} trainer.resume=true") in err
    # a full disk is the file system's, not flowrl's: nothing is printed before the one line
    # (issue 27); an unknown error keeps its exception text (and traceback) before it
    assert bool(err.split("flowrl train:")[0].strip()) == ("CUDA" in str(exc))
    assert report_crash(Terminated(), tmp_path / "empty") == 143
    # before any checkpoint the directory refuses a plain fresh run: the hint says overwrite
    assert (f"No checkpoint was written yet, so there is nothing to continue; start again with: "
            f"flowrl train hydra.run.dir={tmp_path / 'empty'} trainer.overwrite=true") in capsys.readouterr().err


def moving_reward_graph(tmp_path: Path) -> Path:
    """graphs/grpo.yaml with a deterministic user reward that varies with the response (the
    random tiny model scores 0 on GSM8K, so its advantages, and updates, would all be 0)."""
    import yaml

    (tmp_path / "fault_reward.py").write_text(
        "def length_reward(response_text, fields, metadata):\n"
        "    return (len(response_text) % 5) / 4.0\n")
    g = yaml.safe_load((REPO / "graphs/grpo.yaml").read_text())
    reward = next(s for s in g["stages"] if s["name"] == "reward")
    reward.update(op="reward.function", params={"path": "fault_reward:length_reward"})
    reward["inputs"]["group_id"] = "sample.group_id"
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(g, sort_keys=False))
    return path


def test_a_diverged_run_stops_at_step_one_with_the_guard_message_and_the_resume_command(tmp_path):
    """lr=1e30 end to end: before the guard, step 2 died inside HF generate ("probability
    tensor contains either inf, nan"); now step 1 stops the run, no checkpoint holds the bad
    weights, and the message says what to change and how to continue."""
    graph = moving_reward_graph(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl.train", "model=tiny", "trainer=smoke", "data.limit=16",
         f"graph.path={graph}", "logger.progress=false", "logger.tensorboard=false",
         "trainer.eval.before=false", "trainer.eval.after=false", "trainer.engine.lr=1e30",
         "trainer.total_steps=3", f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tmp_path)})
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert "ParameterDivergenceError" in err and "lower trainer.engine.lr" in err
    assert "probability tensor" not in err
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("flowrl train: stopped by ParameterDivergenceError") and \
        "No checkpoint was written yet" in last and "trainer.overwrite=true" in last
    assert not list((run_dir / "checkpoints").glob("step_*"))


def test_a_checkpoint_that_does_not_fit_is_one_line_without_a_traceback(tmp_path, capsys):
    """Issue 27: the disk-full message came after a 26-line traceback (report_crash printed one
    for every error that is not a RunStopped)."""
    from flowrl.runtime.control.recovery import report_crash
    from flowrl.runtime.io.checkpoint import CheckpointWriteError

    _checkpoint_dir(tmp_path, 1)
    msg = ("checkpoint step 2 not saved: the file system at /mnt (tmpfs, tmpfs) has 46.9 MiB "
           "free, this checkpoint needs about 77.5 MiB. Nothing was written.")
    assert report_crash(CheckpointWriteError(msg), tmp_path) == 1
    assert [ln for ln in capsys.readouterr().err.splitlines() if ln] == [
        f"flowrl train: stopped: {msg[:-1]}. Continue from step_000001 with: flowrl train "
        f"hydra.run.dir={tmp_path} trainer.resume=true (plus your overrides)"]
