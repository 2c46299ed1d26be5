"""GPU tier: ``placement.staleness=1`` on one GPU (runtime/control/overlap.py). The update runs in
a thread on a CUDA stream of its own while the rollout of the next step runs: vLLM in its engine
processes, or transformers' generate on the default stream in the main thread (the HF engine then
holds a copy of the weights). Each batch after the first is one weight version old."""
from __future__ import annotations

import json
import math

import pytest
import torch
from test_train_gpu import VLLM, has_vllm, run_train, stand_in_reward

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def varied_rewards(monkeypatch):
    from flowrl.rewards import REWARD_FUNCTIONS

    monkeypatch.setitem(REWARD_FUNCTIONS, "gsm8k", stand_in_reward)


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=[
    pytest.mark.vllm, pytest.mark.skipif(not has_vllm(), reason="needs vLLM")])])
def test_overlap_trains_one_version_behind_on_the_gpu(tmp_path, varied_rewards, backend):
    m = run_train(tmp_path, *(VLLM if backend == "vllm" else []), "placement.staleness=1",
                  "trainer.total_steps=3", "rollout.sampling.logprobs=all")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["version_lags"] == [0, 1, 1] and summary["staleness"] == 1
    for step in (1, 2, 3):
        row = m[step]
        for k, v in row.items():
            if isinstance(v, float):
                assert math.isfinite(v), (step, k, v)
        assert row["actor/grad_norm"] > 0 and row["placement/version_lag"] == (step > 1)
        assert "time/old_logprobs" in row and "perf/step_s/train" in row
        # the train half's store is on the GPU, the rollout half's on the host
        assert row["store/peak_device_bytes/train"] > 0 and row["store/peak_device_bytes/rollout"] == 0
    # step 1 is on-policy: sampler and trainer agree to bf16 rounding (test_train_gpu's bound)
    assert m[1]["rollout/logprob_mismatch"] < 0.05
    assert m[2]["perf/overlap/rollout_ahead_s"] > 0 and m[3]["perf/overlap/rollout_ahead_s"] == 0
    assert (tmp_path / "checkpoints" / "step_000003" / "trainer_state.json").is_file()
