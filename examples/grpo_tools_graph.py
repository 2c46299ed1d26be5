"""Build graphs/grpo_tools.yaml with the Python API (the file is exactly this graph's dump):
GRPO whose rollout is multi-turn with a calculator tool (``rollout.multi_turn``).

Run: python examples/grpo_tools_graph.py > graphs/grpo_tools.yaml
"""
from rlvr_graph import critic_free_graph


def grpo_tools_graph():
    g = critic_free_graph("grpo_tools", (
        "GRPO on GSM8K with a calculator tool: sample -> multi-turn rollout (the policy may call\n"
        "calculator(expression) in <tool_call>{json}</tool_call> blocks; each result comes back\n"
        "as a tool message, up to 4 policy turns / 512 response tokens) -> reward (GSM8K rule on\n"
        "the policy's text) -> ref/old logprobs -> advantage -> update. Tool results are context:\n"
        "response_mask covers the policy's own tokens only.\n"
        "Run: flowrl train graph=grpo_tools    Plan only: flowrl plan graph=grpo_tools\n"
        "Real SmolLM2 on CPU, shortened: flowrl train graph=grpo_tools trainer.total_steps=2 "
        "trainer.prompts_per_step=2 trainer.eval.limit=4"), "grpo")
    rollout = g["rollout"]
    rollout.op = "rollout.multi_turn"
    rollout.inputs.update(ground_truth="sample.ground_truth", group_id="sample.group_id")
    rollout.params = {"env": "tools", "tools": ["calculator"], "max_turns": 4,
                      "max_total_tokens": 512, "tool_workers": 2, "tool_timeout_s": 5.0}
    return g


if __name__ == "__main__":
    print(grpo_tools_graph().to_yaml(), end="")
