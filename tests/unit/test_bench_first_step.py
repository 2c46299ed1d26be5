"""benchmarks/first_step.py's bookkeeping without a run: the per-variant summary (medians, ranges
and ratios against the first variant) and the environment of --fresh-caches runs."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import first_step as fs  # noqa: E402


def _res(variant, step1, end, rc=0):
    return {"variant": variant, "rc": rc, "milestones": {"step 1": step1, "end": end}}


def test_summary_medians_ranges_and_ratios_against_the_first_variant():
    results = [_res("default", 60.0, 80.0), _res("v1runner", 45.0, 70.0),
               _res("default", 50.0, 76.0), _res("v1runner", 40.0, 60.0),
               _res("default", 70.0, 90.0), _res("v1runner", 42.0, 64.0, rc=1)]  # failed: left out
    headers, rows = fs.summarize(results)
    assert headers == ["variant", "runs", "step 1 s", "end s", "step 1 / default", "end / default"]
    assert rows == [["default", 3, "60.0 [50.0-70.0]", "80.0 [76.0-90.0]", "1.00x", "1.00x"],
                    ["v1runner", 2, "42.5 [40.0-45.0]", "65.0 [60.0-70.0]", "0.71x", "0.81x"]]


def test_no_summary_from_single_runs():
    assert fs.summarize([_res("default", 60.0, 80.0), _res("v1runner", 45.0, 70.0)]) is None
    assert fs.summarize([]) is None


def test_fresh_caches_point_every_cache_at_an_empty_folder_of_the_run(monkeypatch, tmp_path):
    seen = {}

    class _Proc:  # stands in for the flowrl train process: prints one milestone, exits 0
        def __init__(self, cmd, env, **kw):
            seen.update(env=env, cmd=cmd)
            self.stdout = iter(["start-up: checked 1.0 s\n", "step 1 done\n"])

        def wait(self):
            return 0

    monkeypatch.setattr(fs.subprocess, "Popen", _Proc)
    monkeypatch.setattr(fs, "kill_tree", lambda proc: None)
    monkeypatch.setattr(fs, "drop_page_cache", lambda: "kept (test)")
    monkeypatch.setattr(fs.tempfile, "tempdir", str(tmp_path))
    res = fs.run_variant("v1runner", ["trainer.total_steps=1"], 60, fresh_caches=True)
    env = seen["env"]
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    dirs = {env[k] for k in fs.CACHE_ENV}
    assert len(dirs) == len(fs.CACHE_ENV)  # one folder each
    assert all(d.startswith(str(tmp_path / "flowrl_first_step_caches_v1runner_")) for d in dirs)
    assert not any(Path(d).exists() for d in dirs)  # removed after the run
    assert res["caches"] == "fresh" and res["page_cache"] == "kept (test)" and res["rc"] == 0
    assert set(res["milestones"]) == {"checked", "step 1", "end"}
    assert "trainer.total_steps=1" in seen["cmd"]


def test_a_run_past_its_timeout_goes_with_its_whole_tree(monkeypatch, tmp_path):
    # a silent run (no console line to check the time at) that started a child of its own: both
    # are killed at the timeout, and nothing of either is left
    import os
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    real = subprocess.Popen
    monkeypatch.setattr(fs.subprocess, "Popen",
                        lambda cmd, **kw: real([sys.executable, "-c", script], **kw))
    t0 = time.perf_counter()
    res = fs.run_variant("default", [], 3)
    assert time.perf_counter() - t0 < 60
    assert res["rc"] == -9 and "step 1" not in res["milestones"]
    child = int(pid_file.read_text())
    stat = Path(f"/proc/{child}/stat")
    for _ in range(50):  # killed: gone, or a zombie where the container's init does not reap
        try:
            os.kill(child, 0)
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the run's child {child} outlived it")
