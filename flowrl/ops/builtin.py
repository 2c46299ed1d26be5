"""The built-in ops as graph files see them: each op's name, inputs, outputs, roles and params
(its ``Config`` dataclass, where each op default lives once), and the module that implements it.

This is the vocabulary of ``graphs/*.yaml``. It imports no torch and no op code, so a graph is
validated and a plan printed without them (``OpSpec.fn`` imports the implementing module on first
use, whose ``@implements(name)`` binds the function and checks its arguments against the
declaration here). Tensor shapes and dtypes of each input/output: the implementing function's
docstring and DESIGN.md "Data that flows".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from flowrl.algorithms.variants import ESTIMATORS, POLICY_LOSSES, SFT_LOSSES
from flowrl.envs.config import MultiTurnConfig
from flowrl.ops.spec import LIST, NoConfig, OpSpec
from flowrl.rewards import REWARD_FUNCTIONS
from flowrl.rewards.function import load_reward_function
from flowrl.rewards.genrm import DEFAULT_JUDGE_TEMPLATE, render_judge_prompt

PROMPT = ("prompt_ids", "prompt_mask")
RESPONSE = ("response_ids", "response_mask")
# (B, ...) batch fields dynamic sampling carries through; any may be left unbound (output None)
CARRIED = PROMPT + RESPONSE + ("rollout_logprobs", "truncated")
# a vision-language batch's image inputs (flowrl.data.images): (B, N, D) patches and (B, K, 3)
# grids, store entries read by the rollout, every logprob stage and the update (graphs/grpo_vl.yaml)
VISION = ("pixel_values", "image_grid_thw")
# the components reward.mix sums, each an optional input
MIX_COMPONENTS = ("rule", "function", "model", "genrm", "format", "overlong")


# --------------------------------------------------------------------------- op configs
@dataclass
class LogprobsConfig:
    """with_entropy: also log the policy entropy (nats, mean over valid tokens)."""

    with_entropy: bool = False


@dataclass
class PolicyUpdateConfig:
    """policy_loss: the policy-gradient objective, a name of ``algorithms/variants.py``
    POLICY_LOSSES: ``ppo_clip`` (token-level ratio, PPO clip), ``gspo`` (GSPO's sequence-level
    ratio: the length-normalised sum of token log-ratios), ``vanilla`` (no ratio, REINFORCE-style).
    Its clip ranges and aggregation are the run's ``algorithm`` numbers."""

    policy_loss: str = "ppo_clip"

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {list(POLICY_LOSSES)}, "
                             f"got {self.policy_loss!r}")


@dataclass
class SFTUpdateConfig:
    """loss: the supervised objective, a name of ``algorithms/variants.py`` SFT_LOSSES: ``nll``
    (the negative log-likelihood of the given response tokens, aggregated by
    ``algorithm.loss_agg_mode``). temperature: the student's softmax temperature in that NLL
    (1: the model's own distribution, what SFT fits; the samples themselves came at
    ``rollout.sampling.temperature``)."""

    loss: str = "nll"
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.loss not in SFT_LOSSES:
            raise ValueError(f"loss must be one of {list(SFT_LOSSES)}, got {self.loss!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass
class RuleRewardConfig:
    """verifier: key in ``flowrl.rewards.REWARD_FUNCTIONS``; format_score: reward for a
    well-formed but wrong answer (0: a policy must not earn reward without the right answer, e.g.
    by a ``#### <a number copied from the question>`` line, issue 25); fallback_last_number:
    accept the last number when no ``####`` (on: the answer is what the response ends with, in any
    format, compared exactly; SmolLM2-135M writes ``63 + 78 = 141``, never ``####``, so a strict
    verifier gives GRPO groups of zeros; ``benchmarks/results/task_baseline_cpu.md``)."""

    verifier: str = "gsm8k"
    format_score: float = 0.0
    fallback_last_number: bool = True

    def __post_init__(self) -> None:
        if self.verifier not in REWARD_FUNCTIONS:
            raise ValueError(f"verifier must be one of {sorted(REWARD_FUNCTIONS)}, got {self.verifier!r}")


@dataclass
class FunctionRewardConfig:
    """A user reward function (contract: ``flowrl.rewards.function``).

    Attributes:
        path: ``"package.module:function"``; imported when the graph is compiled, so a bad path
            fails before any model loads.
        num_workers: 0 = call in the trainer process; >= 1 = a process pool of that size.
        timeout_s: per-call limit in seconds (None or 0 = none); a call over it scores NaN.
        weights: component name → weight for functions returning a dict (absent names: 1.0).
    """

    path: str = ""
    num_workers: int = 0
    timeout_s: Optional[float] = 30.0
    weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.timeout_s is not None and self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or null, got {self.timeout_s}")
        load_reward_function(self.path)
        self.weights = dict(self.weights)


@dataclass
class OverlongConfig:
    """DAPO soft overlong punishment (``flowrl.rewards.shaping.overlong_penalty``).

    Attributes:
        max_length: L_max in tokens; usually ``${rollout.sampling.max_new_tokens}``.
        buffer_length: L_cache, the width of the linear penalty ramp before L_max (DAPO: 4096
            of 20480); 0 = ``buffer_fraction * max_length`` (rounded, at least 1), so one graph
            fits any generation length.
        buffer_fraction: used when ``buffer_length`` is 0 (DAPO's ratio is 0.2).
        penalty_factor: scale of the penalty (1.0 = the paper's).
    """

    max_length: int = 256
    buffer_length: int = 0
    buffer_fraction: float = 0.2
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.buffer_fraction <= 1:
            raise ValueError(f"buffer_fraction must be in (0, 1], got {self.buffer_fraction}")
        if self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")
        if self.buffer_length == 0:
            self.buffer_length = max(1, round(self.buffer_fraction * self.max_length))
        if not 1 <= self.buffer_length <= self.max_length:
            raise ValueError(f"need 1 <= buffer_length <= max_length, got buffer_length="
                             f"{self.buffer_length}, max_length={self.max_length}")
        if self.penalty_factor < 0:
            raise ValueError(f"penalty_factor must be >= 0, got {self.penalty_factor}")


@dataclass
class MixConfig:
    """weights: component name (an input of ``reward.mix``) → weight. A bound component without
    an entry weighs 1.0; an entry for an unbound component (e.g. a stage pruned by ``when``) is
    ignored. Weight 0 leaves a component out of the sum (it is still logged)."""

    weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.weights = {str(k): float(v) for k, v in dict(self.weights).items()}
        unknown = sorted(set(self.weights) - set(MIX_COMPONENTS))
        if unknown:
            raise ValueError(f"weights: unknown component(s) {unknown}; components: {list(MIX_COMPONENTS)}")


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


@dataclass
class DynamicSamplingConfig:
    """Attributes:
        refill: re-sample until ``target_groups`` informative groups are in (the executor
            re-runs the upstream sub-graph); False = just drop (error if nothing is left).
        max_attempts: sample → … → filter passes per step at most (the first one included).
        target_groups: groups the step trains on; 0 = as many as one attempt samples.
        min_std: a group with std <= min_std counts as constant (0 = exactly constant).
    """

    refill: bool = True
    max_attempts: int = 4
    target_groups: int = 0
    min_std: float = 0.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.target_groups < 0:
            raise ValueError(f"target_groups must be >= 0, got {self.target_groups}")
        if self.min_std < 0:
            raise ValueError(f"min_std must be >= 0, got {self.min_std}")


# --------------------------------------------------------------------------- declarations
def _op(name: str, module: str, doc: str, *, inputs: tuple[str, ...] = (),
        outputs: tuple[str, ...] = (), optional_inputs: tuple[str, ...] = (),
        config: type = NoConfig, roles: tuple[str, ...] = (),
        kinds: dict[str, str] | None = None, trains: bool = False,
        multi_turn_outputs: tuple[str, ...] = (), single_turn_inputs: tuple[str, ...] = (),
        info_outputs: tuple[str, ...] = ()) -> OpSpec:
    return OpSpec(name=name, inputs=inputs, outputs=outputs, optional_inputs=optional_inputs,
                  config_cls=config, roles=roles, doc=doc, module=f"flowrl.ops.{module}",
                  kinds=dict(kinds or {}), trains=trains, multi_turn_outputs=multi_turn_outputs,
                  single_turn_inputs=single_turn_inputs, info_outputs=info_outputs)


# per-trajectory metadata of rollout.multi_turn, which a graph may leave unconsumed
MULTI_TURN_INFO = ("rewards", "num_turns", "num_tool_calls", "num_tool_errors", "finish_reason")
GT_LIST = {"ground_truth": LIST}  # the reference answers: one string per sample, not a tensor


def _advantage_ops() -> list[OpSpec]:
    """One op per estimator of ``algorithms/variants.py``: estimators that read the critic
    (GAE) require ``token_rewards`` and ``values`` (an unbound one is a validation error before
    any model loads), the others take them optionally; only estimators whose returns differ from
    the advantages output ``returns``. A distillation estimator (``needs_logprobs``) reads the
    student's and the teacher's logprobs of the sampled tokens, and optionally a task
    estimator's ``advantages`` to add its own to (GRPO + distillation)."""
    out = []
    for name, est in ESTIMATORS.items():
        critic = ("token_rewards", "values")
        if est.needs_logprobs:
            out.append(_op(
                f"advantage.{name}", "advantage", f"Advantages from estimator {name!r}",
                inputs=("response_mask", "old_logprobs", "teacher_logprobs"),
                optional_inputs=("advantages",), outputs=("advantages",)))
            continue
        out.append(_op(
            f"advantage.{name}", "advantage", f"Advantages from estimator {name!r}",
            inputs=("rewards", "group_id", "response_mask") + (critic if est.needs_values else ()),
            optional_inputs=() if est.needs_values else critic,
            outputs=("advantages", "returns") if est.produces_returns else ("advantages",)))
    return out


BUILTIN_OPS: list[OpSpec] = [
    _op("data.sample", "sample", "Draw prompts_per_step prompts, each repeated algorithm.n times",
        outputs=PROMPT + ("group_id", "ground_truth"), kinds=GT_LIST),
    _op("data.sample_images", "vision",
        "data.sample for prompts with images: also the rows' pixel_values and image_grid_thw",
        outputs=PROMPT + ("group_id", "ground_truth") + VISION, kinds=GT_LIST),
    _op("rollout.generate", "rollout", "One response per prompt row with rollout.sampling",
        inputs=PROMPT, optional_inputs=VISION,
        outputs=RESPONSE + ("rollout_logprobs", "truncated"), roles=("rollout",)),
    _op("teacher.generate", "rollout",
        "The teacher samples one response per prompt row with rollout.sampling (never synced)",
        inputs=PROMPT, outputs=RESPONSE + ("truncated",), roles=("teacher_rollout",)),
    _op("rollout.multi_turn", "multi_turn",
        "Policy and environment alternate per prompt (tools, max_turns); standard outputs",
        inputs=PROMPT, optional_inputs=("ground_truth", "group_id"),
        outputs=RESPONSE + ("rollout_logprobs", "truncated") + MULTI_TURN_INFO,
        config=MultiTurnConfig, roles=("rollout",), kinds={**GT_LIST, "finish_reason": LIST},
        multi_turn_outputs=RESPONSE + ("rollout_logprobs",), info_outputs=MULTI_TURN_INFO),
    _op("reward.rule", "reward", "Score each response against its ground truth (a verifier)",
        inputs=RESPONSE + ("ground_truth",), outputs=("rewards",), config=RuleRewardConfig,
        kinds=GT_LIST),
    _op("reward.function", "reward", "Call the user's reward function on every response",
        inputs=RESPONSE + ("ground_truth", "group_id"), optional_inputs=PROMPT,
        outputs=("rewards",), config=FunctionRewardConfig, kinds=GT_LIST),
    _op("reward.model", "reward", "Classifier reward model score of prompt + response",
        inputs=PROMPT + RESPONSE, outputs=("rewards",), roles=("reward_model",),
        # the classifier attends to response_mask's tokens only: tool results would be cut
        single_turn_inputs=RESPONSE),
    _op("reward.overlong", "reward", "DAPO soft overlong punishment of the response lengths",
        inputs=("response_mask",), outputs=("rewards",), config=OverlongConfig),
    _op("reward.mix", "reward", "Weighted sum of the bound reward components",
        optional_inputs=MIX_COMPONENTS, outputs=("rewards",), config=MixConfig),
    _op("reward.genrm", "genrm", "Judge every response k times; reward = mean parseable score",
        inputs=PROMPT + RESPONSE + ("ground_truth",), outputs=("rewards",), config=GenRMConfig,
        roles=("genrm",), kinds=GT_LIST,
        # the judge reads the policy's text alone: the tool results it answered are lost
        single_turn_inputs=RESPONSE),
    _op("filter.dynamic_sampling", "filter", "Keep the rows of groups with reward variance",
        inputs=("rewards", "group_id"), optional_inputs=("filter_by",) + CARRIED,
        outputs=("rewards", "group_id") + CARRIED, config=DynamicSamplingConfig),
    _op("reward.token_rewards", "token_rewards",
        "Sequence rewards on the last token, minus beta*KL when algorithm.kl_in_reward",
        inputs=("rewards", "response_mask"), optional_inputs=("old_logprobs", "ref_logprobs"),
        outputs=("token_rewards",)),
    _op("logprobs", "logprobs", "Log-probabilities of the responses at the sampling temperature",
        inputs=PROMPT + RESPONSE, optional_inputs=("rollout_logprobs",) + VISION,
        outputs=("logprobs",),
        config=LogprobsConfig, roles=("actor", "ref", "teacher")),
    _op("values", "critic", "Critic values V(s_t) at the response positions",
        inputs=PROMPT + RESPONSE, outputs=("values",), roles=("critic",)),
    *_advantage_ops(),
    _op("update.policy", "update", "Policy update: epochs x mini-batches of the policy loss",
        inputs=PROMPT + RESPONSE + ("advantages",),
        optional_inputs=("old_logprobs", "ref_logprobs", "truncated", "rollout_logprobs") + VISION,
        config=PolicyUpdateConfig, roles=("actor",), trains=True),
    _op("update.sft", "update", "Supervised update: epochs x mini-batches of the NLL of the given tokens",
        inputs=PROMPT + RESPONSE, optional_inputs=("truncated",), config=SFTUpdateConfig,
        roles=("actor",), trains=True),
    _op("update.critic", "critic", "Critic update: clipped value regression towards returns",
        inputs=PROMPT + RESPONSE + ("values", "returns"), optional_inputs=("truncated",),
        roles=("critic",), trains=True),
]
