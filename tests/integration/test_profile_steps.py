"""``trainer.profile``: torch.profiler over the chosen steps of a tiny `flowrl train`, nothing on
the others; the summary names every stage of the plan with its seconds, the trace is a
Chrome/Perfetto file with the Executor's ranges."""
import gzip
import json
import re

import pytest

from flowrl.config import TrainerConfig, compose
from flowrl.runtime.io.profiling import ProfileConfig
from flowrl.train import train

BASE = ["model=tiny", "trainer=smoke", "data.limit=16", "logger.progress=false",
        "logger.tensorboard=false", "trainer.eval.limit=0", "trainer.total_steps=3"]


def test_profiled_step_writes_a_summary_and_a_trace(tmp_path):
    train(compose(BASE + [f"trainer.output_dir={tmp_path}", "trainer.profile.steps=[2]"]))
    root = tmp_path / "profile"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # steps 1 and 3: nothing
    assert sorted(p.name for p in (root / "step_000002").iterdir()) == ["rank0.trace.json.gz",
                                                                        "rank0.txt"]
    text = (root / "step_000002" / "rank0.txt").read_text()
    wall = float(re.match(r"step 2, rank 0: wall ([0-9.]+) s \(CPU profile", text).group(1))
    ranges = {m.group(1): float(m.group(2))
              for m in re.finditer(r"^  (flowrl/\S+)\s+([0-9.]+)$", text, re.M)}
    # every action of the GRPO plan, each once
    assert set(ranges) == {"flowrl/run/sample", "flowrl/run/rollout", "flowrl/run/reward",
                           "flowrl/run/advantage", "flowrl/run/old_logprobs", "flowrl/run/update",
                           "flowrl/offload/actor", "flowrl/onload/rollout",
                           "flowrl/offload/rollout", "flowrl/onload/actor", "flowrl/sync/rollout"}
    assert ranges["flowrl/run/rollout"] > 0 and ranges["flowrl/run/update"] > 0
    # the ranges are disjoint parts of the step; each figure is printed to 1 ms, so the sum of
    # 11 rounded ranges may pass the rounded wall by up to 6 ms (0.588 + 1e-16 was seen)
    assert sum(ranges.values()) <= wall + 0.0005 * (len(ranges) + 1)
    assert list(ranges.values()) == sorted(ranges.values(), reverse=True)
    assert "aten::mm" in text  # the operator table
    with gzip.open(root / "step_000002" / "rank0.trace.json.gz", "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"flowrl/run/rollout", "flowrl/run/update"} <= names


def test_profile_dir_and_no_trace(tmp_path):
    out = tmp_path / "elsewhere"
    train(compose(BASE + [f"trainer.output_dir={tmp_path / 'run'}", "trainer.profile.steps=[1,3]",
                          f"trainer.profile.dir={out}", "trainer.profile.trace=false",
                          "trainer.profile.row_limit=5"]))
    assert sorted(p.name for p in out.iterdir()) == ["step_000001", "step_000003"]
    assert [p.name for p in (out / "step_000003").iterdir()] == ["rank0.txt"]
    text = (out / "step_000003" / "rank0.txt").read_text()
    # the last step saves the final checkpoint inside the profiled step: named, not hidden
    assert re.search(r"^  flowrl/checkpoint/save\s+[0-9.]+$", text, re.M)
    assert "flowrl/checkpoint/save" not in (out / "step_000001" / "rank0.txt").read_text()
    table = text.split("\n\n", 2)[2]
    assert len([l for l in table.splitlines() if re.match(r"\s+\S.*\d+\s*$", l)]) == 5
    assert not (tmp_path / "run" / "profile").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": [0]}, r"trainer.profile.steps takes training steps >= 1, got \[0\]"),
    ({"row_limit": 0}, "trainer.profile.row_limit must be >= 1, got 0"),
])
def test_bad_profile_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProfileConfig(**kwargs)


def test_profile_steps_after_the_last_step_are_refused():
    with pytest.raises(ValueError, match=r"trainer.profile.steps \[11, 12\] come after the last "
                                         r"step \(trainer.total_steps=10\)"):
        TrainerConfig(total_steps=10, profile=ProfileConfig(steps=[12, 2, 11]))


def test_stage_seconds_reads_only_the_executors_ranges():
    """with_stack=true adds Python frames whose names start with flowrl's own paths; grouped by
    input shape, one range comes in several rows (summed)."""
    from types import SimpleNamespace

    from flowrl.runtime.io.profiling import stage_seconds

    rows = [SimpleNamespace(key=k, cpu_time_total=us) for k, us in [
        ("flowrl/run/update", 2_000_000), ("flowrl/run/update", 500_000),
        ("flowrl/runtime/step/executor.py(345): call_op", 9_000_000),
        ("flowrl/sync/rollout", 250_000), ("flowrl/checkpoint/save", 1_000_000),
        ("aten::mm", 7_000_000), ("flowrl/run/", 1)]]
    assert stage_seconds(rows) == {"flowrl/run/update": 2.5, "flowrl/checkpoint/save": 1.0,
                                   "flowrl/sync/rollout": 0.25}
    assert list(stage_seconds(rows)) == ["flowrl/run/update", "flowrl/checkpoint/save",
                                         "flowrl/sync/rollout"]


def test_overwrite_deletes_an_earlier_runs_profiles(tmp_path):
    train(compose(BASE + [f"trainer.output_dir={tmp_path}", "trainer.total_steps=1",
                          "trainer.profile.steps=[1]", "trainer.profile.trace=false"]))
    assert (tmp_path / "profile" / "step_000001" / "rank0.txt").is_file()
    train(compose(BASE + [f"trainer.output_dir={tmp_path}", "trainer.total_steps=1",
                          "trainer.overwrite=true"]))
    assert not (tmp_path / "profile").exists()


def test_steps_before_a_resume_point_are_named(tmp_path, caplog):
    import logging

    import torch

    from flowrl.runtime.io.profiling import StepProfiler

    with caplog.at_level(logging.WARNING, logger="flowrl"):
        prof = StepProfiler(ProfileConfig(steps=[1, 2, 5]), tmp_path, 0, torch.device("cpu"), start=3)
    assert "trainer.profile.steps [1, 2] were done before this run resumed at step 3" in caplog.text
    assert prof.root == (tmp_path / "profile").resolve()


def test_a_profiler_failure_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    """torch's kineto parser raised UnicodeDecodeError reading a with_stack=true record of a
    step that saved a checkpoint (fresh-user check): the run must finish, say so, and leave no
    empty step directory."""
    import logging

    from torch.profiler import profile

    def broken(self, *args, **kwargs):
        raise UnicodeDecodeError("utf-8", b"\xb6", 0, 1, "invalid start byte")

    monkeypatch.setattr(profile, "key_averages", broken)
    with caplog.at_level(logging.WARNING, logger="flowrl"):
        summary = train(compose(BASE + [f"trainer.output_dir={tmp_path}", "trainer.total_steps=2",
                                        "trainer.profile.steps=[2]"]))
    assert "profile: step 2 could not be recorded (UnicodeDecodeError: 'utf-8' codec can't decode " \
           "byte 0xb6 in position 0: invalid start byte); the run goes on without it" in caplog.text
    assert summary["checkpoint"].endswith("step_000002")
    assert not (tmp_path / "profile").exists()
