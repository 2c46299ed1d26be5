"""GenRM stage (role ``genrm``): a generative judge scores each response ``k`` times.

The judge is a causal LM with its own rollout engine (``HFRolloutEngine`` on its own model copy;
``reward.genrm.model`` in the run config, default = the run's model, i.e. SmolLM2). Prompt and
score parsing live in ``flowrl/rewards/genrm.py``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from flowrl.ops.builtin import GenRMConfig  # noqa: F401 (re-exported)
from flowrl.ops.context import StageContext
from flowrl.ops.registry import implements

if TYPE_CHECKING:
    from flowrl.engines.base import RolloutEngine



@implements("reward.genrm")
def genrm_reward(ctx: StageContext[RolloutEngine], cfg: GenRMConfig, *, prompt_ids, prompt_mask, response_ids,
                 response_mask, ground_truth) -> dict:
    """Judge every response ``k`` times; reward = mean parseable score in [0, 1].

    Output: rewards (B,) float32; NaN when none of its ``k`` judgements had a readable score.
    Logged: ``reward/genrm/mean``, ``/std``, ``/unscorable`` (samples), ``/unparseable_frac``
    (judgements), ``/judge_length_mean`` (tokens).
    """
    from flowrl.data.prompts import collate_prompts
    from flowrl.engines.base import SamplingConfig
    from flowrl.ops.reward import decode_responses, log_reward_stats, prompt_fields, response_prefix
    from flowrl.rewards.genrm import mean_of_judgements, parse_judge_score, render_judge_prompt

    policy_tok = ctx.resource("tokenizer")
    judge_tok = ctx.resources.get("genrm_tokenizer", policy_tok)
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
        rendered += cfg.response_prefix
        tokens.append(judge_tok(rendered, add_special_tokens=False)["input_ids"])
    rows = [t for t in tokens for _ in range(cfg.k)]  # row i*k + j = judgement j of response i
    ids, mask = collate_prompts(rows, judge_tok.pad_token_id)
    params = SamplingConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
    out = ctx.engine.generate(ids, mask, params, generator=ctx.generator)
    judgements = decode_responses(judge_tok, out.response_ids, out.response_mask)
    scores = [parse_judge_score(cfg.response_prefix + j, scale=cfg.scale) for j in judgements]
    per_sample = [mean_of_judgements(scores[i * cfg.k:(i + 1) * cfg.k]) for i in range(len(tokens))]
    rewards = torch.tensor(per_sample, dtype=torch.float32)
    log_reward_stats(ctx, rewards, "reward/genrm")
    ctx.log(**{"reward/genrm/unparseable_frac": sum(not math.isfinite(s) for s in scores) / len(scores)})
    ctx.log(**{"reward/genrm/judge_length_mean": out.response_mask.sum(-1).float().mean()})
    return {"rewards": rewards}
