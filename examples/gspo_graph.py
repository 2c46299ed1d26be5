"""Build graphs/gspo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/gspo_graph.py > graphs/gspo.yaml
"""
from rlvr_graph import critic_free_graph


def gspo_graph():
    return critic_free_graph("gspo", (
        "GSPO (Zheng et al. 2025) on GSM8K: sample -> rollout -> reward -> ref/old logprobs\n"
        "-> advantage.grpo -> update with the sequence-level ratio (algorithm.policy_loss=gspo).\n"
        "The ref stage runs only when algorithm.kl_coef > 0. Knobs: conf/graph/gspo.yaml.\n"
        "Run: flowrl train graph=gspo    Plan only: flowrl plan graph=gspo"), "grpo")


if __name__ == "__main__":
    print(gspo_graph().to_yaml(), end="")
