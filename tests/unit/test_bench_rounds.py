"""benchmarks/e2e_vs_trl.py's interleaved rounds: the statistics (median, min–max, ratio of medians
with the per-round range), the step → round map, the per-round summaries and tables, the file
gate a framework process waits at, and the order ``run_pair`` runs the rounds in."""
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import e2e_vs_trl as bench  # noqa: E402


def test_spread_median_min_max():
    assert bench.spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert bench.spread([4.0, 1.0, 3.0, 2.0]) == (2.5, 1.0, 4.0)  # even count: mean of the middle two
    assert bench.spread([7.0]) == (7.0, 7.0, 7.0)
    with pytest.raises(ValueError, match="no values"):
        bench.spread([])


def test_ratio_of_medians_and_per_round_range():
    # medians 11 and 5; per-round ratios 10/5=2, 12/4=3, 11/5.5=2
    assert bench.ratio_of_medians([10.0, 12.0, 11.0], [5.0, 4.0, 5.5]) == (11.0 / 5.0, 2.0, 3.0)
    # the ratio of medians is not the median of the ratios: 4/1, 1/2, 2/4 -> medians 2/2 = 1
    assert bench.ratio_of_medians([4.0, 1.0, 2.0], [1.0, 2.0, 4.0]) == (1.0, 0.5, 4.0)
    with pytest.raises(ValueError, match="equal, non-empty"):
        bench.ratio_of_medians([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="equal, non-empty"):
        bench.ratio_of_medians([], [])
    with pytest.raises(ValueError, match="zero denominator"):
        bench.ratio_of_medians([1.0, 2.0], [1.0, 0.0])


def test_round_of_steps():
    # 1 warm-up step, rounds of 2 steps
    assert [bench.round_of(s, 1, 2) for s in range(1, 8)] == [0, 1, 1, 2, 2, 3, 3]
    assert [bench.round_of(s, 0, 3) for s in range(1, 7)] == [1, 1, 1, 2, 2, 2]
    bc = bench.BenchConfig(steps=2, rounds=3, warmup=1, prompts_per_step=2, n=2, micro_batch_size=2)
    assert bc.total_steps == 7 and bc.round_of(4) == 2
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        bench.BenchConfig(rounds=0)
    with pytest.raises(ValueError, match="--warmup must be >= 0"):
        bench.BenchConfig(warmup=-1)


def _step(i, step_s, tokens, update_s=1.0, sync_s=0.0, length_max=None):
    return {"step": i, "step_s": step_s, "gen_tokens": tokens, "length_mean": tokens / 2,
            "length_max": length_max,
            "reward_mean": 0.0, "generate_s": step_s - update_s, "update_s": update_s,
            "stages": {"rollout": step_s - update_s, "update": update_s},
            "perf": {"sync_s": sync_s}, "profile": {}}


def _run(fw, steps):
    return {"model": "m", "rollout": "hf", "framework": fw, "warmup": 1, "rounds": 3, "round_steps": 2,
            "prompt_lens": [[10, 10]] * len(steps),
            "model_info": {"matmul_params": 100, "layers": 1, "attn_dim": 4},
            "child": {"peak_rss_bytes": 2**30, "wall_s": 1.0}, "monitor": {},
            "result": {"steps": steps, "build_s": 1.0}}


def test_round_summaries_and_tables():
    # flowrl rounds: tokens/s (20+20)/(2+2)=10, (30+30)/(2+4)=10... chosen for exact values
    fl = _run("flowrl", [_step(1, 99.0, 1),  # warm-up: in no round
                         _step(2, 2.0, 20), _step(3, 2.0, 20),    # round 1: 40 / 4 s = 10 tok/s
                         _step(4, 2.0, 40), _step(5, 2.0, 40),    # round 2: 80 / 4 = 20
                         _step(6, 1.0, 15), _step(7, 1.0, 15)])   # round 3: 30 / 2 = 15
    tr = _run("trl", [_step(1, 50.0, 1),
                      _step(2, 4.0, 20), _step(3, 4.0, 20),       # 40 / 8 = 5
                      _step(4, 4.0, 20), _step(5, 4.0, 20),       # 5
                      _step(6, 2.0, 10), _step(7, 2.0, 10)])      # 20 / 4 = 5
    fr, trr = bench.round_summaries(fl, None), bench.round_summaries(tr, None)
    assert [r["tokens_per_s"] for r in fr] == [10.0, 20.0, 15.0]
    assert [r["tokens_per_s"] for r in trr] == [5.0, 5.0, 5.0]
    assert [r["step_s"] for r in fr] == [2.0, 2.0, 1.0]
    assert [r["measured"] for r in fr] == ["2 of 2"] * 3
    rows = {r[0]: r for r in bench.round_rows({"flowrl": fr, "trl": trr})}
    # median 15 [10–20]; TRL 5 [5–5]; ratio 15/5 = 3, per-round 2, 4, 3
    assert rows["completion tokens/s"] == ["completion tokens/s", "15.0 [10.0–20.0]", "5 [5–5]",
                                           "3.00× [2.00–4.00×]", "10.0 / 5; 20.0 / 5; 15.0 / 5"]
    assert rows["MFU update"][1:4] == ["n/a", "n/a", "n/a"]  # no peak given
    assert bench.headline_rows({("m", "hf"): {"flowrl": fr, "trl": trr}}) == [
        ["m", "hf", "3 / 3", "15.0 [10.0–20.0]", "5 [5–5]", "**3.00×** [2.00–4.00×]"]]
    # goals read the medians over rounds: 15 / 5
    goals = bench.goals_rows({("m", "hf"): {"flowrl": bench.summarize(fl, None),
                                            "trl": bench.summarize(tr, None)}},
                             {("m", "hf"): {"flowrl": fr, "trl": trr}})
    assert goals[0] == ["m", "completion tokens/s: flowrl (hf) / TRL (hf)", "3.00×", "≥ 1.2×", "met"]
    assert rows["generate ms / decode step"][1:4] == ["n/a", "n/a", "n/a"]  # no length_max stored
    # a run stored before rounds existed: no round summaries, first step dropped as warm-up
    old = {k: v for k, v in fl.items() if k not in ("warmup", "rounds", "round_steps")}
    assert bench.round_summaries(old, None) == [] and bench.warmup_of(old) == 1


def _bc(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    return bench.BenchConfig(steps=2, rounds=3, warmup=1, prompts_per_step=2, n=2,
                             micro_batch_size=2, gate_dir=str(d))


def test_gate_waits_for_go_before_a_round_starts(tmp_path):
    bc = _bc(tmp_path, "g")
    gate, d = bench.Gate(bc, poll_s=0.001), Path(bc.gate_dir)
    gate.before(1)  # warm-up: no wait
    assert list(d.iterdir()) == []
    t = threading.Thread(target=gate.before, args=(2,))  # round 1's first step
    t.start()
    time.sleep(0.05)
    assert t.is_alive() and (d / "ready_1").exists()
    (d / "go_1").touch()
    t.join(2)
    assert not t.is_alive()
    gate.before(3)  # second step of round 1: no wait
    assert sorted(p.name for p in d.iterdir()) == ["go_1", "ready_1"]
    gate.after(6)
    assert not (d / "done").exists()
    gate.after(7)  # the last step
    assert (d / "done").exists()


def test_run_pair_interleaves_rounds(tmp_path):
    """Two fake framework processes (threads running the Gate protocol): the steps run in the
    order warm-up A, warm-up B, round 1 A, round 1 B, round 2 A, ..."""
    base = bench.BenchConfig(steps=2, rounds=3, warmup=1, prompts_per_step=2, n=2, micro_batch_size=2)
    log: list[tuple[str, int]] = []

    def launch(fw, gate_dir):
        from dataclasses import replace
        gate = bench.Gate(replace(base, gate_dir=str(gate_dir)), poll_s=0.001)

        def child():
            for step in range(1, base.total_steps + 1):
                gate.before(step)
                log.append((fw, step))
                gate.after(step)
            th.result = fw  # what run_pair hands back per framework

        th = threading.Thread(target=child)
        th.start()
        return th

    assert bench.run_pair(["flowrl", "trl"], base, tmp_path, launch) == {"flowrl": "flowrl", "trl": "trl"}
    assert log == [("flowrl", 1), ("trl", 1),
                   ("flowrl", 2), ("flowrl", 3), ("trl", 2), ("trl", 3),
                   ("flowrl", 4), ("flowrl", 5), ("trl", 4), ("trl", 5),
                   ("flowrl", 6), ("flowrl", 7), ("trl", 6), ("trl", 7)]


def test_run_pair_side_by_side_starts_every_process_before_the_rounds(tmp_path):
    """An HF pair's processes start at once (no engine build to time alone): both are launched
    before either reached its first gate; the timed rounds still take turns."""
    base = bench.BenchConfig(steps=1, rounds=2, warmup=1, prompts_per_step=2, n=2, micro_batch_size=2)
    log: list[tuple[str, int]] = []
    started = threading.Barrier(2, timeout=10)  # breaks (and fails the test) if one waits alone

    def launch(fw, gate_dir):
        from dataclasses import replace
        gate = bench.Gate(replace(base, gate_dir=str(gate_dir)), poll_s=0.001)

        def child():
            started.wait()  # the other process was launched before this one reached a gate
            for step in range(1, base.total_steps + 1):
                gate.before(step)
                if step > base.warmup:
                    log.append((fw, step))
                gate.after(step)
            th.result = fw

        th = threading.Thread(target=child)
        th.start()
        return th

    assert bench.run_pair(["flowrl", "trl"], base, tmp_path, launch, side_by_side=True) == {
        "flowrl": "flowrl", "trl": "trl"}
    assert log == [("flowrl", 2), ("trl", 2), ("flowrl", 3), ("trl", 3)]
    assert bench.starts_side_by_side("hf") and not bench.starts_side_by_side("vllm")


def test_plan_rows_estimate():
    bc = bench.BenchConfig(device="cuda", steps=2, rounds=3, warmup=1, prompts_per_step=32, n=8,
                           max_new_tokens=256, micro_batch_size=32)
    rows = bench.plan_rows(["qwen05b"], ["hf"], ["flowrl", "trl"], bc)
    # an HF pair's 2 processes start side by side: the longer start, 35 s + flowrl's build 5 s,
    # then 7 steps x (7.5 + 7.0) s, plus 15 s of model preparation
    assert rows[0] == ["qwen05b", "hf", "1 + 3 x 2", f"{40 + 7 * 14.5:.0f}"]
    assert rows[-1][-1] == f"{15 + 40 + 7 * 14.5:.0f} s = {(15 + 40 + 7 * 14.5) / 60:.1f} min"


def test_default_child_timeout_outlives_the_pair():
    bc = bench.BenchConfig(device="cuda", steps=2, rounds=3, warmup=1, prompts_per_step=32, n=8,
                           max_new_tokens=256, micro_batch_size=32)
    # a vLLM pair's processes start one after the other: flowrl 35 + 76 (compiled engine build)
    # + 7 x 2.5; TRL 35 + 53 + 7 x 5.7
    est = 35 + 76 + 7 * 2.5 + 35 + 53 + 7 * 5.7
    assert bench.pair_estimate_s("qwen05b", "vllm", ["flowrl", "trl"], bc) == pytest.approx(est)
    assert bench.default_child_timeout_s("qwen05b", "vllm", ["flowrl", "trl"], bc) == \
        pytest.approx(1.5 * est + 60)
    # profiled steps add the profiler's time (2 x 40 s: 176 s killed a profiled pair at 49048df)
    assert bench.profiled_steps(["x=1", "trainer.profile.steps=[3,4]"]) == 2
    assert bench.profiled_steps(["trainer.profile.dir=/tmp/p"]) == 0
    assert bench.default_child_timeout_s("qwen05b", "vllm", ["flowrl", "trl"], bc, profiled=2) == \
        pytest.approx(1.5 * est + 60 + 80)
    # the hand-given 240 s that killed flowrl's process at 3c9da7b is below the pair's estimate
    assert 240 < est


def test_decode_ms_divides_generate_time_by_the_longest_completions():
    # generate s: 1.0 + 3.0 (step_s - update_s); longest completions 100 + 300 -> 4 s / 400 = 10 ms
    steps = [_step(2, 2.0, 20, length_max=100), _step(3, 4.0, 20, length_max=300)]
    assert bench.decode_ms(steps) == 10.0
    assert bench.decode_ms([_step(2, 2.0, 20, length_max=100), _step(3, 4.0, 20)]) is None  # one unrecorded
    assert bench.decode_ms([_step(2, 2.0, 20, length_max=0)]) is None
    assert bench.decode_ms([]) is None
    # per round, in the round table: flowrl 10, 20, 20 ms against TRL's 5, 5, 10
    # -> medians 20 / 5 = 4x, per-round ratios 2, 4, 2
    fl = _run("flowrl", [_step(1, 9.0, 1, length_max=9), _step(2, 2.0, 20, length_max=100),
                         _step(3, 2.0, 20, length_max=100), _step(4, 3.0, 20, length_max=100),
                         _step(5, 3.0, 20, length_max=100), _step(6, 2.0, 20, length_max=50),
                         _step(7, 2.0, 20, length_max=50)])
    tr = _run("trl", [_step(1, 9.0, 1, length_max=9)] + [_step(i, 1.5, 20, length_max=100)
                                                         for i in range(2, 6)]
              + [_step(6, 2.0, 20, length_max=100), _step(7, 2.0, 20, length_max=100)])
    fr, trr = bench.round_summaries(fl, None), bench.round_summaries(tr, None)
    assert [r["decode_ms"] for r in fr] == [10.0, 20.0, 20.0]
    assert [r["decode_ms"] for r in trr] == [5.0, 5.0, 10.0]
    row = {r[0]: r for r in bench.round_rows({"flowrl": fr, "trl": trr})}["generate ms / decode step"]
    assert row[1:4] == ["20.0 [10.0–20.0]", "5 [5–10.0]", "4.00× [2.00–4.00×]"]


def test_from_json_that_is_not_a_report_is_one_line(tmp_path, capsys):
    (tmp_path / "report.md").write_text("# not json\n")
    (tmp_path / "list.json").write_text("[]")
    for name, why in (("missing.json", "No such file"), ("report.md", "Expecting value"),
                      ("list.json", "not a report of this script")):
        path = tmp_path / name
        with pytest.raises(SystemExit) as e:
            bench.main(["--from-json", str(path), "--out", str(tmp_path / "out.md")])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f": error: --from-json {path}: " in err and why in err, err  # argparse's prog first
    assert not (tmp_path / "out.md").exists()


def test_device_growth_reports_memory_kept_from_step_to_step():
    """At af80c05 flowrl's peak device memory grew by one copy of the weights per weight sync; the
    report states steps 1, 2 and last and the growth per step after step 2 (step 1's sync
    allocates the staging buffers once), from `perf/peak_device_gib`."""
    leak = [{"perf": {"peak_device_gib": g}} for g in (20.8, 21.6, 22.4, 23.0)]
    first, second, last, per = bench.device_growth(leak)
    assert (first, second, last) == (20.8, 21.6, 23.0) and per == pytest.approx(1.4 / 2)
    # 0235d2f on an H100: the buffers once at step 1, then flat
    flat = [{"perf": {"peak_device_gib": g}} for g in (20.797, 21.615, 21.618, 21.618, 21.618)]
    assert bench.device_growth(flat)[3] == pytest.approx(0.001)
    two = bench.device_growth(leak[:2])  # two steps: the growth between them
    assert two[3] == pytest.approx(0.8)
    assert bench.device_growth(leak[:1]) is None  # one step: no growth to state
    assert bench.device_growth([{"perf": {}}, {"perf": {}}]) is None  # a CPU run: none recorded


def test_a_pair_that_cannot_fit_the_card_is_named_not_run():
    # the 1.5B pair needs ~108 GiB with both processes resident: an 80 GB H100 (79.2 GiB) refuses it
    gap = bench.pair_memory_gap("qwen15b", 79.18)
    assert gap == ("not run: the qwen15b pair needs ~108.2 GiB of device memory with both "
                   "frameworks' processes resident (measured on an H200); this GPU has 79.2 GiB "
                   "(--no-memory-check runs it anyway)")
    assert bench.pair_memory_gap("qwen15b", 139.8) is None  # an H200
    assert bench.pair_memory_gap("qwen15b", None) is None  # unknown memory: never refused
    assert bench.pair_memory_gap("qwen05b", 79.18) is None  # 62.6 GiB device-wide on the H100
    assert bench.main(["--suite", "gpu", "--plan", "--no-memory-check"]) == 0


def test_device_total_gib_without_a_driver_is_unknown(monkeypatch):
    import types

    def no_driver():
        raise OSError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    assert bench.device_total_gib(0) is None


@pytest.mark.parametrize("argv, message", [
    (["--suite", "gpu", "--plan", "rollout.vllm.gpu_memory_utilization=abc"],
     "flowrl override: rollout.vllm.gpu_memory_utilization=abc: rollout.vllm.gpu_memory_utilization "
     "takes a number, got 'abc'"),
    (["--suite", "gpu", "--device", "cpu", "--plan"], "--suite gpu runs on cuda: drop --device cpu, "
                                                       "or use --suite cpu"),
])
def test_a_bad_option_is_refused_before_any_model_is_built(argv, message, capsys):
    """A bad override failed each pair's child after the models were built and saved, and left
    an empty report; a suite given another device failed on vLLM."""
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
