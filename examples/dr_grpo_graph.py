"""Build graphs/dr_grpo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/dr_grpo_graph.py > graphs/dr_grpo.yaml
"""
from rlvr_graph import critic_free_graph


def dr_grpo_graph():
    return critic_free_graph("dr_grpo", (
        "Dr.GRPO (Liu et al. 2025) on GSM8K: sample -> rollout -> reward -> ref/old logprobs\n"
        "-> advantage.dr_grpo (r - group mean, no std) -> update (seq-mean-token-sum-norm).\n"
        "The ref stage runs only when algorithm.kl_coef > 0. Knobs: conf/graph/dr_grpo.yaml.\n"
        "Run: flowrl train graph=dr_grpo    Plan only: flowrl plan graph=dr_grpo"), "dr_grpo")


if __name__ == "__main__":
    print(dr_grpo_graph().to_yaml(), end="")
