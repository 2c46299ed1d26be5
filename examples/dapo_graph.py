"""Build graphs/dapo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/dapo_graph.py > graphs/dapo.yaml

Extension point (rewards work, not here yet): DAPO's dynamic sampling is a filter stage between
``reward`` and ``advantage`` that drops groups whose rewards are all equal (and resamples to refill
the batch); its soft overlong punishment is a reward-shaping stage after ``reward``. Insert both
into this builder and rewire ``advantage``/``update`` to the filtered outputs.
"""
from rlvr_graph import critic_free_graph


def dapo_graph():
    return critic_free_graph("dapo", (
        "DAPO (Yu et al. 2025) on GSM8K: sample -> rollout -> reward -> ref/old logprobs\n"
        "-> advantage.grpo -> update with clip-higher (0.2/0.28), token-mean loss and\n"
        "overlong filtering (algorithm.mask_truncated: truncated completions leave the loss).\n"
        "TODO(rewards issue): dynamic sampling = a filter stage between reward and advantage;\n"
        "soft overlong punishment = a shaping stage after reward (see examples/dapo_graph.py).\n"
        "Run: flowrl train graph=dapo    Plan only: flowrl plan graph=dapo"), "grpo")


if __name__ == "__main__":
    print(dapo_graph().to_yaml(), end="")
