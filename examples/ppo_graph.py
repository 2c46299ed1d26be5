"""Build graphs/ppo.yaml with the Python API (the file is exactly this graph's dump).

Run: python examples/ppo_graph.py > graphs/ppo.yaml
"""
from flowrl.graph import Graph
from rlvr_graph import sample_rollout_reward


def ppo_graph() -> Graph:
    g = Graph("ppo", description=(
        "PPO (Schulman et al. 2017; Ouyang et al. 2022) on GSM8K with actor + critic + ref:\n"
        "sample -> rollout -> reward -> old/ref logprobs, critic values -> token_rewards\n"
        "(reward on the last token - kl_coef * KL(old||ref)) -> advantage.gae (returns too)\n"
        "-> update.policy (actor) + update.critic (clipped value loss). Knobs: conf/graph/ppo.yaml.\n"
        "Run: flowrl train graph=ppo    Plan only: flowrl plan graph=ppo"))
    sample, prompt, rollout, response, reward = sample_rollout_reward(g)
    old = g.stage("old_logprobs", "logprobs", role="actor",
                  inputs={**prompt, **response, "rollout_logprobs": rollout["rollout_logprobs"]})
    ref = g.stage("ref_logprobs", "logprobs", role="ref", when="${algorithm.kl_coef}",
                  inputs={**prompt, **response})
    values = g.stage("values", "values", role="critic", inputs={**prompt, **response})
    tr = g.stage("token_rewards", "reward.token_rewards",
                 inputs={"rewards": reward["rewards"], "response_mask": rollout["response_mask"],
                         "old_logprobs": old["logprobs"], "ref_logprobs": ref["logprobs"]})
    adv = g.stage("advantage", "advantage.gae",
                  inputs={"rewards": reward["rewards"], "group_id": sample["group_id"],
                          "response_mask": rollout["response_mask"],
                          "token_rewards": tr["token_rewards"], "values": values["values"]})
    # ref_logprobs feed the KL *loss*; update.policy ignores them when algorithm.kl_in_reward
    update = g.stage("update", "update.policy", role="actor",
                     inputs={**prompt, **response, "old_logprobs": old["logprobs"],
                             "advantages": adv["advantages"], "ref_logprobs": ref["logprobs"],
                             "truncated": rollout["truncated"]})
    g.stage("update_critic", "update.critic", role="critic",
            inputs={**prompt, **response, "values": values["values"], "returns": adv["returns"],
                    "truncated": rollout["truncated"]})
    g.sync(update, rollout, staleness=0)
    return g


if __name__ == "__main__":
    print(ppo_graph().to_yaml(), end="")
