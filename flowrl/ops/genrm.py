"""GenRM stage (role ``genrm``): a generative judge scores each response ``k`` times.

The judge is a causal LM with its own rollout engine (``HFRolloutEngine`` on its own model copy;
``reward.genrm.model`` in the run config, default = the run's model, i.e. SmolLM2). Prompt and
score parsing live in ``flowrl/rewards/genrm.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from flowrl.ops.fields import PROMPT, RESPONSE, Rewards
from flowrl.ops.registry import register_op
from flowrl.rewards.genrm import DEFAULT_JUDGE_TEMPLATE, render_judge_prompt

if TYPE_CHECKING:
    from torch import Tensor

    from flowrl.engines.base import RolloutEngine
    from flowrl.ops.context import StageContext


@dataclass
class GenRMConfig:
    """Attributes:
        template: judge prompt with ``{question}``, ``{response}``, ``{ground_truth}``
            (rendered through the judge tokenizer's chat template as the user turn).
        system_prompt: optional system message of the judge conversation.
        response_prefix: text put at the start of the judge's turn (after the chat template's
            generation prompt), e.g. ``"Score (0-10): "``: a small judge then writes the number
            first instead of wandering; the parser reads prefix + judgement.
        k: judgements per response; their parseable scores are averaged.
        max_new_tokens: judgement length limit.
        temperature: judge sampling temperature (0 = greedy, then ``k`` > 1 repeats itself).
        scale: maximum of a score written without a scale (``[[7]]``, ``Rating: 4.5``).
    """

    template: str = ""
    system_prompt: Optional[str] = None
    response_prefix: str = ""
    k: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.7
    scale: float = 10.0

    def __post_init__(self) -> None:
        self.template = self.template or DEFAULT_JUDGE_TEMPLATE
        render_judge_prompt(self.template, question="q", response="r", ground_truth="g",
                            stage="params")
        if self.k < 1 or self.max_new_tokens < 1:
            raise ValueError(f"k and max_new_tokens must be >= 1, got {self.k}, {self.max_new_tokens}")
        if self.temperature < 0 or self.scale <= 0:
            raise ValueError(f"temperature must be >= 0 and scale > 0, got {self.temperature}, {self.scale}")


@register_op("reward.genrm", inputs=PROMPT + RESPONSE + ("ground_truth",),
             config=GenRMConfig, roles=("genrm",),
             # the judge reads the policy's text alone: the tool results it answered are lost
             single_turn_inputs=RESPONSE)
def genrm_reward(ctx: StageContext[RolloutEngine], cfg: GenRMConfig, *, prompt_ids: Tensor,
                 prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                 ground_truth: list[str]) -> Rewards:
    """Judge every response k times; reward = mean parseable score.

    The score of a judgement is in [0, 1] (its scale's maximum ``scale``).

    Output: rewards (B,) float32; NaN when none of its ``k`` judgements had a readable score.
    Logged: ``reward/genrm/mean``, ``/std``, ``/unscorable`` (samples), ``/unparseable_frac``
    (judgements), ``/judge_length_mean`` (tokens).
    """
    import torch

    from flowrl.data.prompts import collate_prompts
    from flowrl.engines.base import SamplingConfig
    from flowrl.ops.reward import decode_responses, log_reward_stats, prompt_fields, response_prefix
    from flowrl.rewards.genrm import mean_of_judgements, parse_judge_score

    policy_tok = ctx.run.tokenizer
    judge_tok = ctx.run.judge_tokenizer
    responses = decode_responses(policy_tok, response_ids, response_mask, response_prefix(ctx))
    fields = prompt_fields(ctx, ground_truth, prompt_ids, prompt_mask)
    tokens = []
    for text, f in zip(responses, fields):
        user = render_judge_prompt(cfg.template, question=f.get("question", f.get("prompt", "")),
                                   response=text, ground_truth=f["ground_truth"], stage=ctx.stage)
        messages = [{"role": "user", "content": user}]
        if cfg.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        rendered = judge_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert isinstance(rendered, str)  # tokenize=False: the text
        rendered += cfg.response_prefix
        tokens.append(judge_tok(rendered, add_special_tokens=False)["input_ids"])
    rows = [t for t in tokens for _ in range(cfg.k)]  # row i*k + j = judgement j of response i
    ids, mask = collate_prompts(rows, judge_tok.pad_token_id)
    # the judge's text is parsed, its logprobs never read
    params = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            logprobs="none")
    out = ctx.engine.generate(ids, mask, params, generator=ctx.generator)
    judgements = decode_responses(judge_tok, out.response_ids, out.response_mask)
    scores = [parse_judge_score(cfg.response_prefix + j, scale=cfg.scale) for j in judgements]
    per_sample = [mean_of_judgements(scores[i * cfg.k:(i + 1) * cfg.k]) for i in range(len(tokens))]
    rewards = torch.tensor(per_sample, dtype=torch.float32)
    log_reward_stats(ctx, rewards, "reward/genrm")
    ctx.log(**{"reward/genrm/unparseable_frac": sum(not math.isfinite(s) for s in scores) / len(scores)})
    ctx.log(**{"reward/genrm/judge_length_mean": out.response_mask.sum(-1).float().mean()})
    return {"rewards": rewards}
