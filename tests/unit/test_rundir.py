"""One run per run directory: a fresh run into a previous one is refused in one line (resume,
overwrite or another directory), overwrite deletes only flowrl's outputs, a lock keeps a second
process out, a rejected run's Hydra files are removed, the interrupt hint tells the truth, and a
resume with another model, graph or trained roles than its checkpoint's is refused in one line,
before any model loads, with the original overrides to resume with."""
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_malformed_inputs import run_cli

from flowrl.runtime.control.recovery import resume_hint as crash_hint
from flowrl.runtime.io.rundir import (
    LOCK_FILE,
    RunDirError,
    RunDirLock,
    check_fresh,
    claim_run_dir,
    previous_run,
    remove_hydra_leftovers,
    repeat_overrides,
    resume_hint,
)


def trainer(resume=False, overwrite=False):
    return SimpleNamespace(resume=resume, overwrite=overwrite)


def old_run(d):
    (d / "checkpoints" / "step_000002").mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"step": 1}\n')
    (d / ".hydra").mkdir()
    (d / ".hydra" / "config.yaml").write_text("old")
    (d / "notes.txt").write_text("mine")
    return d


def test_a_fresh_run_into_a_previous_one_is_refused_in_one_line(tmp_path):
    old_run(tmp_path)
    with pytest.raises(RunDirError) as e:
        claim_run_dir(tmp_path, trainer())
    assert str(e.value) == (f"{tmp_path} holds a previous run (checkpoints, metrics.jsonl): "
                            "continue it with trainer.resume=true, replace it with "
                            "trainer.overwrite=true, or choose another run directory "
                            "(hydra.run.dir=...)")
    assert previous_run(tmp_path) == ["checkpoints", "metrics.jsonl"]  # nothing touched
    claim_run_dir(tmp_path, trainer(resume=True)).release()  # resuming is what it is for
    with pytest.raises(RunDirError, match="set one of them"):
        check_fresh(tmp_path, True, True)


def test_overwrite_deletes_flowrls_outputs_only(tmp_path):
    old_run(tmp_path)
    claim_run_dir(tmp_path, trainer(overwrite=True)).release()
    assert previous_run(tmp_path) == []
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / ".hydra").is_dir()


def test_an_empty_or_hydra_only_directory_is_fresh(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "train.log").write_text("")
    assert check_fresh(tmp_path, False, False) == []


HOLD = textwrap.dedent("""
    import sys, time
    from flowrl.runtime.io.rundir import RunDirLock
    RunDirLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(60)
""")


def test_the_lock_keeps_a_second_process_out_and_dies_with_its_owner(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        lock = RunDirLock(tmp_path)
        assert lock.held_elsewhere() == f"pid {holder.pid} on " + __import__("socket").gethostname()
        with pytest.raises(RunDirError, match=rf"{tmp_path} is in use by another flowrl run "
                                              rf"\(pid {holder.pid} on .*\): wait for it"):
            lock.acquire()
        with pytest.raises(RunDirError, match="is in use by another flowrl run"):
            claim_run_dir(tmp_path, trainer(resume=True))
    finally:
        holder.kill()
        holder.wait()
    # the kernel dropped the dead owner's lock: no stale lock file to clean up by hand
    lock = RunDirLock(tmp_path).acquire()
    assert lock.held_elsewhere() is None
    lock.acquire()  # re-entrant in one process (placement=auto nests its phases)
    lock.release()
    lock.release()
    assert (tmp_path / LOCK_FILE).is_file()


def test_a_rejected_run_leaves_nothing_behind(tmp_path):
    d = tmp_path / "run"
    (d / ".hydra").mkdir(parents=True)
    (d / "train.log").write_text("")
    remove_hydra_leftovers(d)
    assert not d.exists()
    old_run(d)  # never anything of a previous run
    remove_hydra_leftovers(d)
    assert (d / ".hydra" / "config.yaml").read_text() == "old"


def test_a_run_refused_inside_its_job_removes_its_released_lock_file(tmp_path):
    d = tmp_path / "run"
    (d / ".hydra").mkdir(parents=True)
    RunDirLock(d).acquire().release()  # the job's lock, released before the refusal is handled
    remove_hydra_leftovers(d)
    assert not d.exists()
    (d / ".hydra").mkdir(parents=True)
    import subprocess
    import sys

    # another process holds the lock: its file stays (the rest of Hydra's files go)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(60)"), str(d / LOCK_FILE)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        remove_hydra_leftovers(d)
        assert (d / LOCK_FILE).is_file() and not (d / ".hydra").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_interrupt_hint_tells_whether_there_is_anything_to_continue(tmp_path):
    assert resume_hint(tmp_path, str(tmp_path)) == (
        f"no checkpoint was written yet, so there is nothing to continue; start again with: "
        f"flowrl train hydra.run.dir={tmp_path} trainer.overwrite=true (plus your overrides)")
    import torch

    from flowrl.runtime.io.checkpoint import CheckpointManager

    # a real checkpoint: an empty .metadata is a corrupt one, which resume skips (issue 15)
    CheckpointManager(tmp_path / "checkpoints").save(4, {"model": {"w": torch.zeros(2)}}, {})
    assert resume_hint(tmp_path, str(tmp_path / "elsewhere")) == (
        f"continue from step_000004 with: flowrl train trainer.output_dir={tmp_path} "
        "trainer.resume=true (plus your overrides)")


# ---- resume: the checkpoint's run, checked before any model loads ----------------------------------
FIRST = ["model=tiny", "trainer=smoke", "data.limit=16", "logger.progress=false",
         "logger.tensorboard=false", "trainer.eval.before=false", "trainer.eval.after=false"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A 2-step tiny run through ``flowrl train`` (Hydra in this process: its overrides known)."""
    d = tmp_path_factory.mktemp("resume") / "run"
    rc, lines = run_cli(["train", *FIRST, f"hydra.run.dir={d}"], d.parent)
    assert rc in (0, None), lines
    assert (d / "checkpoints" / "step_000002").is_dir()
    return d


def test_overwrite_starts_a_fresh_train_log(tmp_path):
    """trainer.overwrite=true replaced the checkpoints and metrics but train.log kept every
    earlier run's lines (fresh-user report: four runs in one file)."""
    d = tmp_path / "run"
    args = ["train", *FIRST, "trainer.total_steps=1", "trainer.save_every=0", f"hydra.run.dir={d}"]
    for extra in ([], ["trainer.overwrite=true"], ["trainer.overwrite=true"]):
        rc, lines = run_cli([*args, *extra], tmp_path)
        assert rc in (0, None), lines
    log = (d / "train.log").read_text()
    assert log.count("step 1 done") == 1, log
    # and says what it deleted (silent before; fresh-user report)
    said = [ln for ln in log.splitlines() if "trainer.overwrite=true: deleted" in ln]
    assert len(said) == 1 and said[0].endswith(
        f"trainer.overwrite=true: deleted the previous run in {d} (checkpoints, metrics.jsonl, "
        "summary.json, plan.txt; its newest checkpoint was step_000001)"), said


def test_a_warning_of_the_checks_is_in_train_log_too(tmp_path):
    """`trainer.engine.lr=0` is said by prepare's checks, before Hydra's job makes train.log:
    it reached the console only, and the run's own record never said why nothing learnt."""
    import subprocess
    import sys

    d = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "flowrl.train", *FIRST, "trainer.total_steps=1",
                           "trainer.save_every=0", "trainer.engine.lr=0", f"hydra.run.dir={d}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [ln for ln in (d / "train.log").read_text().splitlines()
            if "trainer.engine.lr=0: the policy's weights never change" in ln]
    assert len(said) == 1 and "WARNING" in said[0], said
    # and on the console once, as before (a handler that keeps them silenced Python's fallback)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert [ln for ln in lines if "trainer.engine.lr=0" in ln] == [
        "trainer.engine.lr=0: the policy's weights never change (every update computes its "
        "gradients and applies nothing); set trainer.engine.lr > 0 to train"], lines


def state(run_dir, step=2):
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())


def again(run_dir) -> str:
    """The command a refusal prints to resume the 2-step run with its own overrides."""
    return (f"flowrl train hydra.run.dir={run_dir} trainer.resume=true " + " ".join(FIRST))


def test_a_checkpoint_records_the_run_it_continues(two_steps):
    meta = state(two_steps)
    assert meta["overrides"] == [*FIRST]  # hydra.run.dir is Hydra's, not the task's
    assert meta["graph"]["path"] == "graphs/grpo.yaml" and meta["trained_roles"] == ["actor"]
    assert meta["model"]["tiny"]["hidden_size"] == 64


def test_a_resume_with_another_model_size_is_refused_in_one_line(two_steps, no_model):
    """(Before: the model loaded, then DCP's "Size mismatch between saved ... and current".)"""
    hydra_record = (two_steps / ".hydra" / "overrides.yaml").read_text()
    rc, lines = run_cli(["train", *FIRST, f"hydra.run.dir={two_steps}", "trainer.resume=true",
                         "trainer.total_steps=4", "model.tiny.hidden_size=32"], two_steps.parent)
    assert rc == 2 and lines == [
        "flowrl train: error: trainer.resume=true: step_000002 was trained with "
        "model.tiny.hidden_size=64 but this run has model.tiny.hidden_size=32; resume with the "
        f"original overrides: {again(two_steps)} trainer.total_steps=4"]
    assert not no_model
    assert (two_steps / ".hydra" / "overrides.yaml").read_text() == hydra_record  # not rewritten


def test_a_resume_that_forgot_its_overrides_is_told_them(two_steps, no_model):
    rc, lines = run_cli(["train", f"hydra.run.dir={two_steps}", "trainer.resume=true",
                         "trainer.total_steps=6"], two_steps.parent)
    assert rc == 2 and len(lines) == 1, lines
    # the forgotten option is named as the option (before: model.tiny={...} vs model.tiny=null);
    # the raised total_steps is this run's (a resume may change it), after the original ones
    assert lines == [
        "flowrl train: error: trainer.resume=true: step_000002 was trained with model=tiny but "
        "this run has model=smollm2; resume with the original overrides: "
        f"{again(two_steps)} trainer.total_steps=6"]
    assert not no_model


def test_a_resume_with_another_graph_is_refused_in_one_line(two_steps, no_model):
    rc, lines = run_cli(["train", *FIRST, f"hydra.run.dir={two_steps}", "trainer.resume=true",
                         "trainer.total_steps=4", "graph=ppo"], two_steps.parent)
    assert rc == 2 and lines == [
        "flowrl train: error: trainer.resume=true: step_000002 was trained with "
        "graph.path=graphs/grpo.yaml, trained roles [actor] but this run has "
        "graph.path=graphs/ppo.yaml, trained roles [actor, critic]; resume with the original "
        f"overrides: {again(two_steps)} trainer.total_steps=4"]
    assert not no_model


def test_a_resume_that_only_raises_total_steps_continues(two_steps, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(two_steps, d)
    rc, lines = run_cli(["train", *FIRST, f"hydra.run.dir={d}", "trainer.resume=true",
                         "trainer.total_steps=3", "trainer.save_every=3"], tmp_path)
    assert rc in (0, None), lines
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [1, 2, 3]  # continued at 3, not from scratch
    assert any(r["step"] == 3 and "actor/pg_loss" in r for r in rows)
    assert state(d, 3)["overrides"][-3:] == ["trainer.resume=true", "trainer.total_steps=3",
                                             "trainer.save_every=3"]


def test_an_old_format_checkpoint_still_resumes(two_steps, tmp_path, monkeypatch):
    """A checkpoint written before graph, trained roles and overrides were recorded: only its
    model config is compared, and the refusal cannot print the original overrides."""
    d = tmp_path / "run"
    shutil.copytree(two_steps, d)
    path = d / "checkpoints" / "step_000002" / "trainer_state.json"
    meta = state(d)
    for key in ("graph", "trained_roles", "overrides"):
        meta.pop(key)
    path.write_text(json.dumps(meta))
    rc, lines = run_cli(["train", *FIRST, f"hydra.run.dir={d}", "trainer.resume=true",
                         "trainer.total_steps=3", "model.tiny.hidden_size=32"], tmp_path)
    assert rc == 2 and lines == [
        "flowrl train: error: trainer.resume=true: step_000002 was trained with "
        "model.tiny.hidden_size=64 but this run has model.tiny.hidden_size=32; resume with the "
        "original run's overrides (this checkpoint does not record them)"]
    rc, lines = run_cli(["train", *FIRST, f"hydra.run.dir={d}", "trainer.resume=true",
                         "trainer.total_steps=3"], tmp_path)
    assert rc in (0, None), lines
    assert state(d, 3)["step"] == 3


def test_the_hints_repeat_the_invocations_overrides(tmp_path):
    run = ["model=tiny", "trainer=smoke", "trainer.total_steps=4", "trainer.resume=true",
           "trainer.output_dir=/elsewhere", "+model.lora.rank=8"]
    assert repeat_overrides(run) == ["model=tiny", "trainer=smoke", "trainer.total_steps=4",
                                     "+model.lora.rank=8"]
    assert repeat_overrides(run, ["trainer.total_steps=6", "logger.tensorboard=false",
                                  "model.tiny.hidden_size=32"]) == [
        "model=tiny", "trainer=smoke", "trainer.total_steps=6", "+model.lora.rank=8",
        "logger.tensorboard=false"]  # only what a resume may change is taken from this run
    assert resume_hint(tmp_path, str(tmp_path), ["model=tiny", "trainer.overwrite=true"]) == (
        f"no checkpoint was written yet, so there is nothing to continue; start again with: "
        f"flowrl train hydra.run.dir={tmp_path} trainer.overwrite=true model=tiny")
    assert crash_hint(tmp_path, []) == (
        f"No checkpoint was written yet, so there is nothing to continue; start again with: "
        f"flowrl train hydra.run.dir={tmp_path} trainer.overwrite=true")
    import torch

    from flowrl.runtime.io.checkpoint import CheckpointManager

    CheckpointManager(tmp_path / "checkpoints").save(4, {"model": {"w": torch.zeros(2)}}, {})
    assert crash_hint(tmp_path, ["model=tiny", "trainer=smoke"]) == (
        f"Continue from step_000004 with: flowrl train hydra.run.dir={tmp_path} "
        "trainer.resume=true model=tiny trainer=smoke")


def test_a_graph_file_given_from_the_working_directory_is_recorded_absolute(tmp_path, monkeypatch):
    """The printed resume command must work from any directory."""
    from flowrl.config import compose
    from flowrl.runtime.io.rundir import run_record

    shutil.copy(Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml", tmp_path / "g.yaml")
    monkeypatch.chdir(tmp_path)
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_object(compose(["model=tiny", "graph.path=g.yaml",
                                       f"trainer.output_dir={tmp_path / 'run'}"]))
    rec = run_record(cfg, ["actor", "rollout"], ["model=tiny", "graph.path=g.yaml"])
    assert rec["overrides"] == ["model=tiny", f"graph.path={(tmp_path / 'g.yaml').resolve()}"]
    assert rec["trained_roles"] == ["actor"]


def test_an_export_is_readable_like_every_other_file(two_steps, tmp_path):
    """transformers writes model.safetensors through mkstemp: it came out 0600 beside 0644 files."""
    import os

    from flowrl.export import export_checkpoint

    old = os.umask(0o022)
    try:
        out = export_checkpoint(two_steps / "checkpoints" / "step_000002", tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
    assert modes["model.safetensors"] == "0o644" and set(modes.values()) == {"0o644"}, modes


def test_export_model_field_overrides_change_the_recorded_model(two_steps, tmp_path, capsys):
    """`flowrl export CKPT OUT model.dtype=bfloat16`: the checkpoint's recorded model (here the
    tiny one) in bf16; composed alone the override built the default SmolLM2 model, and the load
    failed on a size mismatch. A field the model does not have is one line."""
    from safetensors import safe_open

    from flowrl.export import export_main

    ckpt = two_steps / "checkpoints" / "step_000002"
    assert export_main([str(ckpt), str(tmp_path / "bf16"), "model.dtype=bfloat16"]) == 0
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as st:
        keys = list(st.keys())
        assert len(keys) == 21 and {str(st.get_tensor(k).dtype) for k in keys} == {"torch.bfloat16"}
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"^export: model override model\.dtyp=bfloat16 does not fit "
                                         r"the recorded model: Key 'dtyp' not in 'ModelConfig'"):
        export_main([str(ckpt), str(tmp_path / "typo"), "model.dtyp=bfloat16"])
    with pytest.raises(SystemExit) as e:
        export_main([str(ckpt), str(tmp_path / "drop"), "~model.lora"])
    assert e.value.code == 2 and capsys.readouterr().err.strip().endswith(
        "~model.lora: a recorded model's field cannot be deleted; set another value instead "
        "(model.lora=...)")
    assert not (tmp_path / "typo").exists() and not (tmp_path / "drop").exists()


def test_export_with_another_model_names_the_trained_one(two_steps, tmp_path):
    """`flowrl export CKPT OUT model=<another>`: refused naming the model the checkpoint was
    trained with, before any model loads (a size mismatch deep in the tensor load said it)."""
    from flowrl.export import export_main

    ckpt = two_steps / "checkpoints" / "step_000002"
    with pytest.raises(ValueError) as e:
        export_main([str(ckpt), str(tmp_path / "other"), "model=tiny", "model.tiny.hidden_size=32"])
    assert str(e.value) == (f"export: {ckpt} was trained with model=tiny, not the model given here "
                            "(model.tiny differs): export without model= (the recorded model is "
                            "used)")
    assert not (tmp_path / "other").exists()


def test_export_to_a_log_file_is_one_line_without_progress_bars(two_steps, tmp_path, capsys):
    """stderr not a terminal (a log file; here pytest's capture): transformers' "Writing model
    shards" bar used to redraw itself into it; now one summary line on stdout and nothing else."""
    import re

    from safetensors import safe_open
    from transformers.utils import logging as hf_logging

    from flowrl.export import export_main

    ckpt = two_steps / "checkpoints" / "step_000002"
    assert export_main([str(ckpt), str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert "Writing model shards" not in err and "\r" not in err + out, err
    # tiny llama: embed, 2 layers x (4 attention + 3 MLP + 2 norms), final norm, untied lm_head
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as st:
        assert len(list(st.keys())) == 21
    size = (tmp_path / "hf" / "model.safetensors").stat().st_size
    assert re.fullmatch(rf"exported {re.escape(str(ckpt))} \(actor\) to {re.escape(str(tmp_path))}"
                        rf"/hf \(21 tensors, {size / 2**30:.3g} GiB\) in \d+\.\d s\n", out), out
    assert hf_logging.is_progress_bar_enabled()  # restored for whatever runs next
