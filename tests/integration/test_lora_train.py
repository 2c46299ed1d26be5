"""LoRA RL end to end on the tiny model: every critic-free graph, the FSDP2 engine with its own
rollout copy (stale-adapter detection), resume exactness, export (merged / adapter-only)."""
from __future__ import annotations

import json

import pytest
import torch

from flowrl.config import compose
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import train

BASE = ["model=tiny", "trainer=smoke", "data.limit=64", "logger.progress=false",
        "logger.console=false", "logger.tensorboard=false", "trainer.eval.before=false",
        "trainer.eval.after=false", "+model.lora.rank=4", "algorithm.kl_coef=0.1"]
# merged q, k, v, o, gate, up, down of the tiny Llama (hidden 64, 2 KV heads of 16, MLP 128),
# 2 layers, fp32: what one weight sync moves (the embeddings and norms never change)
SYNC_BYTES = 4 * 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64)




@pytest.fixture
def varied_reward(monkeypatch):
    """A verifier whose rewards vary with the response text (the tiny random model never answers
    GSM8K), so advantages are non-zero and the adapters really move."""
    from flowrl import rewards

    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "gsm8k",
                        lambda text, gt, **kw: float(sum(map(ord, text)) % 7) / 6.0)


# grpo and genrm_grpo (two reward paths) in the default tier; the other graphs differ from grpo only
# in their advantage/loss ops, which LoRA does not touch: the slow tier (pytest -m slow)
@pytest.mark.parametrize("graph", ["grpo", "genrm_grpo", *[
    pytest.param(g, marks=pytest.mark.slow) for g in ("dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo")]])
def test_every_critic_free_graph_trains_lora(tmp_path, varied_reward, graph):
    train(compose(BASE + [f"trainer.output_dir={tmp_path}", f"graph={graph}",
                          "trainer.total_steps=1", "rollout.sampling.max_new_tokens=8"]))
    m = read_metrics(tmp_path)[1]
    assert m["actor/optimizer_steps"] >= 1
    assert m["perf/weight_sync_bytes"] == 0.0  # the HF engine shares the actor's module
    if "ref_logprobs" in (tmp_path / "plan.txt").read_text():
        assert "ref served by the actor engine" in (tmp_path / "plan.txt").read_text()


@pytest.fixture
def one_rank_group():
    yield
    from flowrl.runtime.io.distributed import teardown

    teardown()


@pytest.mark.parametrize("stale", [False, True])
def test_fsdp_rollout_copy_gets_every_update(tmp_path, varied_reward, one_rank_group,
                                             monkeypatch, stale):
    """FSDP2 (world size 1): the HF rollout engine holds its own base copy and receives the
    merged weights after each update. ``stale``: the sync delivers nothing (the bug other
    frameworks' users report) and ``rollout.verify_sync=false``: the rollout keeps sampling the
    old policy and only the mismatch shows (what ``verify_sync``, the default, stops: below)."""
    if stale:
        from flowrl.models import lora

        monkeypatch.setattr(lora, "merged_weights", lambda model, adapter="default", full=False: iter(()))
    train(compose(BASE + [f"trainer.output_dir={tmp_path}", "trainer.engine.strategy=fsdp",
                          "trainer.engine.lr=0.05", f"rollout.verify_sync={not stale}"]))
    m = read_metrics(tmp_path)
    assert m[1]["actor/grad_norm"] > 0
    assert m[1]["rollout/logprob_mismatch"] < 1e-5  # step 1: both are the base model
    if stale:
        assert m[2]["perf/weight_sync_bytes"] == 0.0
        assert m[2]["rollout/logprob_mismatch"] > 1e-3
    else:
        assert m[2]["perf/weight_sync_bytes"] == SYNC_BYTES
        assert m[2]["rollout/logprob_mismatch"] < 1e-5
        assert m[2]["actor/kl_loss"] > 0  # the reference (adapters off) differs from the actor
        assert m[1]["perf/weight_sync/verify_s"] > 0  # the process's first sync is checked
        # q, k, v, o, gate, up, down of 2 layers: each sent tensor matched the trainer's forward
        assert m[1]["perf/weight_sync_effective_checked"] == 14.0
        # the second is not (rollout.verify_sync_every=100)
        assert m[2]["perf/weight_sync_checked"] == m[2]["perf/weight_sync_effective_checked"] == 0
        assert "perf/weight_sync/verify_s" not in m[2]


def _base_weights(model, adapter="default", full=False):
    """``lora.merged_weights`` with the merge left out: every adapted layer's base weight."""
    from peft.tuners.lora import LoraLayer

    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            yield f"{name}.weight", m.get_base_layer().weight.detach().full_tensor()


def _noop_load(self, named_tensors):
    for _ in named_tensors:  # takes every tensor, copies none (a load into a stale engine)
        pass


def _first_half_load(self, named_tensors):
    for i, _ in enumerate(named_tensors):  # stops early (a loader that misses names)
        if i == 6:
            return


@pytest.mark.parametrize("broken, message", [
    ("merged nothing", "weight sync actor -> rollout (HFRolloutEngine) after step 1: the engine holds its own "
     "copy of the weights but the sync delivered no tensor (a LoRA source that merged no "
     "adapter"),
    ("no-op load", "weight sync actor -> rollout (HFRolloutEngine) after step 1: the engine does not serve "
     "the weights it was sent: 14 of 14 checked tensors differ, e.g. "
     "model.layers.0.self_attn.q_proj.weight (max |difference|"),
    ("partial load", "weight sync actor -> rollout (HFRolloutEngine) after step 1: the engine's load_weights "
     "took 7 of the 14 tensors sent (not e.g. model.layers.1.self_attn.q_proj.weight, "
     "model.layers.1.self_attn.k_proj.weight, model.layers.1.self_attn.v_proj.weight): it "
     "serves stale weights"),
    ("base weights sent", "weight sync actor -> rollout (HFRolloutEngine) after step 1: the weights "
     "sent are not the trainer's effective weights: 14 of 14 LoRA-adapted tensors differ from "
     "what the trainer computes with its adapters, e.g. model.layers.0.mlp.down_proj.weight "
     "(max |difference|"),
])
def test_a_broken_lora_sync_stops_the_run_at_step_one(tmp_path, varied_reward, one_rank_group,
                                                      monkeypatch, broken, message):
    """``rollout.verify_sync`` (default on): a sync that did not reach the engine stops the run
    at the first sync (after step 1's update), naming the engine and the tensors."""
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.models import lora
    from flowrl.runtime.step.weight_check import WeightSyncError

    if broken == "merged nothing":
        monkeypatch.setattr(lora, "merged_weights", lambda model, adapter="default", full=False: iter(()))
    elif broken == "base weights sent":  # the adapters not merged: the readback alone passes
        monkeypatch.setattr(lora, "merged_weights", _base_weights)
    else:
        monkeypatch.setattr(HFRolloutEngine, "load_weights",
                            _noop_load if broken == "no-op load" else _first_half_load)
    with pytest.raises(WeightSyncError) as e:
        train(compose(BASE + [f"trainer.output_dir={tmp_path}", "trainer.engine.strategy=fsdp",
                              "trainer.engine.lr=0.05", "trainer.total_steps=3"]))
    assert message in str(e.value)
    assert read_metrics(tmp_path) == {}  # stopped inside step 1, before its metrics


def test_resume_continues_exactly_and_export_round_trips(tmp_path, varied_reward, capsys):
    import peft
    import transformers

    from flowrl.export import export_checkpoint

    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run = lambda d, *o: train(compose(BASE + [f"trainer.output_dir={d}", "trainer.engine.lr=0.05",
                                              *o]))
    run(straight, "trainer.total_steps=3")
    run(interrupted, "trainer.total_steps=2")
    run(interrupted, "trainer.total_steps=3", "trainer.resume=true")
    a, b = read_metrics(straight), read_metrics(interrupted)
    assert a[2]["actor/grad_norm"] > 0
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss",
                "actor/entropy"):
        assert b[3][key] == pytest.approx(a[3][key], rel=1e-5, abs=1e-7), key

    ckpt = straight / "checkpoints" / "step_000003"
    merged = export_checkpoint(ckpt, tmp_path / "merged")
    adapter = export_checkpoint(ckpt, tmp_path / "adapter", adapter_only=True)
    # model.lora=null on a LoRA checkpoint: one line (DCP's missing-key RuntimeError before)
    with pytest.raises(ValueError, match=r"^export: .*step_000003 was trained with LoRA \(its "
                                         r"model.lora is recorded\): export it merged"):
        export_checkpoint(ckpt, tmp_path / "nolora", model_overrides=["lora=null"])
    assert not (tmp_path / "nolora").exists()
    assert (adapter / "adapter_config.json").is_file()
    # the command says which base the adapter needs (a path of this machine: fresh-user report)
    from flowrl.export import export_main

    assert export_main([str(ckpt), str(tmp_path / "adapter2"), "--adapter-only"]) == 0
    base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert f"adapter base: {base_path} (this machine's copy" in capsys.readouterr().out
    m1 = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in n for n, _ in m1.named_parameters())  # a plain base-arch model
    from flowrl.models.loading import ModelConfig, load_model

    base = load_model(ModelConfig(**{k: v for k, v in
                                     json.loads((ckpt / "trainer_state.json").read_text())["model"]
                                     .items() if k != "lora"}))
    m2 = peft.PeftModel.from_pretrained(base, adapter)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        l1, l2 = m1(ids).logits, m2(ids).logits
        with m2.disable_adapter():
            l0 = m2(ids).logits
    # W0 x + s·B(A x) (peft) vs (W0 + s·BA) x (merged): same math, fp32 rounding of its own
    assert (l1 - l2).abs().max().item() < 1e-4
    assert (l1 - l0).abs().max().item() > 1e-4  # the trained adapter is in the export
