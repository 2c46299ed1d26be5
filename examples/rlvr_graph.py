"""Shared builder of the critic-free RLVR graphs (GRPO family, RLOO, REINFORCE++, GSPO, DAPO).

Each ``examples/<name>_graph.py`` calls :func:`critic_free_graph` with its estimator and writes
``graphs/<name>.yaml`` (``python examples/<name>_graph.py > graphs/<name>.yaml``); a test asserts
the builder output equals the file. PPO (actor + critic + ref) is ``examples/ppo_graph.py``.
"""
from flowrl.graph import Graph


def sample_rollout_reward(g: Graph):
    """The stages every GSM8K graph starts with; returns (sample, prompt refs, rollout, response
    refs, reward)."""
    sample = g.stage("sample", "data.sample")
    prompt = {"prompt_ids": sample["prompt_ids"], "prompt_mask": sample["prompt_mask"]}
    rollout = g.stage("rollout", "rollout.generate", role="rollout", inputs=prompt)
    response = {"response_ids": rollout["response_ids"], "response_mask": rollout["response_mask"]}
    reward = g.stage("reward", "reward.rule", params={"verifier": "gsm8k", "format_score": 0.1},
                     inputs={**response, "ground_truth": sample["ground_truth"]})
    return sample, prompt, rollout, response, reward


def critic_free_graph(name: str, description: str, estimator: str, *,
                      token_rewards: bool = False) -> Graph:
    """sample -> rollout -> reward -> old/ref logprobs [-> token_rewards] -> advantage.<estimator>
    -> update.policy, with the weight sync update -> rollout (on-policy).

    The ref stage runs only when ``algorithm.kl_coef > 0``; the old-logprob stage unless
    ``algorithm.recompute_old_logprobs=false`` (one on-policy update per batch). ``token_rewards=True`` adds
    ``reward.token_rewards`` (reward on the last token, minus β·KL when ``algorithm.kl_in_reward``)
    and feeds it to the estimator (REINFORCE++). Which algorithm knobs apply (loss aggregation,
    clip ratios, policy loss, KL placement) is the matching ``conf/graph/<name>.yaml``.
    """
    g = Graph(name, description=description)
    sample, prompt, rollout, response, reward = sample_rollout_reward(g)
    old = g.stage("old_logprobs", "logprobs", role="actor",
                  when="${algorithm.recompute_old_logprobs}",
                  inputs={**prompt, **response, "rollout_logprobs": rollout["rollout_logprobs"]})
    ref = g.stage("ref_logprobs", "logprobs", role="ref", when="${algorithm.kl_coef}",
                  inputs={**prompt, **response})
    adv_inputs = {"rewards": reward["rewards"], "group_id": sample["group_id"],
                  "response_mask": rollout["response_mask"]}
    if token_rewards:
        tr = g.stage("token_rewards", "reward.token_rewards",
                     inputs={"rewards": reward["rewards"], "response_mask": rollout["response_mask"],
                             "old_logprobs": old["logprobs"], "ref_logprobs": ref["logprobs"]})
        adv_inputs["token_rewards"] = tr["token_rewards"]
    adv = g.stage("advantage", f"advantage.{estimator}", inputs=adv_inputs)
    # ref_logprobs feed the KL *loss*; update.policy ignores them when algorithm.kl_in_reward
    update = g.stage("update", "update.policy", role="actor",
                     inputs={**prompt, **response, "old_logprobs": old["logprobs"],
                             "advantages": adv["advantages"], "ref_logprobs": ref["logprobs"],
                             "truncated": rollout["truncated"],
                             "rollout_logprobs": rollout["rollout_logprobs"]})
    g.sync(update, rollout, staleness=0)
    return g
