"""`flowrl train graph=grpo_tools` on the tiny model (HF engine): 2 GRPO steps with multi-turn
rollouts. The random model writes no tool calls, so a second run swaps in an environment that
answers every turn (ForcedTurns) and a stop set that ends turns early: real multi-turn batches go
through logprobs and the update, and the rollout-vs-trainer mismatch stays at fp32 noise."""
from pathlib import Path

from flowrl.config import compose
from flowrl.envs.base import StepResult
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import train

REPO = Path(__file__).resolve().parents[2]
BASE = ["graph=grpo_tools", "model=tiny", "trainer=smoke", "data.limit=16", "logger.progress=false",
        "logger.tensorboard=false", "trainer.eval.limit=2"]


class ForcedTurns:
    """Every turn gets an observation until the third: a multi-turn trajectory from any policy;
    the environment's reward (fed to the advantage) is the last turn's length / 10."""

    def reset(self, row):
        pass

    def step(self, action):
        if action.turn >= 2:  # a reward that differs within a group: non-zero advantages
            return StepResult(done=True, reward=len(action.token_ids) / 10)
        return StepResult(messages=[{"role": "user", "content": f"Noted ({action.turn}). Continue."}])


def forced_graph(tmp: Path) -> Path:
    text = (REPO / "graphs/grpo_tools.yaml").read_text()
    path = tmp / "forced.yaml"
    # the shipped graph takes the default env (tools): name this one in the rollout's params
    assert "  params:\n    tools:\n" in text
    text = text.replace("  params:\n    tools:\n", f"  params:\n    env: {__name__}:ForcedTurns\n    tools:\n", 1)
    path.write_text(text.replace("rewards: reward.rewards", "rewards: rollout.rewards"))
    return path


def test_grpo_tools_two_steps(tmp_path):
    summary = train(compose(BASE + [f"trainer.output_dir={tmp_path}"]))
    m = read_metrics(tmp_path)
    assert sorted(m) == [0, 1, 2]
    for step in (1, 2):
        row = m[step]
        for key in ("multi_turn/turns_mean", "multi_turn/tool_calls_mean",
                    "multi_turn/finish_max_tokens_frac", "perf/tool_s", "actor/pg_loss"):
            assert key in row, key
        assert row["rollout/logprob_mismatch"] < 1e-4
        assert row["actor/optimizer_steps"] == 1
    assert summary["eval_after"]["eval/n"] == 2


def test_forced_multi_turn_batches_train_on_policy(tmp_path):
    cfg = compose(BASE + [f"trainer.output_dir={tmp_path}", f"graph.path={forced_graph(tmp_path)}",
                          "rollout.sampling.max_new_tokens=8", "trainer.eval.before=false"])
    # one id in five stops a turn: the random model's turns end early (otherwise: max_tokens)
    cfg.rollout.sampling.stop_token_ids = list(range(3, 49152, 5))
    train(cfg)
    m = read_metrics(tmp_path)
    for step in (1, 2):
        row = m[step]
        assert row["multi_turn/turns_mean"] > 1.5, row["multi_turn/turns_mean"]
        assert row["multi_turn/env_tokens_mean"] > 5
        assert row["multi_turn/finish_answered_frac"] > 0
        # the trainer scores the sampled ids with the observations as context
        assert row["rollout/logprob_mismatch"] < 1e-4, row["rollout/logprob_mismatch"]
        assert row["actor/grad_norm"] > 0
