"""vLLM engine processes started ahead (``vllm_proc.start_ahead``): `flowrl train` spawns them as
soon as it accepts a run, so their imports run beside the machine check and the model load; the
engine build takes them; nothing started is left behind. No vLLM needed (the vLLM tier builds
real engines from them: tests/vllm_backend/test_vllm_proc.py, test_vllm_train.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.engines.rollout import vllm_proc

# a head size vLLM-CPU's kernel has (64 / 2 = 32): the run's checks refuse the tiny default's 16
HEADS = ["model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1"]


@pytest.fixture(autouse=True)
def _nothing_left():
    yield
    vllm_proc.discard_ahead()
    assert vllm_proc._AHEAD == []


def test_processes_started_ahead_are_taken_and_the_rest_stopped():
    cpu = torch.device("cpu")
    assert vllm_proc.start_ahead(2, cpu) == 2
    env = vllm_proc._child_env(cpu)
    first, second = (s.proc for s in vllm_proc._AHEAD)
    taken, ahead = vllm_proc._take(1, env)
    assert ahead == 1 and [s.proc for s in taken] == [first]
    assert [s.proc for s in vllm_proc._AHEAD] == [second]
    try:
        vllm_proc.discard_ahead()  # the engines are built: the one nobody took stops
        # closed when idle, terminated (SIGTERM) when still starting after DISCARD_GRACE_S
        assert not second.is_alive() and second.exitcode in (0, -15) and vllm_proc._AHEAD == []
        # the taken one did its imports and waits for its build; a bad one is answered, not hung
        conn = taken[0].conn
        conn.send(("build", None, None))
        assert conn.poll(120)
        reply = conn.recv()
        assert reply[0] == "error" and reply[1] in ("AttributeError", "ImportError", "ModuleNotFoundError")
        first.join(30)
        assert first.exitcode == 0
    finally:  # a failed assertion must not leave the taken process waiting for its build
        if first.is_alive():
            first.terminate()


class _Proc:
    def __init__(self, alive=True):
        self.alive = alive

    def is_alive(self):
        return self.alive


def test_take_uses_only_live_processes_of_the_same_environment(monkeypatch):
    spawned = []
    monkeypatch.setattr(vllm_proc, "_spawn", lambda env: spawned.append(env) or
                        vllm_proc._Spawned(None, _Proc(), env))
    gpu0, gpu1 = {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}
    dead = vllm_proc._Spawned(None, _Proc(alive=False), gpu0)
    other = vllm_proc._Spawned(None, _Proc(), gpu1)
    live = vllm_proc._Spawned(None, _Proc(), gpu0)
    vllm_proc._AHEAD[:] = [dead, other, live]
    got, ahead = vllm_proc._take(3, gpu0)
    assert ahead == 1 and got[0] is live and [s.env for s in got[1:]] == [gpu0, gpu0]
    assert spawned == [gpu0, gpu0]  # the rest started now
    assert vllm_proc._AHEAD == [dead, other]
    vllm_proc._AHEAD.clear()  # stand-ins: nothing to stop


def _spec(tmp_path, **over):
    from flowrl.train import prepare

    args = ["model=tiny", "trainer=smoke", "data.limit=8", "rollout=vllm", *HEADS,
            "rollout.vllm.engine_procs=2", f"hydra.run.dir={tmp_path / 'run'}"]
    return prepare(args + [f"{k}={v}" for k, v in over.items()])


def test_flowrl_train_starts_the_runs_engine_processes_ahead(monkeypatch, tmp_path):
    from flowrl import machine
    from flowrl import train as train_mod

    started: list = []
    monkeypatch.setattr(machine, "vllm_importable", lambda: True)
    monkeypatch.setattr(vllm_proc, "start_ahead", lambda n, device: started.append((n, device)))
    train_mod._start_ahead(_spec(tmp_path))
    assert started == [(2, torch.device("cpu"))]  # rollout.vllm.engine_procs=2
    started.clear()
    train_mod._start_ahead(_spec(tmp_path, **{"rollout.vllm.engine_procs": 0}))  # in process
    train_mod._start_ahead(_spec(tmp_path, **{"rollout": "hf"}))
    monkeypatch.setattr(machine, "vllm_importable", lambda: False)  # the check refuses the run
    train_mod._start_ahead(_spec(tmp_path))
    assert started == []


def test_a_refused_run_stops_what_was_started_ahead(monkeypatch, tmp_path):
    from flowrl import machine
    from flowrl import train as train_mod
    from flowrl.runtime.control.preflight import ConfigError

    monkeypatch.setattr(machine, "vllm_importable", lambda: True)
    seen: list = []

    def refuse(cfg):
        seen.extend(s.proc for s in vllm_proc._AHEAD)
        raise ConfigError("machine says no")

    monkeypatch.setattr(train_mod, "check_machine", refuse)
    monkeypatch.setattr(train_mod, "_hydra_job", lambda spec: pytest.fail("the job ran"))
    with pytest.raises(SystemExit) as e:
        train_mod.main(["model=tiny", "trainer=smoke", "data.limit=8", "rollout=vllm", *HEADS,
                        "rollout.vllm.engine_procs=1", f"trainer.output_dir={tmp_path / 'run'}"])
    assert e.value.code == 2
    assert len(seen) == 1 and seen[0].exitcode is not None  # started, then stopped
    assert vllm_proc._AHEAD == []


def test_no_engine_processes_ahead_for_a_rank_of_a_multi_process_job(monkeypatch):
    from flowrl import train as train_mod

    started: list = []
    monkeypatch.setattr(vllm_proc, "start_ahead", lambda n, d: started.append(n))
    monkeypatch.setattr("flowrl.runtime.step.resources.start_vllm_prefetch", lambda cfg, roles: [])
    monkeypatch.setenv("LOCAL_RANK", "0")
    spec = SimpleNamespace(config=SimpleNamespace(
        launcher=SimpleNamespace(distributed=True), rollout=SimpleNamespace(backend="vllm")),
        plan=SimpleNamespace(roles=["actor", "rollout"]))
    train_mod._start_ahead(spec)
    assert started == []


def test_no_engine_processes_ahead_without_a_usable_device(monkeypatch, tmp_path):
    # trainer.device=cuda on a machine without one: the machine check refuses the run in one
    # line; starting engines ahead must not raise first
    from flowrl import machine
    from flowrl import train as train_mod

    started: list = []
    monkeypatch.setattr(machine, "vllm_importable", lambda: True)
    monkeypatch.setattr(vllm_proc, "start_ahead", lambda n, d: started.append(n))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = _spec(tmp_path)
    spec.config.trainer.device = "cuda"
    train_mod._start_ahead(spec)
    assert started == []


def test_a_second_start_only_tops_up(monkeypatch):
    # flowrl train asks before the machine check and again inside its job: one set of processes
    spawned = []
    monkeypatch.setattr(vllm_proc, "_spawn", lambda env: spawned.append(env) or
                        vllm_proc._Spawned(None, _Proc(), env))
    cpu = torch.device("cpu")
    assert vllm_proc.start_ahead(2, cpu) == 2
    assert vllm_proc.start_ahead(2, cpu) == 0
    assert vllm_proc.start_ahead(3, cpu) == 1
    assert len(spawned) == 3 and len(vllm_proc._AHEAD) == 3
    vllm_proc._AHEAD.clear()  # stand-ins: nothing to stop


def _busy(conn):  # an engine process still importing: it reads no pipe for a long while
    import time as _time

    _time.sleep(60)


def test_an_unused_process_still_importing_is_terminated_after_the_grace():
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_busy, args=(child,))
    proc.start()
    t0 = time.monotonic()
    vllm_proc._shutdown([parent], [proc], None, grace_s=0.5)
    assert time.monotonic() - t0 < 10  # not the 60 s it would sleep
    assert not proc.is_alive() and proc.exitcode == -15  # SIGTERM
    assert vllm_proc.DISCARD_GRACE_S == 1.0
