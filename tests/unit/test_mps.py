"""launcher.mps: when a job starts a CUDA MPS daemon of its own, and what that daemon's life is.

The decision is a function of the config and of facts gathered from the machine; the daemon is
started with a stand-in ``nvidia-cuda-mps-control`` (a script recording how it was called), since
no machine here has the real one."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flowrl.config import compose, to_train_config
from flowrl.runtime.control import mps
from flowrl.runtime.control.preflight import ConfigError

REPO = Path(__file__).resolve().parents[2]
GPU = mps.MPSFacts(control="/usr/bin/nvidia-cuda-mps-control", compute_mode="Default",
                   device_memory=80 << 30, cuda_initialized=False, own_daemon=False,
                   vllm_installed=True)


def cfg_of(*overrides: str):
    return to_train_config(compose(["model=tiny", "trainer=smoke", "trainer.output_dir=/nonexistent",
                                    *overrides]))


def test_auto_starts_only_for_two_or_more_engine_processes(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = cfg_of()
    d = mps.decide(cfg, GPU, lambda: 4)
    assert (d.start, d.value) == (True, "true") and d.why.startswith("4 vLLM engine process(es)")
    one = mps.decide(cfg, GPU, lambda: 1)
    assert (one.start, one.value, one.why) == (
        False, "false", "one vLLM engine process: nothing shares the GPU during a generate")
    inproc = mps.decide(cfg, GPU, lambda: 0)
    assert not inproc.start and inproc.why.startswith("no engine process: the vLLM engine runs in")
    # an overlapped run: its one engine process generates beside the update
    lag = mps.decide(cfg_of("placement.staleness=1"), GPU, lambda: 1)
    assert lag.start


@pytest.mark.parametrize("overrides, facts, why", [
    (["launcher.nproc=2"], {}, "the job runs 2 process(es) on 1 node(s): flowrl starts MPS for "
                               "one-process jobs only (multi-rank jobs under MPS are untested)"),
    (["trainer.device=cpu"], {}, "trainer.device=cpu"),
    ([], {"control": None}, "no nvidia-cuda-mps-control on PATH (NVIDIA's driver utilities)"),
    ([], {"compute_mode": None, "control": None}, "no NVIDIA GPU visible (nvidia-smi reports none)"),
    ([], {"compute_mode": "Exclusive_Process"}, "the GPU's compute mode is Exclusive_Process; a "
                                                "job's own daemon needs Default (nvidia-smi -c DEFAULT)"),
    ([], {"cuda_initialized": True}, "CUDA was initialised in this process before the job started "
                                     "(a context made before the daemon never joins it): call "
                                     "flowrl.train.train before any CUDA call"),
    (["rollout=hf"], {}, "no vLLM engine processes beside the trainer"),
    (["rollout.vllm.engine_procs=0"], {}, "no vLLM engine processes beside the trainer"),
    ([], {"vllm_installed": False}, "no vLLM engine processes beside the trainer"),
])
def test_auto_says_why_it_starts_none(monkeypatch, overrides, facts, why):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    asked = []
    d = mps.decide(cfg_of(*overrides), mps.MPSFacts(**{**GPU.__dict__, **facts}),
                   lambda: asked.append(1) or 4)
    assert (d.start, d.value, d.why) == (False, "false", why)
    assert asked == []  # the graph and model are read only when the decision gets that far


@pytest.mark.parametrize("overrides, facts, line", [
    (["launcher.nproc=2"], {}, "launcher.mps=true: the job runs 2 process(es) on 1 node(s)"),
    ([], {"control": None}, "launcher.mps=true: no nvidia-cuda-mps-control on PATH"),
    ([], {"compute_mode": "Prohibited"}, "launcher.mps=true: the GPU's compute mode is Prohibited"),
    ([], {"cuda_initialized": True}, "launcher.mps=true: CUDA was initialised in this process"),
])
def test_true_is_refused_where_it_cannot_be_had(monkeypatch, overrides, facts, line):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(mps.MPSError) as e:
        mps.decide(cfg_of("launcher.mps=true", *overrides), mps.MPSFacts(**{**GPU.__dict__, **facts}),
                   lambda: 4)
    assert str(e.value).startswith(line)
    # even with one engine in process, true is honoured where it can be
    assert mps.decide(cfg_of("launcher.mps=true"), GPU, lambda: 0).start


def test_a_daemon_of_the_users_own_is_joined_and_false_is_false(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    d = mps.decide(cfg_of(), mps.MPSFacts(**{**GPU.__dict__, "own_daemon": True}), lambda: 4)
    assert (d.start, d.value) == (False, "yours")
    assert mps.decide(cfg_of("launcher.mps=false"), GPU, lambda: 4).start is False
    with pytest.raises(ValueError, match=r"launcher.mps must be one of \('auto', 'true', 'false'\), got 'sometimes'"):
        cfg_of("launcher.mps=sometimes")


def test_engine_processes_expected_follow_the_engine_builds_rule():
    """The count auto reads before the model loads is VLLMRolloutConfig.engine_procs_for's, on the
    model's config: the tiny model is small, so 4 engines at 64+ sequences per engine and decode
    step; 64 sequences per step (8 prompts x 8) keep one engine, in process."""
    big = cfg_of("trainer.prompts_per_step=32", "algorithm.n=8")
    assert mps.engine_procs_expected(big, 80 << 30) == 4
    small = cfg_of("trainer.prompts_per_step=8", "algorithm.n=8")
    assert mps.engine_procs_expected(small, 80 << 30) == 0
    # overlapped: the engine gets a process of its own even when one is enough
    assert mps.engine_procs_expected(cfg_of("trainer.prompts_per_step=8", "algorithm.n=8",
                                            "placement.staleness=1"), 80 << 30) == 1
    assert mps.engine_procs_expected(cfg_of("rollout.vllm.engine_procs=3"), 80 << 30) == 3
    # a graph file that does not load: unknown (the run's own checks then say why)
    assert mps.engine_procs_expected(cfg_of("graph.path=/nonexistent.yaml"), 80 << 30) is None


def test_prepare_refuses_true_in_one_line_on_a_machine_without_mps(tmp_path, monkeypatch):
    """flowrl train launcher.mps=true where the driver's MPS tool is missing: a ConfigError naming
    the field, raised before the machine defaults (nothing of CUDA touched)."""
    from flowrl.train import prepare

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control, no nvidia-smi
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ConfigError, match=r"^launcher.mps=true: no NVIDIA GPU visible \(nvidia-smi "
                                          r"reports none\)$"):
        prepare(["model=tiny", "trainer=smoke", "launcher.mps=true", f"hydra.run.dir={tmp_path / 'r'}"])
    # auto on a machine without a GPU: nothing started, nothing said
    spec = prepare(["model=tiny", "trainer=smoke", "data.limit=8", "trainer.eval.limit=0",
                    f"hydra.run.dir={tmp_path / 'r2'}"])
    assert not any(r.field == "launcher.mps" for r in spec.resolved)
    assert mps.PIPE_ENV not in os.environ


FAKE_CONTROL = """#!/bin/sh
# stands in for nvidia-cuda-mps-control: records each call (argument or stdin command) and the
# pipe directory it was given
if [ "$1" = "-d" ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY ${{CUDA_VISIBLE_DEVICES-unset}}" >> "{record}"; exit {rc}; fi
read cmd; echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "{record}"
"""


def fake_control(tmp_path: Path, rc: int = 0) -> tuple[Path, Path]:
    record = tmp_path / "calls.txt"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(FAKE_CONTROL.format(record=record, rc=rc))
    control.chmod(0o755)
    return control, record


def test_the_daemon_starts_for_the_job_and_quits_after_its_process_exits(tmp_path):
    """engage() in a job process: the control daemon started with a private pipe directory, that
    directory in the environment the job's children inherit, and, once the job's process is
    gone, `quit` sent to that daemon and the directory removed."""
    control, record = fake_control(tmp_path)
    job = textwrap.dedent(f"""
        import os, subprocess, sys
        from flowrl.config import compose, to_train_config
        from flowrl.runtime.control import mps
        cfg = to_train_config(compose(["model=tiny", "trainer=smoke", "launcher.mps=true",
                                       "trainer.output_dir=/nonexistent"]))
        facts = mps.MPSFacts(control={str(control)!r}, compute_mode="Default", device_memory=None,
                             cuda_initialized=False, own_daemon=False, vllm_installed=True)
        probe = ("import os, pathlib; pathlib.Path({str(tmp_path / 'probe_env')!r}).write_text("
                 "os.environ['CUDA_VISIBLE_DEVICES'] + ' ' + os.environ['{mps.PIPE_ENV}'])")
        line = mps.engage(cfg, facts, probe=[sys.executable, "-c", probe])
        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['{mps.PIPE_ENV}'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
        print(line.field, line.value, child)
    """)
    env = {k: v for k, v in os.environ.items() if k not in (mps.PIPE_ENV, mps.LOG_ENV, "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = "3"  # the job's GPU: the daemon must still see every GPU
    out = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    field, value, pipe = out.stdout.split()
    assert (field, value) == ("launcher.mps", "true")
    root = Path(pipe).parent
    assert Path(pipe).name == "pipe" and root.name.startswith("flowrl-mps-")
    start = record.read_text().splitlines()[0].split()
    # a daemon started under CUDA_VISIBLE_DEVICES renumbers the GPUs for its clients
    assert start == ["start", pipe, str(root / "log"), "unset"]
    # the probe is a client like the job: the job's CUDA_VISIBLE_DEVICES, the daemon's pipe
    assert (tmp_path / "probe_env").read_text() == f"3 {pipe}"
    deadline = time.monotonic() + 20  # the watcher polls the job's pid once a second
    while time.monotonic() < deadline and (len(record.read_text().splitlines()) < 2 or root.exists()):
        time.sleep(0.2)
    assert record.read_text().splitlines()[1].split() == ["quit", pipe]
    assert not root.exists()


def test_a_daemon_that_will_not_start_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    control, record = fake_control(tmp_path, rc=1)
    monkeypatch.setattr(mps.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    with pytest.raises(mps.MPSError, match=f"^launcher.mps: {control} -d exited 1: no output$"):
        mps.start_daemon(str(control), probe=[sys.executable, "-c", "pass"])
    assert list((tmp_path / "tmp").iterdir()) == []
    assert mps.PIPE_ENV not in os.environ


def test_a_daemon_that_cannot_serve_is_quit_refused_for_true_and_skipped_for_auto(tmp_path, monkeypatch):
    """The probe (a CUDA context under the new daemon) fails, as it does when another user's MPS
    server holds the GPU: the daemon is quit and its directory removed; launcher.mps=true refuses
    the run in one line, auto runs without MPS and says why."""
    control, record = fake_control(tmp_path)
    monkeypatch.setattr(mps.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    busy = [sys.executable, "-c", "import sys; sys.exit('cuDevicePrimaryCtxRetain: CUDA_ERROR_DEVICE_UNAVAILABLE')"]
    facts = mps.MPSFacts(**{**GPU.__dict__, "control": str(control)})
    with pytest.raises(mps.MPSError, match=r"^launcher.mps: a CUDA context under the job's MPS daemon "
                                           r"failed \(exited 1: cuDevicePrimaryCtxRetain: "
                                           r"CUDA_ERROR_DEVICE_UNAVAILABLE\)$"):
        mps.engage(cfg_of("launcher.mps=true"), facts, probe=busy)
    calls = record.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["start", "quit"]  # started, then quit at once
    assert list((tmp_path / "tmp").iterdir()) == [] and mps.PIPE_ENV not in os.environ
    line = mps.engage(cfg_of("rollout.vllm.engine_procs=4"), facts, probe=busy)
    assert (line.field, line.value) == ("launcher.mps", "false")
    assert line.why == ("a CUDA context under the job's MPS daemon failed (exited 1: "
                        "cuDevicePrimaryCtxRetain: CUDA_ERROR_DEVICE_UNAVAILABLE)")
    assert list((tmp_path / "tmp").iterdir()) == [] and mps.PIPE_ENV not in os.environ


def test_serving_line_names_the_server_and_its_clients(tmp_path, monkeypatch):
    """After the engines are built the job logs which MPS server serves which of its processes
    (the daemon's get_server_list / get_client_list): proof that the contexts joined."""
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text('#!/bin/sh\nread cmd arg\n'
                       'case "$cmd" in get_server_list) echo 4242;; get_client_list) '
                       '[ "$arg" = 4242 ] && printf "101\\n102\\n103\\n";; esac\n')
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    assert mps.serving_line() is None  # not under a daemon: nothing to say
    monkeypatch.setenv(mps.PIPE_ENV, str(tmp_path / "pipe"))
    assert mps.serving_line() == ("CUDA MPS: server 4242 serves 3 process(es) of this job "
                                  "(pids 101, 102, 103)")
    control.write_text("#!/bin/sh\nread cmd\n")  # a daemon no client has reached yet
    assert mps.serving_line() == (f"CUDA MPS: the daemon at {tmp_path / 'pipe'} runs no server: "
                                  "no CUDA context of this job joined it")


def test_the_default_probe_fails_cleanly_without_a_cuda_driver(tmp_path, monkeypatch):
    """The real probe (driver API through ctypes) on this machine, which has no libcuda: the
    daemon is quit and the reason names the missing driver."""
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here")
    control, record = fake_control(tmp_path)
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    with pytest.raises(mps.MPSError, match=r"failed \(exited 1: OSError: libcuda\.so\.1"):
        mps.start_daemon(str(control))
    assert [c.split()[0] for c in record.read_text().splitlines()] == ["start", "quit"]


def test_plan_previews_the_decision_without_starting_a_daemon(tmp_path, monkeypatch):
    """flowrl plan says what flowrl train would do with launcher.mps on this machine (here: the
    driver's tool is a stand-in, and nvidia-smi reports one GPU in Default mode) and starts none."""
    control, record = fake_control(tmp_path)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/smi_args"\necho "Default, 81559"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    facts = mps.machine_facts()
    assert (facts.control, facts.compute_mode, facts.device_memory) == (str(control), "Default",
                                                                       81559 << 20)
    assert (tmp_path / "smi_args").read_text().split()[0] == "--id=0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2a,1")  # the job's GPU is the first listed
    mps.machine_facts()
    assert (tmp_path / "smi_args").read_text().split()[0] == "--id=GPU-8f2a"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible: nvidia-smi is not asked
    (tmp_path / "smi_args").unlink()
    assert mps.machine_facts().compute_mode is None and not (tmp_path / "smi_args").exists()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    line = mps.preview(cfg_of("trainer.device=cuda", "rollout=vllm", "rollout.vllm.engine_procs=4"))
    assert str(line) == ("launcher.mps=true (4 vLLM engine process(es) share the GPU with the trainer: "
                         "under MPS their kernels run at once instead of in time slices; flowrl "
                         "train starts the job's daemon)")
    refused = mps.preview(cfg_of("trainer.device=cuda", "launcher.mps=true", "launcher.nproc=2"))
    assert str(refused).startswith("launcher.mps=refused (the job runs 2 process(es) on 1 node(s)")
    assert not record.exists()  # nothing started


def test_a_graph_that_declares_staleness_counts_as_overlapped(tmp_path, monkeypatch):
    """placement.staleness null takes the graph's weight_sync.staleness (compiler/placement.py
    staleness_of): a graph declaring 1 is an overlapped run, whose one engine process shares the
    GPU with the update, so auto starts MPS for it as for placement.staleness=1."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    text = (REPO / "graphs" / "grpo.yaml").read_text()
    assert "weight_sync:\n- from: update\n  to: rollout\n" in text
    graph = tmp_path / "lagged.yaml"
    graph.write_text(text.replace("weight_sync:\n- from: update\n  to: rollout\n",
                                  "weight_sync:\n- from: update\n  to: rollout\n  staleness: 1\n"))
    lagged = cfg_of(f"graph.path={graph}")
    assert lagged.placement.staleness is None and mps.overlapped_run(lagged)
    assert mps.decide(lagged, GPU, lambda: 1).start
    assert not mps.overlapped_run(cfg_of()) and not mps.decide(cfg_of(), GPU, lambda: 1).start


@pytest.mark.parametrize("overrides, asks_smi, line", [
    # the default job's shape: one engine, in the trainer's process: settled without nvidia-smi
    (["rollout=vllm"], False,
     "launcher.mps=false (no engine process: the vLLM engine runs in the trainer's process, or "
     "the graph has no rollout: nothing shares the GPU during a generate)"),
    (["rollout=hf"], False, "launcher.mps=false (no vLLM engine processes beside the trainer)"),
    # four engine processes: the daemon depends on the GPU's compute mode, so nvidia-smi is asked
    (["rollout=vllm", "rollout.vllm.engine_procs=4"], True, None),
])
def test_auto_asks_nvidia_smi_only_when_the_engine_count_leaves_it_open(
        tmp_path, monkeypatch, overrides, asks_smi, line):
    """nvidia-smi took 2.6-4.5 s of the default job's start on an H100 (the "CUDA MPS decision"),
    for a job whose one in-process engine never starts a daemon: auto settles such a job from its
    config first."""
    fake_control(tmp_path)
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ntouch "{tmp_path}/smi_asked"\necho "Prohibited, 81559"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for var in ("LOCAL_RANK", mps.PIPE_ENV, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(mps, "gpu_nodes", lambda: True)
    got = mps.engage(cfg_of("trainer.device=cuda", *overrides))
    assert (tmp_path / "smi_asked").exists() == asks_smi
    if asks_smi:  # the GPU's mode (Prohibited here) is what decides: the reason says so
        assert got is not None and got.value == "false" and "compute mode is Prohibited" in got.why
    else:
        assert str(got) == line
    monkeypatch.setattr(mps, "gpu_nodes", lambda: False)  # a CPU machine: nothing to say
    if not asks_smi:
        assert mps.engage(cfg_of("trainer.device=cuda", *overrides)) is None
