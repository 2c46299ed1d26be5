"""Reward-path ops with exact values: overlong shaping (DAPO eq. 13), the weighted mix and its NaN
rule, unscorable samples through mix -> advantage.grpo, the dynamic-sampling filter, the refill
loop of the executor (target reached, padding, max_attempts error), the plan's refill checks and
the classifier reward model."""

import pytest
import torch

from flowrl.algorithms.config import AlgorithmConfig
from flowrl.compiler.plan import compile_plan
from flowrl.compiler.render import format_plan
from flowrl.graph import Graph
from flowrl.graph.graph import GraphError
from flowrl.ops.context import StageContext
from flowrl.ops.filter import informative_groups
from flowrl.ops.registry import OPS, get_op, register_op
from flowrl.rewards.shaping import mix_rewards, overlong_penalty
from flowrl.runtime.step.executor import Executor
from flowrl.runtime.step.resources import Engines

NAN = float("nan")
# the filter's unbound carried fields are reported as unused outputs in these small graphs
pytestmark = pytest.mark.filterwarnings("ignore::flowrl.graph.validate.UnusedOutputWarning")


def call(op, params=None, resources=None, engine=None, **inputs):
    spec = get_op(op)
    ctx = StageContext(stage=op.split(".")[-1], step=1, resources=resources or {}, engine=engine)
    for arg in spec.optional_inputs:
        inputs.setdefault(arg, None)
    return spec.fn(ctx, spec.make_config(params or {}, stage=ctx.stage), **inputs), ctx.metrics


# ----------------------------------------------------------------------------- overlong
@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (12, 0.0), (16, 0.0),   # |y| <= L_max - L_cache = 16: no penalty
    (17, -0.25), (18, -0.5), (20, -1.0),
    (21, -1.0), (40, -1.0),           # beyond L_max
])
def test_overlong_penalty_eq13(length, expected):
    # L_max = 20, L_cache = 4: R = ((20 - 4) - |y|) / 4 on the ramp
    assert overlong_penalty(torch.tensor([length]), 20, 4).item() == expected


def test_overlong_penalty_factor_and_bad_settings():
    assert overlong_penalty(torch.tensor([18]), 20, 4, penalty_factor=0.5).item() == -0.25
    with pytest.raises(ValueError, match="buffer_length <= max_length"):
        overlong_penalty(torch.tensor([1]), 4, 5)


def test_overlong_op_uses_mask_lengths_and_buffer_fraction():
    mask = torch.tensor([[1] * 10 + [0] * 10, [1] * 18 + [0] * 2, [1] * 20]).bool()
    out, m = call("reward.overlong", {"max_length": 20, "buffer_fraction": 0.2}, response_mask=mask)
    assert out["rewards"].tolist() == [0.0, -0.5, -1.0]  # L_cache = round(0.2 * 20) = 4
    assert m["reward/overlong/penalised_frac"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="buffer_length <= max_length"):
        get_op("reward.overlong").make_config({"max_length": 4, "buffer_length": 8}, stage="o")


# ----------------------------------------------------------------------------- mix
def test_mix_weighted_sum_and_nan_rule():
    rule = torch.tensor([1.0, 0.0, NAN, 1.0])
    genrm = torch.tensor([0.5, NAN, 0.2, 0.1])
    got = mix_rewards({"rule": rule, "genrm": genrm}, {"rule": 1.0, "genrm": 0.5})
    assert torch.equal(torch.isnan(got), torch.tensor([False, True, True, False]))
    assert got[0].item() == 1.25 and got[3].item() == pytest.approx(1.05)
    # weight 0 leaves a component (and its NaNs) out
    got = mix_rewards({"rule": rule, "genrm": genrm}, {"rule": 0.0, "genrm": 1.0})
    assert torch.equal(torch.isnan(got), torch.tensor([False, True, False, False]))
    with pytest.raises(ValueError, match="no weight"):
        mix_rewards({"rule": rule}, {})
    with pytest.raises(ValueError, match="one length"):
        mix_rewards({"rule": rule, "genrm": genrm[:2]}, {"rule": 1, "genrm": 1})


def test_mix_op_logs_each_component():
    out, m = call("reward.mix", {"weights": {"rule": 1.0, "overlong": 1.0, "genrm": 3.0}},
                  rule=torch.tensor([1.0, 0.0]), overlong=torch.tensor([-0.5, 0.0]))
    assert out["rewards"].tolist() == [0.5, 0.0]  # genrm is unbound (e.g. pruned): ignored
    assert (m["reward/rule/mean"], m["reward/overlong/mean"], m["reward/mean"]) == (0.5, -0.25, 0.25)
    with pytest.raises(ValueError, match="unknown component"):
        get_op("reward.mix").make_config({"weights": {"rm": 1.0}}, stage="mix")
    with pytest.raises(ValueError, match="at least one bound component"):
        call("reward.mix")


def test_unscorable_samples_leave_their_siblings_untouched():
    """Group 0 has an unscorable sample (NaN genrm); its siblings' advantages equal those of a
    group made of the siblings alone, through the real reward.mix and advantage.grpo ops."""
    algo = {"algorithm": AlgorithmConfig()}
    rule = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    genrm = torch.tensor([0.5, 0.5, NAN, 0.0, 0.5, 0.5, 0.0])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    mixed, m = call("reward.mix", {"weights": {"rule": 1.0, "genrm": 1.0}}, rule=rule, genrm=genrm)
    assert m["reward/unscorable"] == 1.0
    mask = torch.ones(7, 3, dtype=torch.bool)
    adv, _ = call("advantage.grpo", resources=algo, rewards=mixed["rewards"], group_id=gid,
                  response_mask=mask)
    adv = adv["advantages"][:, 0]
    assert adv[2].item() == 0.0  # the unscorable sample itself does not train
    ref, _ = call("advantage.grpo", resources=algo, rewards=torch.tensor([1.5, 0.5, 1.0]),
                  group_id=torch.zeros(3, dtype=torch.long), response_mask=mask[:3])
    assert torch.allclose(adv[[0, 1, 3]], ref["advantages"][:, 0], atol=0, rtol=0)
    # (1.5, 0.5, 1.0): mean 1, sample std 0.5 -> (0.5, -0.5, 0) / (0.5 + eps)
    assert adv[[0, 1, 3]].tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)


# ----------------------------------------------------------------------------- filter
@pytest.mark.parametrize("scores, kept", [
    ([0.3, 0.3, 0.3], False),
    ([0.3, 0.30001, 0.3], True),             # continuous rewards: std, not a mean-range test
    ([0.0, 0.0, 0.0], False),
    ([1.0, 1.0, 1.0], False),
    ([0.0, 1.0, 0.0], True),
    ([0.5, 0.5, NAN], False),                # NaN left out: the valid ones are constant
    ([0.5, 0.7, NAN], True),
    ([0.5, NAN, NAN], False),                # fewer than 2 valid rewards
    ([NAN, NAN, NAN], False),
])
def test_informative_groups_table(scores, kept):
    keep, counts = informative_groups(torch.tensor(scores), torch.zeros(3, dtype=torch.long))
    assert keep.tolist() == [kept] * 3
    assert counts["kept"] == int(kept)


def test_filter_op_keeps_whole_groups_in_order_and_counts():
    r = torch.tensor([0.3, 0.3, 1.0, 0.0, NAN, NAN, 0.2, 0.2])
    gid = torch.tensor([7, 7, 3, 3, 9, 9, 5, 5])
    ids = torch.arange(16).view(8, 2)
    out, m = call("filter.dynamic_sampling", {"refill": False}, rewards=r, group_id=gid,
                  prompt_ids=ids)
    assert out["group_id"].tolist() == [3, 3] and out["prompt_ids"].tolist() == [[4, 5], [6, 7]]
    assert out["response_ids"] is None
    assert (m["filter/kept_groups"], m["filter/filtered_groups"], m["filter/zero_std_groups"],
            m["filter/too_few_valid_groups"]) == (1.0, 3.0, 2.0, 1.0)
    # filter_by decides; rewards are carried
    out, _ = call("filter.dynamic_sampling", {"refill": False}, rewards=r, group_id=gid,
                  filter_by=torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]))
    assert out["group_id"].tolist() == [7, 7, 9, 9]
    assert out["rewards"][:2].tolist() == pytest.approx([0.3, 0.3])


def test_filter_without_refill_never_returns_an_empty_batch():
    with pytest.raises(RuntimeError, match="dropped all 2 groups"):
        call("filter.dynamic_sampling", {"refill": False}, rewards=torch.zeros(4),
             group_id=torch.tensor([0, 0, 1, 1]))


# ----------------------------------------------------------------------------- refill loop
SCRIPT: list[tuple[list[float], int]] = []  # per attempt: rewards of 2 groups x 2, prompt width
SEEN: dict = {}


if "test.scripted_batch" not in OPS:
    @register_op("test.scripted_batch", outputs=("rewards", "group_id", "prompt_ids", "prompt_mask"))
    def _scripted(ctx, cfg):
        k = SEEN.setdefault("calls", 0)
        SEEN["calls"] = k + 1
        rewards, width = SCRIPT[k]
        ids = torch.full((4, width), 100 + k)
        mask = torch.ones(4, width, dtype=torch.bool)
        return {"rewards": torch.tensor(rewards), "group_id": torch.tensor([0, 0, 1, 1]) + 2 * k,
                "prompt_ids": ids, "prompt_mask": mask}

    @register_op("test.sink", inputs=("rewards", "group_id", "prompt_ids", "prompt_mask"))
    def _sink(ctx, cfg, **batch):
        SEEN["batch"] = batch
        return {}


def refill_graph(**params) -> Graph:
    g = Graph("refill_test")
    src = g.stage("src", "test.scripted_batch")
    f = g.stage("filter", "filter.dynamic_sampling", params={"refill": True, **params},
                inputs={k: src[k] for k in ("rewards", "group_id", "prompt_ids", "prompt_mask")})
    g.stage("sink", "test.sink", inputs={k: f[k] for k in ("rewards", "group_id", "prompt_ids",
                                                             "prompt_mask")})
    return g


def run_refill(script, **params):
    SCRIPT[:] = script
    SEEN.clear()
    plan = compile_plan(refill_graph(**params), require_update=False)  # a fragment
    return Executor(plan, Engines(), {}).run_step(1), plan


def test_refill_reaches_the_target_and_pads_prompts_on_the_left():
    m, plan = run_refill([([0.3, 0.3, 1.0, 0.0], 2),        # keeps group 1
                          ([0.3, 0.3, 0.3, 0.3], 3),        # keeps nothing
                          ([0.3, 0.30001, 0.5, 0.5], 3),    # keeps group 4 -> 2 groups: done
                          ([0.0, 1.0, 0.0, 1.0], 2)])
    assert plan.refill["filter"].upstream == ["src"]
    b = SEEN["batch"]
    assert b["group_id"].tolist() == [1, 1, 4, 4] and SEEN["calls"] == 3
    assert b["prompt_ids"].tolist() == [[0, 100, 100], [0, 100, 100], [102, 102, 102], [102, 102, 102]]
    assert b["prompt_mask"].tolist() == [[False, True, True]] * 2 + [[True] * 3] * 2
    assert (m["refill/attempts"], m["refill/groups"], m["refill/surplus_groups"]) == (3, 2, 0)
    assert (m["filter/kept_groups"], m["filter/filtered_groups"]) == (2.0, 4.0)  # summed
    assert "time/filter" in m and m["time/src"] > 0  # summed over the 3 attempts


def test_refill_cuts_surplus_groups_and_honours_target_groups():
    m, _ = run_refill([([0.0, 1.0, 0.0, 1.0], 2), ([0.0, 1.0, 0.0, 1.0], 2)], target_groups=3)
    assert SEEN["batch"]["group_id"].tolist() == [0, 0, 1, 1, 2, 2]
    assert (m["refill/attempts"], m["refill/groups"], m["refill/surplus_groups"]) == (2, 3, 1)


def test_refill_gives_up_after_max_attempts_with_a_clear_error():
    with pytest.raises(RuntimeError, match=r"stage 'filter': dynamic sampling kept 1 of the 2 "
                       r"groups it needs after 3 attempts \(6 groups sampled, the rest had no "
                       r"reward variance\): raise params.max_attempts of stage 'filter' in the "
                       r"graph file \(or lower its params.target_groups\), or raise algorithm.n"):
        run_refill([([0.0, 1.0, 0.0, 0.0], 2)] + [([0.5] * 4, 2)] * 3, max_attempts=3)
    assert SEEN["calls"] == 3


def test_plan_rejects_a_later_stage_reading_the_refilled_subgraph():
    g = refill_graph()
    g["sink"].inputs["prompt_ids"] = "src.prompt_ids"
    with pytest.raises(GraphError, match="stage 'sink', field 'inputs.prompt_ids': reads "
                       "'src.prompt_ids' from inside the refill sub-graph of 'filter', which "
                       "re-runs it until enough groups are kept; bind 'filter.prompt_ids' instead"):
        compile_plan(g, require_update=False)


def test_plan_text_shows_the_refill():
    text = format_plan(compile_plan(refill_graph(max_attempts=5), require_update=False))
    assert "refill  re-run src -> filter until one attempt's number of groups are kept " \
           "(at most 5 attempts)" in text


# ----------------------------------------------------------------------------- reward model
def test_reward_model_batched_equals_unpadded_and_ignores_pad_equal_eos():
    from flowrl.engines.reward_model import RewardModelEngine, load_reward_model
    from flowrl.models.loading import ModelConfig, tiny_model_config

    for kind in ("llama", "gpt2"):
        model = load_reward_model(ModelConfig(tiny=tiny_model_config(kind)))
        eng = RewardModelEngine(model, pad_token_id=2, batch_size=2)
        P = torch.tensor([[2, 2, 5, 6], [7, 2, 9, 10], [2, 2, 2, 3]])
        PM = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]).bool()  # id 2 inside row 1
        R = torch.tensor([[11, 2, 2], [12, 13, 2], [14, 15, 16]])                # EOS = pad = 2
        RM = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]]).bool()
        batched = eng.score(P, PM, R, RM)
        for i in range(3):
            alone = eng.score(P[i:i + 1, PM[i]][None, 0], PM[i:i + 1, PM[i]][None, 0],
                              R[i:i + 1, RM[i]][None, 0], RM[i:i + 1, RM[i]][None, 0])
            assert batched[i].item() == pytest.approx(alone.item(), abs=1e-5), (kind, i)
        # the final EOS is scored: dropping it changes the reward
        no_eos = eng.score(P[:1], PM[:1], R[:1, :1], RM[:1, :1])
        assert no_eos.item() != pytest.approx(batched[0].item(), abs=1e-6)
        out, m = call("reward.model", engine=eng, prompt_ids=P, prompt_mask=PM, response_ids=R,
                      response_mask=RM)
        assert torch.equal(out["rewards"], batched) and m["reward/model/unscorable"] == 0.0
        assert m["reward/model/mean"] == pytest.approx(batched.double().mean().item())


def test_reward_model_config_rejects_a_causal_lm_path():
    from flowrl.engines.config import RewardModelConfig

    with pytest.raises(ValueError, match="no reward head"):
        RewardModelConfig(model={"path": "smollm2"})


# ----------------------------------------------------------------------------- decode
def test_decode_responses_reads_only_the_masked_tokens_after_the_prefix():
    """Exact texts: the valid tokens of each row (a mask need not be contiguous), special tokens
    skipped, the response prefix in front; the same as decoding row by row."""
    from pathlib import Path

    import transformers

    from flowrl.ops.reward import decode_responses

    tok = transformers.AutoTokenizer.from_pretrained(
        Path(__file__).resolve().parents[2] / "flowrl/models/assets/smollm2-tokenizer")
    hello, world, eos = tok.encode("Hello")[0], tok.encode(" world")[0], tok.eos_token_id
    ids = torch.tensor([[hello, world, eos, eos], [world, hello, world, hello]])
    mask = torch.tensor([[True, True, True, False], [False, True, False, True]])
    assert decode_responses(tok, ids, mask, prefix="A: ") == ["A: Hello world", "A: HelloHello"]
    assert decode_responses(tok, ids, mask) == [
        tok.decode(r[m].tolist(), skip_special_tokens=True) for r, m in zip(ids, mask)]
    assert decode_responses(tok, ids[:0], mask[:0]) == []
