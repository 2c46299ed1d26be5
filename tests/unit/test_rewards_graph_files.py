"""graphs/genrm_grpo.yaml and the DAPO additions: canonical file, Hydra option, compiled plans
(judge role and its swaps; the DAPO refill sub-graph), no model loaded."""
import warnings
from pathlib import Path

from flowrl.cli import main
from flowrl.config import compose
from flowrl.graph import Graph, UnusedOutputWarning, validate_graph
from flowrl.train import prepare

REPO = Path(__file__).resolve().parents[2]


def test_genrm_file_round_trips_and_validates_cleanly():
    from flowrl.config import graph_options

    text = (REPO / "graphs" / "genrm_grpo.yaml").read_text()
    assert Graph.from_yaml(text).to_yaml() == text
    assert "flowrl train graph=genrm_grpo" in text.splitlines()[4]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedOutputWarning)
        validate_graph(Graph.from_yaml(text))
    # graph=genrm_grpo is this file (no conf/graph copy); it changes no algorithm setting
    assert graph_options()["genrm_grpo"] == {"graph": {"path": "graphs/genrm_grpo.yaml"}}


def test_genrm_plan_swaps_the_judge_in_and_out(capsys):
    assert main(["plan", "graph=genrm_grpo", "trainer.output_dir=/tmp/x"]) == 0
    out = capsys.readouterr().out
    assert "roles with a model: rollout, genrm, actor" in out
    assert "onload  genrm          (for judge)" in out and "offload genrm" in out
    spec = prepare(compose(["graph=genrm_grpo", "trainer.output_dir=/tmp/x"]))
    cfg, plan = spec.config, spec.plan
    judge = next(c for c in plan.stages if c.stage.name == "judge")
    assert (judge.config.k, judge.config.max_new_tokens, judge.config.response_prefix) == \
        (2, 16, "Score (0-10): ")
    assert plan.graph["mix"].params == {"weights": {"rule": 1.0, "genrm": 0.5}}
    assert cfg.reward.genrm.model is None  # the judge is a copy of the run's model


def test_dapo_plan_has_overlong_mix_and_refill(capsys):
    assert main(["plan", "graph=dapo", "trainer.output_dir=/tmp/x"]) == 0
    out = capsys.readouterr().out
    assert ("refill  re-run sample -> rollout -> reward -> overlong -> mix -> filter until one "
            "attempt's number of groups are kept (at most 16 attempts)") in out
    plan = prepare(compose(["graph=dapo", "trainer.output_dir=/tmp/x",
                               "rollout.sampling.max_new_tokens=100"])).plan
    overlong = next(c for c in plan.stages if c.stage.name == "overlong").config
    assert (overlong.max_length, overlong.buffer_length) == (100, 20)  # L_cache = 0.2 L_max
    later = ("old_logprobs", "advantage", "update")
    for s in later:
        assert all(ref.startswith(("filter.", "old_logprobs.", "advantage.", "ref_logprobs."))
                   for ref in plan.graph[s].inputs.values()), s
