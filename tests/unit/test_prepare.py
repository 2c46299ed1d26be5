"""``flowrl train`` sets a run up once (issue 26): the config is composed once, the placement is
computed once, and that one ``RunSpec`` (``flowrl.train.prepare``) is what ``run_job`` runs; a
multi-rank launch prepares once in the parent before torchrun starts the ranks."""

import re
import sys

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from flowrl.runtime.control import preflight

SMOKE = ["model=tiny", "trainer=smoke", "data.limit=8", "trainer.eval.limit=0"]


@pytest.fixture
def counted(monkeypatch):
    """Every composition (flowrl's compose and Hydra's app both load through Hydra's config
    loader) and every placement (``runtime/control/preflight.prepare_placement``), counted."""
    counts = {"compose": 0, "place": 0}
    load, place = ConfigLoaderImpl.load_configuration, preflight.prepare_placement

    def counted_load(self, *a, **k):
        counts["compose"] += 1
        return load(self, *a, **k)

    def counted_place(*a, **k):
        counts["place"] += 1
        return place(*a, **k)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted_load)
    monkeypatch.setattr(preflight, "prepare_placement", counted_place)
    monkeypatch.setattr(sys, "argv", ["flowrl"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return counts


def test_flowrl_train_composes_and_places_once(counted, monkeypatch, tmp_path):
    """The job is stopped where it would build its engines: ``run_placement`` gets the
    placement pre-flight computed, nothing computed it again."""
    from flowrl.cli import main

    seen = {}

    def run_placement(cfg, plan, pp, dinfo, out_dir):
        seen.update(pp=pp, plan=plan, out_dir=out_dir, mode=pp.mode, world=pp.world_size)
        return {}

    monkeypatch.setattr("flowrl.runtime.control.job.run_placement", run_placement)
    assert main(["train", *SMOKE, f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    assert counted == {"compose": 1, "place": 1}
    assert (seen["mode"], seen["world"], seen["out_dir"]) == ("colocated", 1, tmp_path / "run")
    assert seen["pp"].full is seen["plan"]  # the spec's placement of the spec's plan
    assert (tmp_path / "run" / ".hydra" / "overrides.yaml").is_file()  # Hydra's job record


def test_a_multi_rank_launch_prepares_once_then_runs_torchrun(counted, fake_supervise, tmp_path):
    from flowrl.train import main

    seen = fake_supervise  # torchrun's agent runs in the launcher (runtime/control/supervise.py)
    with pytest.raises(SystemExit) as e:
        main(["launcher.nproc=2", *SMOKE, f"trainer.output_dir={tmp_path}"])
    assert e.value.code == 0
    assert counted == {"compose": 1, "place": 1}  # placed on the 2 ranks the job will have
    argv = seen["argv"]
    assert "--nproc_per_node=2" in argv
    assert argv[argv.index("-m") :] == [
        "-m",
        "flowrl.train",
        "launcher.nproc=2",
        *SMOKE,
        f"trainer.output_dir={tmp_path}",
    ]
    assert seen["overrides"] == ["launcher.nproc=2", *SMOKE, f"trainer.output_dir={tmp_path}"]
    assert not list(tmp_path.iterdir())  # the ranks' Hydra jobs write the run directory


def test_prepare_from_overrides_is_the_run_spec(counted, tmp_path):
    """``prepare(overrides)``: composed once with Hydra's section (what the Hydra job reads),
    ``trainer.output_dir`` pinned to the run directory, the machine's resolutions kept."""
    from flowrl.train import RunSpec, prepare

    spec = prepare([*SMOKE, f"hydra.run.dir={tmp_path / 'r'}"])
    assert isinstance(spec, RunSpec) and counted == {"compose": 1, "place": 1}
    assert spec.config.trainer.output_dir == str(tmp_path / "r")
    assert spec.raw.hydra.run.dir == str(tmp_path / "r")
    assert spec.overrides == (*SMOKE, f"hydra.run.dir={tmp_path / 'r'}")
    assert spec.placement.full is spec.plan and spec.placement.world_size == 1
    assert [r.field for r in spec.resolved][:2] == ["trainer.device", "model.dtype"]
    with pytest.raises(AttributeError):
        spec.plan = None  # frozen: what was checked is what runs


def test_prepare_itemizes_its_start_up_and_the_job_logs_it(monkeypatch, tmp_path, caplog):
    """A slow start says where its seconds went before any model loads: ``prepare`` times its
    parts (the process before it, from its creation time) and the job logs them in one line."""
    import logging

    import flowrl.train
    from flowrl.runtime.control import job
    from flowrl.runtime.control.spec import RunSpec
    from flowrl.train import prepare

    monkeypatch.setattr(flowrl.train, "_PREPARED", False)  # as the process's first prepare
    spec = prepare([*SMOKE, f"hydra.run.dir={tmp_path / 'run'}"])
    # torch's import is its own part (the model checks' first need: it was blamed on them)
    assert [p for p, _ in spec.startup] == ["python and imports", "compose", "config",
                                            "machine defaults", "graph checks", "torch import",
                                            "placement, model and data checks"]
    assert all(s >= 0 for _, s in spec.startup)
    assert spec.startup[0][1] > 0  # this process started before prepare did
    # a later prepare of the same process (a sweep's next job) does not count the earlier jobs
    again = prepare([*SMOKE, f"hydra.run.dir={tmp_path / 'run2'}"])
    assert [p for p, _ in again.startup][0] == "compose"
    line = RunSpec(None, None, None, None, startup=(("python and imports", 3.14), ("compose", 0.26))
                   ).startup_line()  # type: ignore[arg-type]
    assert line == "python and imports 3.1 s, compose 0.3 s"

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(job, "run_placement", stop)  # where the job would build its engines
    with caplog.at_level(logging.INFO, logger="flowrl"), pytest.raises(Stop):
        job.run_job(spec)
    logged = [r.getMessage() for r in caplog.records if "start-up: checked" in r.getMessage()]
    assert len(logged) == 1 and f"({spec.startup_line()}, " in logged[0]
    # then what came after prepare: the run directory and Hydra's job, the process group
    tail = re.search(r", run directory, Hydra's job and the job's imports (\d+\.\d) s, "
                     r"process group (\d+\.\d) s\)$", logged[0])
    assert tail is not None, logged[0]
    total = float(re.search(r"checked (\d+\.\d) s", logged[0]).group(1))
    parts = sum(s for _, s in spec.startup) + float(tail.group(1)) + float(tail.group(2))
    assert parts == pytest.approx(total, abs=0.25)  # every second of the total is named
    # a sweep's later job: its line counts from its own start, not the earlier jobs' runs
    assert again.startup_began_s > spec.startup[0][1]
    import time

    time.sleep(1.5)  # "the earlier job's run", between the later job's prepare and its job
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flowrl"), pytest.raises(Stop):
        job.run_job(again)
    logged = [r.getMessage() for r in caplog.records if "start-up: checked" in r.getMessage()]
    assert len(logged) == 1 and "since the job started" in logged[0], logged
    total = float(re.search(r"checked (\d+\.\d) s", logged[0]).group(1))
    between = float(re.search(r"job's imports (\d+\.\d) s", logged[0]).group(1))
    # (the first job's stopped run_job came between too: well under 3 s)
    assert 1.5 <= between < 1.5 + 3.0 and total < 1.5 + sum(s for _, s in again.startup) + 3.5


def test_since_launch_counts_from_the_process_start_not_a_rounded_boot_time():
    """``since_launch_s`` in a fresh interpreter is at most its wall time since the spawn (psutil's
    create_time read up to a second high: it adds the start to a boot time in whole seconds)."""
    import subprocess
    import time

    code = "from flowrl.runtime.step.resources import since_launch_s; print(since_launch_s())"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.monotonic() - t0
    age = float(out.stdout)
    assert 0 < age <= wall + 0.05, (age, wall)  # /proc: 10 ms ticks on both sides


def test_a_rank_counts_from_the_command_its_supervisor_started(monkeypatch):
    """``flowrl train launcher.nproc=N``: the supervisor hands its start to the ranks (an
    environment variable torchrun's workers inherit), so their "since the command started"
    counts the parent's checks and torchrun's start; it is gone once the group ends."""
    import os
    import time

    import torch.distributed.run as trun

    from flowrl.runtime.control import supervise
    from flowrl.runtime.step.resources import COMMAND_START_ENV, since_launch_s

    monkeypatch.setenv(COMMAND_START_ENV, repr(time.time() - 100))  # no rounding up
    assert 100 <= since_launch_s() < 101
    monkeypatch.delenv(COMMAND_START_ENV)
    own = since_launch_s()  # this process's age (pytest's: minutes in a full run)
    monkeypatch.setenv(COMMAND_START_ENV, "not a time")  # ignored: the process's own age
    assert abs(since_launch_s() - own) < 0.5
    monkeypatch.delenv(COMMAND_START_ENV)

    seen = []
    monkeypatch.setattr(trun, "run", lambda _args: seen.append(os.environ.get(COMMAND_START_ENV)))
    before = time.time() - since_launch_s()
    assert supervise.supervise(["--nproc_per_node=1", "--standalone", "-m", "flowrl.train"], []) == 0
    assert len(seen) == 1 and abs(float(seen[0]) - before) < 0.5
    assert COMMAND_START_ENV not in os.environ


def test_flowrl_train_times_its_machine_check_as_a_start_up_part(monkeypatch, tmp_path):
    """``flowrl train`` checks the machine after ``prepare`` (on a GPU: liger-kernel's import, 7.3 s
    on the H100); the start-up line names that part instead of leaving it in the job's share."""
    import flowrl.train

    seen = []
    monkeypatch.setattr(flowrl.train, "_PREPARED", False)
    monkeypatch.setattr(flowrl.train, "_hydra_job", seen.append)  # stop where the job would start
    flowrl.train.main([*SMOKE, f"trainer.output_dir={tmp_path / 'run'}"])
    (spec,) = seen
    assert [p for p, _ in spec.startup] == ["python and imports", "compose", "config",
                                            "machine defaults", "graph checks", "torch import",
                                            "placement, model and data checks",
                                            "machine check (packages, kernels)"]
    assert spec.startup[-1][1] >= 0


def test_the_mps_decision_is_its_own_start_up_part_where_it_was_made(monkeypatch, tmp_path):
    # on a GPU machine the decision reads nvidia-smi and the model's size: timed apart from the
    # machine defaults, as "CUDA MPS daemon" when it started one
    import flowrl.train
    from flowrl.machine import Resolved
    from flowrl.runtime.control import mps

    for value, part in (("false", "CUDA MPS decision"), ("true", "CUDA MPS daemon")):
        monkeypatch.setattr(mps, "engage", lambda cfg, v=value: Resolved("launcher.mps", v, "test"))
        spec = flowrl.train.prepare([*SMOKE, f"hydra.run.dir={tmp_path / value}"])
        parts = [p for p, _ in spec.startup]
        assert parts[parts.index("config") + 1:parts.index("machine defaults")] == [part]


def test_a_run_directory_that_cannot_be_made_is_one_line(monkeypatch, tmp_path, capsys):
    # procfs makes no folders: Hydra's job failed there in a 20-line traceback
    import flowrl.train

    where = "/proc/flowrl-no/run"
    monkeypatch.setattr(flowrl.train, "_hydra_job", lambda spec: pytest.fail("the job ran"))
    with pytest.raises(SystemExit) as e:
        flowrl.train.main([*SMOKE, f"trainer.output_dir={where}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"flowrl train: error: trainer.output_dir={where}: the run directory cannot be created (")


@pytest.mark.parametrize("extra, why", [
    (["model.tiny.hidden_size=63"], "model.tiny: transformers refuses this shape: The hidden size "
                                    "(63) is not a multiple of the number of attention heads (4)."),
    (["rollout=vllm"], "model.tiny: vLLM's CPU backend supports head sizes (32, 64, 80, 96, 112, "
                       "128, 160, 192, 224, 256, 512); the model has 16. For a tiny model set "
                       "e.g. model.tiny.num_attention_heads=2 model.tiny.num_key_value_heads=1 "
                       "(hidden 64 / 2 heads = 32)"),
])
def test_a_tiny_models_bad_shape_is_refused_before_it_is_built(tmp_path, monkeypatch, extra, why):
    # both failed inside the job before: a 48-line traceback and a run directory left behind
    from flowrl.runtime.control import preflight
    from flowrl.runtime.control.preflight import ConfigError
    from flowrl.train import prepare

    monkeypatch.setattr(preflight, "vllm_installed", lambda: True)  # as in .venv-vllm

    with pytest.raises(ConfigError) as e:
        prepare([*SMOKE, *extra, f"hydra.run.dir={tmp_path / 'run'}"])
    assert str(e.value) == why
    assert not (tmp_path / "run").exists()
    prepare([*SMOKE, "rollout=vllm", "model.tiny.num_attention_heads=2",  # a size it has
             "model.tiny.num_key_value_heads=1", f"hydra.run.dir={tmp_path / 'ok'}"])


def test_without_vllm_a_tiny_models_head_size_waits_for_the_machine_check(tmp_path, monkeypatch,
                                                                          capsys):
    """`flowrl train rollout=vllm model=tiny` without vLLM said the head size first; fixed, the
    user then learnt vLLM was not installed. Now the machine check's line comes first."""
    import flowrl.machine
    import flowrl.train
    from flowrl.runtime.control import preflight

    monkeypatch.setattr(preflight, "vllm_installed", lambda: False)
    monkeypatch.setattr(flowrl.machine, "vllm_importable", lambda: False)
    monkeypatch.setattr(flowrl.train, "_hydra_job", lambda spec: pytest.fail("the job ran"))
    with pytest.raises(SystemExit) as e:
        flowrl.train.main([*SMOKE, "rollout=vllm", f"hydra.run.dir={tmp_path / 'run'}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["flowrl train: error: rollout=vllm but vLLM is not installed here (GPU: pip "
                   "install vllm; CPU: the .venv-vllm of scripts/install.sh --vllm), or use "
                   "rollout=hf"], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, said", [
    (["trainer.critic_lr=0"], ["trainer.critic_lr=0: the critic's weights never change (its "
                               "values stay those of the initial model); set trainer.critic_lr "
                               "> 0 to train it"]),
    (["trainer.engine.lr=0"], ["trainer.engine.lr=0: the policy's weights never change (every "
                               "update computes its gradients and applies nothing); set "
                               "trainer.engine.lr > 0 to train",
                               "trainer.engine.lr=0: the critic's weights never change (its "
                               "values stay those of the initial model); set trainer.engine.lr "
                               "> 0 to train it"]),
    (["trainer.engine.lr=0", "trainer.critic_lr=1e-5"], [
        "trainer.engine.lr=0: the policy's weights never change (every update computes its "
        "gradients and applies nothing); set trainer.engine.lr > 0 to train"]),
    ([], [])])
def test_a_ppo_critic_with_lr_zero_is_said_never_to_change(tmp_path, caplog, extra, said):
    import logging

    from flowrl.train import prepare

    with caplog.at_level(logging.WARNING, logger="flowrl"):
        prepare([*SMOKE, "graph=ppo", *extra, f"hydra.run.dir={tmp_path / 'r'}"])
    assert [r.getMessage() for r in caplog.records if "never change" in r.getMessage()] == said


def test_a_critic_lr_for_a_graph_without_critic_is_said_unused(tmp_path, caplog):
    import logging

    from flowrl.train import prepare

    with caplog.at_level(logging.WARNING, logger="flowrl"):
        prepare([*SMOKE, "trainer.critic_lr=0", f"hydra.run.dir={tmp_path / 'r'}"])
    assert [r.getMessage() for r in caplog.records if "critic" in r.getMessage()] == [
        "trainer.critic_lr=0.0: graph grpo has no critic, so it is not used (graph=ppo trains "
        "one)"]


@pytest.mark.parametrize("lr, warned", [(0.0, True), (1e-6, False)])
def test_an_actor_with_lr_zero_is_said_never_to_change(tmp_path, caplog, lr, warned):
    """``trainer.engine.lr=0`` is allowed (throughput and evaluation runs use it) but said: a run
    that never moves a weight should not pass for one that trains."""
    import logging

    from flowrl.train import prepare

    with caplog.at_level(logging.WARNING, logger="flowrl"):
        prepare([*SMOKE, f"trainer.engine.lr={lr}", f"hydra.run.dir={tmp_path / 'r'}"])
    said = [r.getMessage() for r in caplog.records if "trainer.engine.lr=0" in r.getMessage()]
    assert said == ([
        "trainer.engine.lr=0: the policy's weights never change (every update computes its "
        "gradients and applies nothing); set trainer.engine.lr > 0 to train"] if warned else [])


@pytest.mark.parametrize("extra, said", [
    (["rollout.sampling.temperature=0"], [
        "rollout.sampling.temperature=0 decodes greedily: the 4 responses of a prompt are the "
        "same, so stage 'advantage' (grpo) gives every sample advantage 0 and the policy does not "
        "learn; sample with a temperature > 0 (e.g. 1.0)"]),
    (["rollout.sampling.temperature=0.01"], []),
    (["rollout.sampling.temperature=0", "graph=ppo"], []),  # GAE needs no group
])
def test_greedy_sampling_under_a_group_baseline_is_said_to_learn_nothing(tmp_path, caplog, extra,
                                                                          said):
    import logging

    from flowrl.train import prepare

    with caplog.at_level(logging.WARNING, logger="flowrl"):
        prepare([*SMOKE, *extra, f"hydra.run.dir={tmp_path / 'r'}"])
    assert [r.getMessage() for r in caplog.records if "greedily" in r.getMessage()] == said
