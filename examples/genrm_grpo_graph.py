"""Build graphs/genrm_grpo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/genrm_grpo_graph.py > graphs/genrm_grpo.yaml
"""
from flowrl.graph import Graph


def genrm_grpo_graph() -> Graph:
    g = Graph("genrm_grpo", description=(
        "GRPO on GSM8K scored by a generative judge (GenRM role) mixed with the rule verifier:\n"
        "sample -> rollout -> judge (k judgements, score parsed, NaN if unreadable) + rule\n"
        "-> mix (rule 1.0 + genrm 0.5; NaN in either = unscorable) -> logprobs -> advantage\n"
        "-> update. The judge is reward.genrm.model (default: the run's model, SmolLM2).\n"
        "Run: flowrl train graph=genrm_grpo    Plan only: flowrl plan graph=genrm_grpo"))
    sample = g.stage("sample", "data.sample")
    prompt = {"prompt_ids": sample["prompt_ids"], "prompt_mask": sample["prompt_mask"]}
    rollout = g.stage("rollout", "rollout.generate", role="rollout", inputs=prompt)
    response = {"response_ids": rollout["response_ids"], "response_mask": rollout["response_mask"]}
    judge = g.stage("judge", "reward.genrm", role="genrm",
                    params={"k": 2, "max_new_tokens": 16, "temperature": 0.7,
                            "response_prefix": "Score (0-10): "},
                    inputs={**prompt, **response, "ground_truth": sample["ground_truth"]})
    rule = g.stage("reward", "reward.rule", params={"verifier": "gsm8k", "format_score": 0.1},
                   inputs={**response, "ground_truth": sample["ground_truth"]})
    mix = g.stage("mix", "reward.mix", params={"weights": {"rule": 1.0, "genrm": 0.5}},
                  inputs={"rule": rule["rewards"], "genrm": judge["rewards"]})
    old = g.stage("old_logprobs", "logprobs", role="actor",
                  inputs={**prompt, **response, "rollout_logprobs": rollout["rollout_logprobs"]})
    ref = g.stage("ref_logprobs", "logprobs", role="ref", when="${algorithm.kl_coef}",
                  inputs={**prompt, **response})
    adv = g.stage("advantage", "advantage.grpo",
                  inputs={"rewards": mix["rewards"], "group_id": sample["group_id"],
                          "response_mask": rollout["response_mask"]})
    update = g.stage("update", "update.policy", role="actor",
                     inputs={**prompt, **response, "old_logprobs": old["logprobs"],
                             "advantages": adv["advantages"], "ref_logprobs": ref["logprobs"],
                             "truncated": rollout["truncated"]})
    g.sync(update, rollout, staleness=0)
    return g


if __name__ == "__main__":
    print(genrm_grpo_graph().to_yaml(), end="")
