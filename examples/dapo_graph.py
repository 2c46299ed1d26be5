"""Build graphs/dapo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/dapo_graph.py > graphs/dapo.yaml

On top of the critic-free graph: the soft overlong punishment (``reward.overlong``, eq. 13) mixed
with the rule reward (``reward.mix``), and dynamic sampling (``filter.dynamic_sampling``, eq. 11)
that drops groups whose accuracy has zero variance and refills the batch (the executor re-runs
sample -> rollout -> reward until the step has its groups). Every stage after the filter reads the
filtered batch.
"""
from flowrl.graph import Graph
from flowrl.graph.graph import Stage
from rlvr_graph import critic_free_graph

FILTERED = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs",
            "truncated", "group_id")


def add_dynamic_sampling(g: Graph) -> Graph:
    """Insert overlong -> mix -> filter after ``reward`` and rewire the later stages to the
    filter's outputs (the compiler rejects a later stage that still reads the refilled stages)."""
    at = g.stage_names.index("reward") + 1
    src = {"prompt_ids": "sample", "prompt_mask": "sample", "group_id": "sample"}
    new = [
        Stage("overlong", "reward.overlong", inputs={"response_mask": "rollout.response_mask"},
              params={"max_length": "${rollout.sampling.max_new_tokens}", "buffer_fraction": 0.2}),
        Stage("mix", "reward.mix", inputs={"rule": "reward.rewards", "overlong": "overlong.rewards"},
              params={"weights": {"rule": 1.0, "overlong": 1.0}}),
        Stage("filter", "filter.dynamic_sampling",
              inputs={"rewards": "mix.rewards", "filter_by": "reward.rewards",
                      **{f: f"{src.get(f, 'rollout')}.{f}" for f in FILTERED}},
              params={"refill": True, "max_attempts": 16}),
    ]
    redirect = {f"{src.get(f, 'rollout')}.{f}": f"filter.{f}" for f in FILTERED}
    redirect["reward.rewards"] = "filter.rewards"
    for s in g.stages[at:]:
        s.inputs = {arg: redirect.get(ref, ref) for arg, ref in s.inputs.items()}
    g.stages[at:at] = new
    return g


def dapo_graph():
    return add_dynamic_sampling(critic_free_graph("dapo", (
        "DAPO (Yu et al. 2025) on GSM8K: sample -> rollout -> reward + soft overlong punishment\n"
        "-> dynamic sampling (drop groups with zero accuracy variance, refill up to 16 attempts)\n"
        "-> ref/old logprobs -> advantage.grpo -> update with clip-higher (0.2/0.28), token-mean\n"
        "loss and overlong filtering (algorithm.mask_truncated: truncated completions leave the loss).\n"
        "Run: flowrl train graph=dapo    Plan only: flowrl plan graph=dapo"), "grpo"))


if __name__ == "__main__":
    print(dapo_graph().to_yaml(), end="")
