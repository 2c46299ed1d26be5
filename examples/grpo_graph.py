"""Build graphs/grpo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/grpo_graph.py > graphs/grpo.yaml
"""
from rlvr_graph import critic_free_graph


def grpo_graph():
    return critic_free_graph("grpo", (
        "GRPO (Shao et al. 2024) on GSM8K: sample -> rollout -> reward -> ref/old logprobs\n"
        "-> advantage -> update. The ref stage runs only when algorithm.kl_coef > 0; the old-logprob\n"
        "stage can be skipped with algorithm.recompute_old_logprobs=false (one update per batch).\n"
        "Run: flowrl train graph=grpo    Plan only: flowrl plan graph=grpo"), "grpo")


if __name__ == "__main__":
    print(grpo_graph().to_yaml(), end="")
