"""The reward graphs end to end on a tiny random model: GenRM (its judge's unreadable scores are
counted as unscorable and the run goes on) and DAPO (overlong shaping + dynamic sampling with
refill, and the max_attempts error). A slow test runs GenRM with the real SmolLM2 judge.
"""
import json
import math
import zlib
from pathlib import Path

import pytest

from flowrl.config import compose
from flowrl.train import prepare, train

BASE = ["model=tiny", "trainer=smoke", "data.limit=64", "logger.progress=false",
        "logger.console=false", "logger.tensorboard=false", "trainer.eval.before=false",
        "trainer.eval.after=false"]


def read_metrics(d: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (d / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["step"], {}).update(r)
    return rows


def test_genrm_graph_tiny_judge_unparseable_is_counted(tmp_path):
    cfg = compose(BASE + [f"trainer.output_dir={tmp_path}", "graph=genrm_grpo",
                          "trainer.total_steps=1"])
    plan = prepare(cfg).plan
    assert plan.roles == ["rollout", "genrm", "actor"]
    train(cfg)
    m = read_metrics(tmp_path)[1]
    B = 2 * 4  # trainer=smoke prompts x algorithm.n
    for k in ("reward/genrm/unparseable_frac", "reward/genrm/judge_length_mean", "reward/rule/mean",
              "reward/genrm/unscorable", "time/judge", "time/mix", "actor/optimizer_steps"):
        assert k in m, k
    # every NaN of the mix comes from the judge (the rule verifier always scores)
    assert m["reward/unscorable"] == m["reward/genrm/unscorable"]
    assert 0 <= m["reward/genrm/unscorable"] <= B
    if m["reward/genrm/unparseable_frac"] == 1.0:  # a random judge writes no score at all
        assert m["reward/unscorable"] == B and m["advantage/abs_mean"] == 0.0
    assert m["actor/optimizer_steps"] == 1  # the run went on


def varied_for_even_truths(text, ground_truth, **_):
    """Stand-in verifier: varied rewards for even answers, a constant 0 for odd ones."""
    if int(ground_truth.replace(",", "")) % 2:
        return 0.0
    return (zlib.crc32(text.encode()) % 3) / 2


def test_dapo_graph_filters_and_refills(tmp_path, monkeypatch):
    from flowrl.rewards import REWARD_FUNCTIONS

    monkeypatch.setitem(REWARD_FUNCTIONS, "gsm8k", varied_for_even_truths)
    cfg = compose(BASE + [f"trainer.output_dir={tmp_path}", "graph=dapo",
                          "trainer.prompts_per_step=4"])
    plan = prepare(cfg).plan
    assert plan.refill["filter"].upstream == ["sample", "rollout", "reward", "overlong", "mix"]
    train(cfg)
    rows = read_metrics(tmp_path)
    for step in (1, 2):
        m = rows[step]
        assert m["refill/groups"] == 4 and m["refill/attempts"] >= 1
        assert m["filter/kept_groups"] >= 4
        assert m["filter/kept_groups"] + m["filter/filtered_groups"] == 4 * m["refill/attempts"]
        assert m["filter/kept_groups"] - m["refill/surplus_groups"] == 4
        # soft overlong punishment: the tiny model runs to max_new_tokens=16 -> penalty -1
        assert m["reward/overlong/mean"] == -1.0 and m["reward/overlong/penalised_frac"] == 1.0
        assert m["advantage/mean"] == pytest.approx(0.0, abs=1e-6)
        assert m["actor/optimizer_steps"] == 1
        for k, v in m.items():
            if isinstance(v, float):
                assert math.isfinite(v), k


def test_dapo_graph_gives_up_with_a_clear_error(tmp_path, monkeypatch):
    from flowrl.graph import Graph
    from flowrl.rewards import REWARD_FUNCTIONS

    monkeypatch.setitem(REWARD_FUNCTIONS, "gsm8k", lambda text, gt, **_: 0.0)
    g = Graph.load(Path(__file__).resolve().parents[2] / "graphs" / "dapo.yaml")
    g["filter"].params["max_attempts"] = 4  # the shipped 16 would only make the test slower
    g.save(tmp_path / "dapo4.yaml")
    cfg = compose(BASE + [f"trainer.output_dir={tmp_path}", "graph=dapo", "trainer.total_steps=1",
                          f"graph.path={tmp_path / 'dapo4.yaml'}"])
    # a reward that is 0 for every sample: no knob of the filter helps, so none is suggested
    with pytest.raises(RuntimeError, match=r"stage 'filter': dynamic sampling kept 0 of the 2 "
                       r"groups it needs after 4 attempts: not one of the 8 groups sampled had "
                       r"two different rewards, so the reward is constant for this policy"):
        train(cfg)


def test_reward_model_role_needs_its_config_before_any_model_loads(tmp_path):
    from flowrl.graph import Graph

    g = Graph.load(Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml")
    rm = g.stage("rm", "reward.model", role="reward_model",
                 inputs={"prompt_ids": "sample.prompt_ids", "prompt_mask": "sample.prompt_mask",
                         "response_ids": "rollout.response_ids",
                         "response_mask": "rollout.response_mask"})
    g["advantage"].inputs["rewards"] = rm["rewards"]
    path = tmp_path / "rm.yaml"
    path.write_text(g.to_yaml())
    with pytest.raises(ValueError, match="set reward.model.model"):
        prepare(compose(BASE + [f"trainer.output_dir={tmp_path}", f"graph.path={path}"]))
    tiny = ("reward.model.model={tiny: {model_type: llama, hidden_size: 32, num_hidden_layers: 1, "
            "num_attention_heads: 2, num_key_value_heads: 1, intermediate_size: 64}}")
    cfg = compose(BASE + [f"trainer.output_dir={tmp_path}", f"graph.path={path}", tiny,
                          "trainer.total_steps=1"])
    plan = prepare(cfg).plan
    assert "reward_model" in plan.roles
    train(cfg)
    m = read_metrics(tmp_path)[1]
    assert m["reward/model/unscorable"] == 0 and math.isfinite(m["reward/model/mean"])
    assert m["reward/model/std"] > 0 and m["actor/optimizer_steps"] == 1


@pytest.mark.slow
def test_genrm_graph_with_the_real_smollm2_judge(tmp_path):
    cfg = compose(["graph=genrm_grpo", "trainer.total_steps=1", "trainer.prompts_per_step=2",
                   "rollout.sampling.max_new_tokens=64", "logger.progress=false",
                   "trainer.eval.before=false", "trainer.eval.after=false",
                   f"trainer.output_dir={tmp_path}"])
    train(cfg)
    m = read_metrics(tmp_path)[1]
    assert m["actor/optimizer_steps"] == 1
    assert 0.0 <= m["reward/genrm/unparseable_frac"] <= 1.0
    assert m["reward/genrm/judge_length_mean"] > 0
    assert m["reward/unscorable"] == m["reward/genrm/unscorable"]
