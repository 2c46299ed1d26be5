"""benchmarks/e2e_vs_trl.py: a slow smoke run (one tiny step in each framework, report and JSON
written), and fast checks of the parts a CPU cannot run end to end: the TRL arguments of the vLLM
colocate and CUDA pair, the MFU FLOPs, the summaries and goals, and the process-tree monitor that
counts the vLLM engine processes."""
import dataclasses
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "e2e_vs_trl.py"
sys.path.insert(0, str(REPO / "benchmarks"))

import _common  # noqa: E402
import e2e_vs_trl as bench  # noqa: E402


def _table(text: str, first_header: str) -> list[dict[str, str]]:
    """Rows (header → cell, stripped) of the markdown table whose header starts with ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"| {first_header} |"))
    header = [c.strip() for c in lines[start].strip("|").split(" | ")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split(" | ")))))
    return rows


@pytest.mark.slow
def test_tiny_one_step_writes_both_rows(tmp_path):
    out, js = tmp_path / "e2e.md", tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--steps", "1", "--warmup", "0", "--prompts-per-step", "2",
         "--n", "2", "--max-new-tokens", "8", "--micro-batch-size", "2", "--out", str(out),
         "--json-out", str(js)],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "--model tiny --steps 1" in text  # the exact command is recorded

    results = _table(text, "framework")
    assert [r["framework"] for r in results] == ["flowrl", "trl", "flowrl/TRL"]
    for row in results[:2]:
        assert row["steps timed"] == "1 of 1"  # one step: nothing to exclude as warm-up
        assert float(row["completion tokens/s"]) > 0 and float(row["step s"]) > 0
        assert 0.1 < float(row["host peak RSS GiB (largest process)"]) < 24
        # the tree holds the process itself: its sampled peak is within a sampling gap of wait4's
        assert float(row["host peak RSS GiB (tree)"]) > 0.5 * float(row["host peak RSS GiB (largest process)"])
        assert 1 <= float(row["completion len"]) <= 8  # 2 prompts x 2 samples, 1..8 valid tokens
        assert row["MFU update"] == "n/a" and row["GPU used peak GiB (device)"] == "n/a"  # CPU
    assert re.fullmatch(r"\d+\.\d\d×", results[2]["completion tokens/s"])

    steps = _table(text.split("### Per step", 1)[1], "framework")
    assert [(r["framework"], r["step"]) for r in steps] == [("flowrl", "1"), ("trl", "1")]
    for r in steps:
        assert 4 <= int(r["gen tokens"]) <= 4 * 8  # generated tokens of 4 completions

    settings = {r["setting"]: r for r in _table(text, "setting")}
    assert settings["loss"]["TRL"].startswith("loss_type=dapo")
    assert (settings["KL"]["flowrl"], settings["KL"]["TRL"]) == ("kl_coef=0.0 (no ref stage)",
                                                                 "beta=0.0 (no ref model)")
    assert "max_completion_length=8" in settings["sampling"]["TRL"]
    assert "reshard_after_forward=None" in settings["attention"]["flowrl"]
    assert "cudnn_attention=False" in settings["rollout"]["flowrl"]  # the HF engine's

    doc = json.loads(js.read_text())
    assert [(r["framework"], r["rollout"]) for r in doc["runs"]] == [("flowrl", "hf"), ("trl", "hf")]
    flowrl, trl = (r["result"] for r in doc["runs"])
    for res, row in zip((flowrl, trl), results):  # both record the longest completion (1..8)
        step = res["steps"][0]
        assert step["length_mean"] <= step["length_max"] <= 8
        assert float(row["generate ms / decode step"]) == pytest.approx(
            1000 * step["generate_s"] / step["length_max"], rel=0.01)
    assert flowrl["precision"]["train"] == {"device": "cpu", "weights": "float32", "autocast": "off"}
    assert flowrl["rollout_engine"]["type"] == "HFRolloutEngine"
    # where the start-up's seconds went, from flowrl's own log lines, in the JSON and the report
    assert [l.split(" in ")[0] for l in flowrl["startup_log"]
            if l.startswith("start-up: model loaded")] == ["start-up: model loaded on cpu"]
    assert any(l.startswith("engines built in ") for l in flowrl["startup_log"])
    assert "- flowrl start-up (its log): " in text
    assert set(trl["steps"][0]["stages"]) == {"generate", "reward", "other_scoring",
                                              "forward_backward", "optimizer_and_rest"}
    # the report is rebuilt from the JSON alone
    again = tmp_path / "again.md"
    assert bench.main(["--from-json", str(js), "--out", str(again)]) == 0
    assert _table(again.read_text(), "framework") == results


def test_vllm_cuda_pair_maps_onto_grpo_config(tmp_path):
    """The pair a CPU cannot run: every TRL argument exists in GRPOConfig and mirrors flowrl's."""
    trl = pytest.importorskip("trl")
    # a model directory as the benchmark saves it (flowrl checks model.path holds a config)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    bc = bench.BenchConfig(model="qwen05b", rollout="vllm", device="cuda", steps=4, prompts_per_step=32,
                           n=8, max_new_tokens=256, micro_batch_size=32, model_dir=str(tmp_path / "model"),
                           extra=["rollout.vllm.gpu_memory_utilization=0.4", "rollout.vllm.max_model_len=1024"])
    tc, _ = bench.prepare_run(bc, str(tmp_path / "out"))
    kw = bench.trl_kwargs(tc, bc, str(tmp_path / "out"))
    assert set(kw) <= {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert (tc.model.dtype, tc.trainer.device, tc.rollout.backend) == ("bfloat16", "cuda", "vllm")
    assert {k: kw[k] for k in ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization",
                               "vllm_max_model_length", "vllm_importance_sampling_correction",
                               "bf16", "use_cpu", "per_device_train_batch_size",
                               "gradient_accumulation_steps", "steps_per_generation",
                               "max_completion_length", "num_generations")} == {
        "use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.4,
        "vllm_max_model_length": 1024, "vllm_importance_sampling_correction": False,
        "bf16": True, "use_cpu": False, "per_device_train_batch_size": 32,
        "gradient_accumulation_steps": 8, "steps_per_generation": 8, "max_completion_length": 256,
        "num_generations": 8}


@pytest.mark.parametrize("kwargs, match", [
    (dict(rollout="sglang"), "--rollout"), (dict(device="tpu"), "--device"),
    (dict(dtype="float16"), "--dtype"), (dict(n=1), "--n must be >= 2"),
    (dict(micro_batch_size=3), "must divide"), (dict(extra=["model=tiny"]), "extra override"),
    (dict(extra=["rollout.vllm.sleep_level"]), "extra override")])
def test_bench_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench.BenchConfig(**kwargs)


def test_train_flops_formula():
    info = {"matmul_params": 1000, "layers": 2, "attn_dim": 8}
    # rows of 3 and 5 prompt tokens, mean response 2: S = 5 and 7
    assert bench.train_flops(info, [3, 5], 2.0) == 6 * 1000 * (5 + 7) + 6 * 2 * 8 * (25 + 49)


def _run(fw, steps, *, rss=2**30):
    return {"model": "m", "rollout": "hf", "framework": fw, "prompt_lens": [[10, 10]] * len(steps),
            "model_info": {"name": "M", "params": 120, "matmul_params": 100, "layers": 1, "hidden": 4,
                           "attn_dim": 4, "vocab": 20, "tied_embeddings": False, "saved_dtype": "bfloat16"},
            "settings": [["seed", "0", "0"]],
            "child": {"peak_rss_bytes": rss, "wall_s": 9.0},
            "monitor": {"tree_rss_peak_bytes": rss, "tree_pss_peak_bytes": rss,
                        "gpu_used_peak_bytes": None},
            "result": {"steps": steps, "build_s": 1.0}}


def _step(i, step_s, tokens, stages, update_s, perf=None):
    return {"step": i, "step_s": step_s, "gen_tokens": tokens, "length_mean": tokens / 2,
            "reward_mean": 0.5, "generate_s": stages.get("rollout", stages.get("generate")),
            "update_s": update_s, "stages": stages, "perf": perf or {}, "profile": {}}


def test_summaries_goals_and_report(tmp_path):
    fl = _run("flowrl", [_step(1, 99.0, 1, {"rollout": 1.0, "update": 1.0}, 1.0),  # warm-up: dropped
                         _step(2, 2.2, 40, {"rollout": 1.0, "reward": 0.5, "update": 0.5}, 0.5,
                               {"swap_s": 0.1, "sync_s": 0.1})], rss=2**30)
    tr = _run("trl", [_step(1, 50.0, 1, {"generate": 1.0}, 1.0),
                      _step(2, 4.0, 20, {"generate": 3.0, "reward": 0.5}, 1.0)], rss=2 * 2**30)
    f, t = bench.summarize(fl, 1e-9), bench.summarize(tr, 1e-9)  # peak 1e3 FLOP/s
    assert (f["measured"], f["tokens_per_s"], f["step_s"], f["update_s"]) == ("1 of 2", 40 / 2.2, 2.2, 0.5)
    assert f["step_over_stages"] == pytest.approx(2.2 / 2.0)
    assert f["step_over_stages_moves"] == pytest.approx(2.2 / 2.2)
    flops = bench.train_flops(fl["model_info"], [10, 10], 20.0)
    assert f["mfu_update"] == pytest.approx(flops / 0.5 / 1e3)
    assert f["mfu_step"] == pytest.approx(flops / 2.2 / 1e3)
    assert t["tokens_per_s"] == 20 / 4.0 and t["tree_rss_gib"] == 2.0
    goals = bench.goals_rows({("m", "hf"): {"flowrl": f, "trl": t}})
    assert goals == [["m", "completion tokens/s: flowrl (hf) / TRL (hf)", f"{(40 / 2.2) / 5:.2f}×", "≥ 1.2×", "met"],
                     ["m", "flowrl (hf) step wall time / Σ stage times", "1.100", "≤ 1.05", "missed"],
                     ["m", "host peak RSS (process tree): flowrl / TRL (hf)", "0.50×", "≤ 1×", "met"]]
    meta = {"command": "python x", "date": "d", "commit": "c", "gpu": "G", "peak_tflops": 1e-9,
            "machine": {"cpu": "c", "physical_cores": "1", "logical_cpus": "1", "memory": "1",
                        "os": "o", "python": "3"}, "load": [0.0, 0.0], "versions": {},
            "bench": {"device": "cuda", "threads": 1}}
    text = bench.write_report(tmp_path / "r.md", {"meta": [meta], "runs": [fl, tr]})
    rows = _table(text, "framework")
    assert [r["framework"] for r in rows] == ["flowrl", "trl", "flowrl/TRL"]
    assert rows[2]["completion tokens/s"] == f"{(40 / 2.2) / 5:.2f}×"
    assert "end-to-end GRPO on one GPU" in text and "**Random model.**" in text


def test_tree_monitor_counts_grandchildren_and_timeout_kills_them(tmp_path):
    """The vLLM engine processes are the framework process's children: wait4's peak of the framework
    process misses them, the sampled tree sum does not; a timeout kills the whole tree."""
    psutil = pytest.importorskip("psutil")
    script = tmp_path / "holder.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys
        held = b'1' * (150 * 2**20)
        GRANDCHILD = ("import os, sys, time; x = b'1' * (150 * 2**20); "
                      "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(float(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", GRANDCHILD, *sys.argv[1:]])
    """))
    # measured from a small parent, as the benchmark's: exec charges the parent's high-water RSS
    # (here pytest's) to the child's ru_maxrss
    probe = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import dataclasses, json, sys
        sys.path.insert(0, {str(REPO / "benchmarks")!r})
        import _common
        res = _common.run_child([sys.executable, {str(script)!r}, {str(tmp_path / "pid1")!r}, "1.5"],
                                monitor=_common.TreeMonitor(interval_s=0.05))
        print(json.dumps(dataclasses.asdict(res)))
    """)], capture_output=True, text=True, timeout=120, check=True)
    res = _common.ChildResult(**json.loads(probe.stdout.splitlines()[-1]))
    assert res.returncode == 0 and not res.timed_out
    # wait4: the largest single process of the tree (Linux folds reaped descendants in as a max)
    assert 150 * 2**20 < res.peak_rss_bytes < 290 * 2**20
    # the sampled tree: both processes' 150 MiB at once
    assert res.monitor["tree_rss_peak_bytes"] > 300 * 2**20
    assert res.monitor["tree_rss_peak_bytes"] > 1.5 * res.peak_rss_bytes
    assert res.monitor["tree_procs_max"] == 2 and res.monitor["gpu_used_peak_bytes"] is None

    res = _common.run_child([sys.executable, str(script), str(tmp_path / "pid2"), "60"], timeout_s=3)
    assert res.timed_out and res.returncode == -9 and res.wall_s < 30
    grandchild = int((tmp_path / "pid2").read_text())
    try:
        psutil.Process(grandchild).wait(timeout=5)  # killed with its session (reaped by init)
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_overlap_pair_recomputes_old_logprobs_and_says_so(tmp_path):
    """`placement.staleness=1` among the flowrl overrides: the run recomputes the old logprobs
    (a one-version-old batch needs them), the stage check lets that stage through, and the
    settings table says flowrl is one-step off-policy while TRL is on-policy."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    common = dict(model="qwen05b", rollout="vllm", device="cuda", steps=4, prompts_per_step=32,
                  n=8, max_new_tokens=256, micro_batch_size=32, model_dir=str(tmp_path / "model"))
    for extra, recompute in (([], False), (["placement.staleness=1"], True),
                             (["placement.staleness=1", "placement.staleness=0"], False)):
        bc = bench.BenchConfig(**common, extra=extra)
        assert bench.overlapped(extra) is recompute
        assert f"algorithm.recompute_old_logprobs={str(recompute).lower()}" in \
            bench.flowrl_overrides(bc, str(tmp_path / "out"))
        tc, plan = bench.prepare_run(bc, str(tmp_path / "out"))
        assert ("old_logprobs" in plan.order) is recompute
        rcfg = next(c.config for c in plan.stages if c.stage.op == "reward.rule")
        row = dict((r[0], r[1:]) for r in bench.settings_rows(tc, bench.trl_kwargs(tc, bc, "o"),
                                                             rcfg, bc))["policy lag"]
        assert row[0].startswith("placement.staleness=1: one-step off-policy" if recompute
                                 else "on-policy")
        assert row[1] == "on-policy (TRL generates, then trains, in turn)"


def test_startup_lines_keep_flowrls_start_up_records_only():
    import logging

    h = bench.StartupLines()
    log = logging.getLogger("flowrl.test_startup_lines")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        log.info("start-up: model loaded on %s in %.1f s", "cuda", 5.21)
        log.info("step 1 done 49.3 s since the command started")
        log.info("  vLLM engine %d/%d ready at %.1f s", 2, 4, 31.04)
        log.debug("start-up: a debug record")
    finally:
        log.removeHandler(h)
    assert h.lines == ["start-up: model loaded on cuda in 5.2 s", "vLLM engine 2/4 ready at 31.0 s"]
