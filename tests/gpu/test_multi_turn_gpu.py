"""GPU tier: ``flowrl train graph=grpo_tools`` with multi-turn batches on CUDA, HF and vLLM
rollout (opt-in: ``pytest -m gpu tests/gpu``; the vLLM case also needs vLLM).

``graph=grpo_tools`` itself already runs in test_train_gpu.py's every-graph tests (a random model
writes no tool calls: one turn). Here an environment answers every turn (ForcedTurns) and one id
in five stops a turn, so the batches really hold several policy turns with observation tokens
between them: the bf16 rollout-vs-trainer mismatch bound of test_train_gpu.py must hold on them,
and vLLM's prefix cache must serve the earlier turns of each context.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train_gpu import MAX_TOL, MEAN_TOL, TINY, VLLM, has_vllm

from flowrl.envs.base import StepResult

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
REPO = Path(__file__).resolve().parents[2]


class ForcedTurns:
    def reset(self, row):
        pass

    def step(self, action):
        if action.turn >= 2:
            return StepResult(done=True, reward=len(action.token_ids) / 10)
        return StepResult(messages=[{"role": "user", "content": f"Noted ({action.turn}). Continue."}])


def forced_graph(tmp: Path) -> Path:
    text = (REPO / "graphs/grpo_tools.yaml").read_text()
    # the shipped graph takes the default env (tools): name this one in the rollout's params
    assert "  params:\n    tools:\n" in text
    text = text.replace("  params:\n    tools:\n",
                        f"  params:\n    env: {__name__}:ForcedTurns\n    tools:\n", 1)
    path = tmp / "forced.yaml"
    path.write_text(text.replace("rewards: reward.rewards", "rewards: rollout.rewards"))
    return path


def run(tmp: Path, *extra: str) -> dict[int, dict]:
    from flowrl.config import compose
    from flowrl.runtime.io.distributed import teardown
    from flowrl.runtime.io.metrics import read_metrics
    from flowrl.train import train

    cfg = compose([*TINY, "graph=grpo_tools", f"graph.path={forced_graph(tmp)}",
                   "rollout.sampling.max_new_tokens=16", f"trainer.output_dir={tmp}", *extra])
    cfg.rollout.sampling.stop_token_ids = list(range(3, 49152, 5))
    try:
        train(cfg)
    finally:
        teardown()
    return read_metrics(tmp)


def check(m: dict[int, dict], every_step: bool = True) -> None:
    """``every_step``: the mismatch is logged on step 2 too (HF; vLLM's default
    ``rollout.sampling.logprobs=sampled`` measures step 1 only here)."""
    for step in (1, 2):
        row = m[step]
        assert row["multi_turn/turns_mean"] > 1.5 and row["multi_turn/env_tokens_mean"] > 5
        if step == 1 or every_step:
            assert row["rollout/logprob_mismatch"] < MEAN_TOL, row["rollout/logprob_mismatch"]
            assert row["rollout/logprob_mismatch_max"] < MAX_TOL
        else:
            assert "rollout/logprob_mismatch" not in row
        assert row["actor/grad_norm"] > 0


def test_multi_turn_hf_gpu(tmp_path):
    check(run(tmp_path, "rollout=hf"))


@pytest.mark.vllm
@pytest.mark.skipif(not has_vllm(), reason="needs vLLM")
def test_multi_turn_vllm_gpu(tmp_path):
    m = run(tmp_path, *VLLM, "rollout.vllm.engine_procs=0", "rollout.vllm.enforce_eager=true")
    check(m, every_step=False)
    assert m[1]["multi_turn/prefix_cache_hit_frac"] > 0
