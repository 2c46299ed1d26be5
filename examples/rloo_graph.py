"""Build graphs/rloo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/rloo_graph.py > graphs/rloo.yaml
"""
from rlvr_graph import critic_free_graph


def rloo_graph():
    return critic_free_graph("rloo", (
        "RLOO (Ahmadian et al. 2024) on GSM8K: sample -> rollout -> reward -> ref/old logprobs\n"
        "-> advantage.rloo (leave-one-out baseline, needs algorithm.n >= 2) -> update.\n"
        "The ref stage runs only when algorithm.kl_coef > 0. Knobs: conf/graph/rloo.yaml.\n"
        "Run: flowrl train graph=rloo    Plan only: flowrl plan graph=rloo"), "rloo")


if __name__ == "__main__":
    print(rloo_graph().to_yaml(), end="")
