"""Build graphs/grpo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/grpo_graph.py > graphs/grpo.yaml
"""
from flowrl.graph import Graph


def grpo_graph() -> Graph:
    g = Graph("grpo", description=(
        "GRPO (Shao et al. 2024) on GSM8K: sample -> rollout -> reward -> ref/old logprobs\n"
        "-> advantage -> update. The ref stage runs only when algorithm.kl_coef > 0; the old-logprob\n"
        "stage can be skipped with algorithm.recompute_old_logprobs=false (one update per batch).\n"
        "Run: flowrl train graph=grpo    Plan only: flowrl plan graph=grpo"))
    sample = g.stage("sample", "data.sample")
    prompt = {"prompt_ids": sample["prompt_ids"], "prompt_mask": sample["prompt_mask"]}
    rollout = g.stage("rollout", "rollout.generate", role="rollout", inputs=prompt)
    response = {"response_ids": rollout["response_ids"], "response_mask": rollout["response_mask"]}
    reward = g.stage("reward", "reward.rule", params={"verifier": "gsm8k", "format_score": 0.1},
                     inputs={**response, "ground_truth": sample["ground_truth"]})
    old = g.stage("old_logprobs", "logprobs", role="actor",
                  when="${algorithm.recompute_old_logprobs}",
                  inputs={**prompt, **response, "rollout_logprobs": rollout["rollout_logprobs"]})
    ref = g.stage("ref_logprobs", "logprobs", role="ref", when="${algorithm.kl_coef}",
                  inputs={**prompt, **response})
    adv = g.stage("advantage", "advantage.grpo",
                  inputs={"rewards": reward["rewards"], "group_id": sample["group_id"],
                          "response_mask": rollout["response_mask"]})
    update = g.stage("update", "update.policy", role="actor",
                     inputs={**prompt, **response, "old_logprobs": old["logprobs"],
                             "advantages": adv["advantages"], "ref_logprobs": ref["logprobs"],
                             "truncated": rollout["truncated"],
                             "rollout_logprobs": rollout["rollout_logprobs"]})
    g.sync(update, rollout, staleness=0)
    return g


if __name__ == "__main__":
    print(grpo_graph().to_yaml(), end="")
