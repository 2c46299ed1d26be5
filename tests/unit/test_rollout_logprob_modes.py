"""rollout.sampling.logprobs: which steps ask the rollout engine for logprobs (NaN = not
measured), and that every consumer of rollout_logprobs reads only the measured tokens."""
from __future__ import annotations

import math

import pytest
import torch

from flowrl.algorithms.config import AlgorithmConfig
from flowrl.engines.base import LOGPROB_SAMPLE_EVERY, SamplingConfig, logprobs_measured
from flowrl.engines.config import HFRolloutConfig
from flowrl.engines.rollout.hf import HFRolloutEngine
from flowrl.ops.context import StageContext
from flowrl.ops.update import PolicyUpdateConfig, make_policy_loss_fn, update_policy

NAN = float("nan")


def test_sampled_measures_step_one_and_every_eighth_after_it():
    assert LOGPROB_SAMPLE_EVERY == 8
    assert [s for s in range(1, 30) if logprobs_measured("sampled", s)] == [1, 9, 17, 25]
    assert all(logprobs_measured(m, s) for m in ("all", "auto") for s in (1, 2, 3))
    assert not any(logprobs_measured("none", s) for s in (1, 2, 9))


def test_the_rollout_op_asks_its_engine_per_step():
    from flowrl.ops.context import StageContext
    from flowrl.ops.rollout import generate

    class Engine:
        def __init__(self):
            self.asked = []

        def generate(self, prompt_ids, prompt_mask, params, generator=None, images=None):
            from flowrl.engines.base import RolloutBatch

            self.asked.append(params.logprobs)
            B = prompt_ids.shape[0]
            return RolloutBatch(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.bool),
                                torch.zeros(B, 2), torch.zeros(B, dtype=torch.bool))

    for mode, want in (("sampled", ["all", "none", "none", "none", "none", "none", "none", "none",
                                     "all", "none"]),
                       ("all", ["all"] * 10), ("none", ["none"] * 10)):
        eng = Engine()
        for step in range(1, 11):
            ctx = StageContext(stage="rollout", step=step, engine=eng,
                               resources={"sampling": SamplingConfig(logprobs=mode)})
            generate(ctx, None, prompt_ids=torch.ones(2, 3, dtype=torch.long),
                     prompt_mask=torch.ones(2, 3, dtype=torch.bool))
        assert eng.asked == want, mode


def test_sampling_config_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match=r"rollout.sampling.logprobs must be auto or one of "
                                         r"\('all', 'sampled', 'none'\), got 'some'"):
        SamplingConfig(logprobs="some")
    with pytest.raises(ValueError, match=r"got true \(a boolean: all or none\?\)"):
        SamplingConfig(logprobs="True")  # what `rollout.sampling.logprobs=true` reaches it as


def _tiny_llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=2)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def hf_engine():
    from pathlib import Path

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(
        Path(__file__).resolve().parents[2] / "flowrl/models/assets/smollm2-tokenizer")
    return HFRolloutEngine(_tiny_llama(), tok, HFRolloutConfig(batch_size=32))


def test_hf_engine_without_logprobs_samples_the_same_tokens_and_returns_nan(hf_engine):
    ids = torch.arange(10, 20).repeat_interleave(2)[:, None].repeat(1, 3)
    mask = torch.ones_like(ids, dtype=torch.bool)
    out = {}
    for mode in ("all", "none", "sampled"):  # an engine handed "sampled" measures all
        params = SamplingConfig(temperature=1.0, max_new_tokens=6, logprobs=mode)
        out[mode] = hf_engine.generate(ids, mask, params, torch.Generator().manual_seed(7))
    full, none = out["all"], out["none"]
    assert torch.equal(full.response_ids, none.response_ids)  # the samples do not change
    assert torch.equal(out["sampled"].rollout_logprobs, full.rollout_logprobs)
    valid = full.response_mask
    assert not torch.isnan(full.rollout_logprobs).any()
    assert torch.isnan(none.rollout_logprobs[valid]).all()
    # outside the mask it stays 0 in every mode
    for rb in out.values():
        assert torch.equal(rb.rollout_logprobs[~valid], torch.zeros(int((~valid).sum())))


class _Engine:
    """Records the loss function's metrics of one micro-batch: the trainer's logprobs are given."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.lp = logprobs

    def train_step(self, mb, loss_fn, **kw):
        _, metrics = loss_fn(mb, self.lp.clone().requires_grad_(), None)
        return {k: float(v) for k, v in metrics.items()}


def _update(rollout_logprobs, lp, mode="sampled", rollout_is="none"):
    mask = torch.tensor([[True, True, False], [True, True, True]])
    B, R = mask.shape
    ctx = StageContext(stage="update", step=1, engine=_Engine(lp), resources={
        "algorithm": AlgorithmConfig(rollout_is=rollout_is),
        "sampling": SamplingConfig(logprobs=mode)})
    update_policy(ctx, PolicyUpdateConfig(), prompt_ids=torch.ones(B, 2, dtype=torch.long),
                  prompt_mask=torch.ones(B, 2, dtype=torch.bool),
                  response_ids=torch.ones(B, R, dtype=torch.long), response_mask=mask,
                  advantages=torch.ones(B, R), rollout_logprobs=rollout_logprobs)
    return ctx.metrics


def test_update_mismatch_is_the_mean_over_measured_tokens_only():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    # row 0 measured (|diffs| 0.5, 0.25), row 1 not
    rl = torch.tensor([[-1.5, -2.25, 0.0], [NAN, NAN, NAN]])
    m = _update(rl, lp)
    assert m["rollout/logprob_mismatch"] == pytest.approx(0.375)
    assert "rollout/logprob_mismatch_count" not in m
    assert math.isfinite(m["actor/pg_loss"])
    # nothing measured: no mismatch value at all (not a 0 that reads as "in agreement")
    m = _update(torch.where(torch.ones(2, 3, dtype=torch.bool), NAN, 0.0), lp, mode="none")
    assert "rollout/logprob_mismatch" not in m and math.isfinite(m["actor/pg_loss"])


def test_rollout_is_refuses_unmeasured_rows_at_run_time():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"algorithm.rollout_is=tis weighs every token by its "
                                         r"rollout logprob, but the rollout engine measured only "
                                         r"some rows"):
        _update(torch.tensor([[0.0, 0.0, 0.0], [NAN, 0.0, 0.0]]), lp, mode="all", rollout_is="tis")


def test_loss_is_unchanged_by_unmeasured_rows_when_nothing_reads_them():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    mb = {"response_mask": mask, "advantages": torch.tensor([[1.0, 1.0, 0.0], [-1.0, 2.0, 0.5]])}
    fn = make_policy_loss_fn(AlgorithmConfig(), "ppo_clip", num_tokens=5.0, num_seqs=2.0,
                             max_response_len=3)
    want, _ = fn(mb, lp, None)
    got, _ = fn({**mb, "rollout_logprobs": torch.full((2, 3), NAN)}, lp, None)
    assert torch.equal(got, want)
    got.backward()
    assert torch.isfinite(lp.grad).all()


def test_logprobs_op_mismatch_skips_unmeasured_rows():
    from flowrl.engines.base import LogprobOutput
    from flowrl.ops.logprobs import LogprobsConfig, logprobs

    lp = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])

    class Engine:
        def logprobs(self, batch, temperature, with_entropy):
            return LogprobOutput(logprobs=lp, entropy=None)

    mask = torch.tensor([[True, True, False], [True, True, True]])
    # a partly measured batch (a multi-turn trajectory's turns can differ) averages its measured
    # tokens only
    for mode, rl, want in (("sampled", torch.tensor([[-1.5, -2.25, 0.0], [NAN, NAN, NAN]]), 0.375),
                           ("all", torch.tensor([[-1.5, -2.25, 0.0], [-1.0, -1.0, -2.0]]), 1.75 / 5)):
        ctx = StageContext(stage="old_logprobs", step=1, engine=Engine(), resources={
            "sampling": SamplingConfig(logprobs=mode)})
        logprobs(ctx, LogprobsConfig(with_entropy=False), prompt_ids=torch.ones(2, 2, dtype=torch.long),
                 prompt_mask=torch.ones(2, 2, dtype=torch.bool),
                 response_ids=torch.ones(2, 3, dtype=torch.long), response_mask=mask,
                 rollout_logprobs=rl)
        assert float(ctx.metrics["rollout/logprob_mismatch"]) == pytest.approx(want)
        assert float(ctx.metrics["rollout/logprob_mismatch_max"]) == pytest.approx(1.0 if mode == "all" else 0.5)
    for mode, step in (("none", 1), ("sampled", 2)):  # steps that measure nothing: no value
        ctx = StageContext(stage="old_logprobs", step=step, engine=Engine(), resources={
            "sampling": SamplingConfig(logprobs=mode)})
        logprobs(ctx, LogprobsConfig(with_entropy=False), prompt_ids=torch.ones(2, 2, dtype=torch.long),
                 prompt_mask=torch.ones(2, 2, dtype=torch.bool),
                 response_ids=torch.ones(2, 3, dtype=torch.long), response_mask=mask,
                 rollout_logprobs=torch.full((2, 3), NAN))
        assert "rollout/logprob_mismatch" not in ctx.metrics, mode
