"""Build graphs/reinforce_pp.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/reinforce_pp_graph.py > graphs/reinforce_pp.yaml
"""
from rlvr_graph import critic_free_graph


def reinforce_pp_graph():
    return critic_free_graph("reinforce_pp", (
        "REINFORCE++ (Hu 2025) on GSM8K: sample -> rollout -> reward -> ref/old logprobs\n"
        "-> token_rewards (reward on the last token - kl_coef * KL(old||ref) per token)\n"
        "-> advantage.reinforce_pp (return-to-go, batch-whitened) -> update. No critic.\n"
        "The ref stage runs only when algorithm.kl_coef > 0. Knobs: conf/graph/reinforce_pp.yaml.\n"
        "Run: flowrl train graph=reinforce_pp    Plan only: flowrl plan graph=reinforce_pp"),
        "reinforce_pp", token_rewards=True)


if __name__ == "__main__":
    print(reinforce_pp_graph().to_yaml(), end="")
