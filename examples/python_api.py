"""Build an iteration graph with the Python API: GRPO whose reward mixes the GSM8K verifier with
DAPO's soft overlong penalty (a variant that is not one of flowrl's graphs/*.yaml).

The built-in graphs are YAML files (graphs/<name>.yaml, the one source of each); this shows the
same vocabulary from Python: ``g.stage(name, op, role=, inputs=, params=, when=)`` returns a stage
whose ``stage["output"]`` is a reference for later inputs, and ``g.sync`` adds the weight sync.

Run:  python examples/python_api.py > my_graph.yaml
      flowrl graph validate my_graph.yaml
      flowrl train graph.path=my_graph.yaml      (or copy it to ./graphs/<name>.yaml: graph=<name>)
"""
from flowrl.graph import Graph, validate_graph


def overlong_grpo_graph() -> Graph:
    g = Graph("grpo_overlong", description=(
        "GRPO with a length-shaped reward (on the run's data: default arith, data=gsm8k for\n"
        "GSM8K): sample -> rollout -> rule reward + soft\n"
        "overlong penalty -> mix -> ref/old logprobs -> advantage.grpo -> update.\n"
        "Built by examples/python_api.py. Run: flowrl train graph.path=my_graph.yaml"))
    sample = g.stage("sample", "data.sample")
    prompt = {"prompt_ids": sample["prompt_ids"], "prompt_mask": sample["prompt_mask"]}
    rollout = g.stage("rollout", "rollout.generate", role="rollout", inputs=prompt)
    response = {"response_ids": rollout["response_ids"], "response_mask": rollout["response_mask"]}
    rule = g.stage("reward", "reward.rule",  # RuleRewardConfig's verifier: gsm8k
                   inputs={**response, "ground_truth": sample["ground_truth"]})
    # params may interpolate the run config; they resolve when the plan is compiled
    overlong = g.stage("overlong", "reward.overlong",
                       inputs={"response_mask": rollout["response_mask"]},
                       params={"max_length": "${rollout.sampling.max_new_tokens}"})
    mix = g.stage("mix", "reward.mix", params={"weights": {"rule": 1.0, "overlong": 0.5}},
                  inputs={"rule": rule["rewards"], "overlong": overlong["rewards"]})
    old = g.stage("old_logprobs", "logprobs", role="actor",
                  when="${algorithm.recompute_old_logprobs}",
                  inputs={**prompt, **response, "rollout_logprobs": rollout["rollout_logprobs"]})
    # `when` prunes the stage (and unbinds the inputs it fed) when false: no KL, no ref model
    ref = g.stage("ref_logprobs", "logprobs", role="ref", when="${algorithm.kl_coef}",
                  inputs={**prompt, **response})
    adv = g.stage("advantage", "advantage.grpo",
                  inputs={"rewards": mix["rewards"], "group_id": sample["group_id"],
                          "response_mask": rollout["response_mask"]})
    update = g.stage("update", "update.policy", role="actor",
                     inputs={**prompt, **response, "old_logprobs": old["logprobs"],
                             "advantages": adv["advantages"], "ref_logprobs": ref["logprobs"],
                             "truncated": rollout["truncated"],
                             "rollout_logprobs": rollout["rollout_logprobs"]})
    g.sync(update, rollout, staleness=0)  # on-policy: the next rollout waits for these weights
    return g


if __name__ == "__main__":
    graph = overlong_grpo_graph()
    validate_graph(graph)  # flowrl graph validate's rules: a typo stops here, one line each
    print(graph.to_yaml(), end="")
