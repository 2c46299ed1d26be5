"""One run per run directory: a fresh run into a previous one is refused in one line (resume,
overwrite or another directory), overwrite deletes only flowrl's outputs, a lock keeps a second
process out, a rejected run's Hydra files are removed, and the interrupt hint tells the truth."""
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from flowrl.runtime.rundir import (
    LOCK_FILE,
    RunDirError,
    RunDirLock,
    check_fresh,
    claim_run_dir,
    previous_run,
    remove_hydra_leftovers,
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
    from flowrl.runtime.rundir import RunDirLock
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


def test_the_interrupt_hint_tells_whether_there_is_anything_to_continue(tmp_path):
    assert resume_hint(tmp_path, str(tmp_path)) == (
        f"no checkpoint was written yet, so there is nothing to continue; start again with: "
        f"flowrl train hydra.run.dir={tmp_path} trainer.overwrite=true (plus your overrides)")
    import torch

    from flowrl.runtime.checkpoint import CheckpointManager

    # a real checkpoint: an empty .metadata is a corrupt one, which resume skips (issue 15)
    CheckpointManager(tmp_path / "checkpoints").save(4, {"model": {"w": torch.zeros(2)}}, {})
    assert resume_hint(tmp_path, str(tmp_path / "elsewhere")) == (
        f"continue from step_000004 with: flowrl train trainer.output_dir={tmp_path} "
        "trainer.resume=true (plus your overrides)")
