"""LoRA RL (flowrl/models/lora.py): config checks before any model loads, adapter-only optimizer,
the free reference (adapters disabled = base model), merged-weight sync to the rollout engine."""
from __future__ import annotations

import copy

import pytest
import torch
from test_engines import PROMPT_MASK, PROMPTS, _train_batch, tiny_llama, token_mean_loss

from flowrl.compiler.render import format_plan
from flowrl.config import compose
from flowrl.engines.base import SamplingConfig
from flowrl.engines.config import HFRolloutConfig, TrainEngineConfig
from flowrl.engines.rollout.hf import HFRolloutEngine
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.lora import (
    AdapterDisabledReference,
    LoraConfig,
    build_lora_actor,
    merged_weights,
)
from flowrl.train import ConfigError, prepare

BASE = ["model=tiny", "trainer=smoke", "trainer.output_dir=/tmp/flowrl-lora-plan"]


def _prepare(*overrides: str):
    return prepare(compose(BASE + list(overrides)))


# ---------------------------------------------------------------- config, before any model loads
@pytest.mark.parametrize("override, match", [
    ("model.lora={rank: 0}", "model.lora.rank must be >= 1, got 0"),
    ("model.lora={target_modules: [q_prj]}", "model.lora.target_modules: the model has no module 'q_prj'"),
    ("model.lora={modules_to_save: [head]}", "model.lora.modules_to_save: the model has no module 'head'"),
    ("model.lora={rnk: 4}", r"model.lora.rnk: LoRA has no such field \(did you mean model.lora.rank\?\)"),
])
def test_bad_lora_config_is_rejected_naming_the_field(override, match, monkeypatch):
    import flowrl.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match=match):
        _prepare(override)


def test_lora_with_a_critic_graph_is_rejected():
    with pytest.raises(ConfigError, match="model.lora: the graph has a critic"):
        _prepare("graph=ppo", "+model.lora.rank=4")


def test_plan_shows_the_reference_served_by_the_actor():
    spec = _prepare("+model.lora.rank=4", "algorithm.kl_coef=0.1")
    cfg, plan = spec.config, spec.plan
    assert cfg.model.lora == LoraConfig(rank=4)
    assert "ref served by the actor engine with its LoRA adapters disabled" in format_plan(plan)
    plain = _prepare("algorithm.kl_coef=0.1").plan
    assert "ref" in plain.roles and "served by" not in format_plan(plain)


@pytest.mark.parametrize("lora", [{"rank": 8}, {"rank": 4, "target_modules": ["q_proj", "v_proj"]},
                                  {"rank": 8, "modules_to_save": ["lm_head"]}])
def test_the_plan_counts_the_parameters_peft_trains(lora):
    """What `flowrl plan` sizes a LoRA actor's grads and moments by is what peft makes trainable
    on the model the run builds (the plan counted every parameter: a 70B LoRA job "fit
    nothing"; fresh-user report)."""
    from flowrl.models import load_model
    from flowrl.models.lora import as_lora_config, inject_lora
    from flowrl.models.size import model_size

    cfg = _prepare(f"+model.lora={lora}".replace("'", "")).config.model
    size = model_size(cfg)
    model = inject_lora(load_model(cfg), as_lora_config(lora))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert size.trainable_params == trained > 0
    assert size.n_params == model_size(_prepare().config.model).n_params  # the base, unchanged


def test_plan_memory_of_a_lora_actor_and_its_reference():
    """The actor holds the frozen weights and the adapters' state; the reference costs nothing
    (the actor with its adapters off), which the plan said in words and priced as a copy."""
    from flowrl.compiler.footprint import role_memory
    from flowrl.models.size import model_size

    cfg = _prepare("+model.lora.rank=8", "algorithm.kl_coef=0.1").config.model
    size = model_size(cfg)
    a, n, b = size.trainable_params, size.n_params, size.dtype_bytes
    assert role_memory("actor", size, 1) == (n + 4 * a) * b < 4 * n * b
    assert role_memory("ref", size, 1) == 0
    full = model_size(_prepare("algorithm.kl_coef=0.1").config.model)
    assert role_memory("actor", full, 1) == 4 * n * b and role_memory("ref", full, 1) == n * b


def test_gpt2_module_names_are_checked_against_its_own_modules():
    _prepare("model.tiny.model_type=gpt2", "~model.tiny.hidden_size", "~model.tiny.num_hidden_layers",
             "~model.tiny.num_attention_heads", "~model.tiny.num_key_value_heads",
             "~model.tiny.intermediate_size", "+model.tiny.n_embd=64", "+model.tiny.n_layer=2",
             "+model.tiny.n_head=4", "model.lora={target_modules: [c_attn]}")
    with pytest.raises(ConfigError, match="no module 'q_proj'"):
        _prepare("model.tiny.model_type=gpt2", "~model.tiny.hidden_size",
                 "~model.tiny.num_hidden_layers", "~model.tiny.num_attention_heads",
                 "~model.tiny.num_key_value_heads", "~model.tiny.intermediate_size",
                 "+model.tiny.n_embd=64", "+model.tiny.n_layer=2", "+model.tiny.n_head=4",
                 "model.lora={target_modules: [q_proj]}")


# ---------------------------------------------------------------- engines
def _lora_actor(lora=None, sync="changed", **cfg):
    eng_cfg = TrainEngineConfig(lr=1e-2, micro_batch_size=2, **cfg)
    return build_lora_actor(LocalTrainEngine, tiny_llama(), lora or LoraConfig(rank=4),
                            eng_cfg, sync=sync)


def test_optimizer_holds_only_the_adapters():
    actor = _lora_actor(LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    in_opt = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in actor.model.named_parameters() if id(p) in in_opt}
    # 2 layers × (q_proj, v_proj) × (lora_A, lora_B)
    assert len(names) == 8 and all(".lora_A." in n or ".lora_B." in n for n in names)
    n_adapter = sum(p.numel() for n, p in actor.model.named_parameters() if id(p) in in_opt)
    # q: A (4, 64) + B (64, 4); v: A (4, 64) + B (32, 4) (2 KV heads of 16); per layer, 2 layers
    assert n_adapter == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    osd = actor.state_dict()
    assert set(osd["model"]) == names  # checkpoints: adapters only, the frozen base is not saved
    before = {n: p.clone() for n, p in actor.model.named_parameters()}
    batch = _train_batch()
    m = actor.train_step(batch, token_mean_loss(batch), temperature=1.0)
    assert m["grad_norm"] > 0
    changed = {n for n, p in actor.model.named_parameters() if not torch.equal(p, before[n])}
    # only lora_B moves at step 1 (B = 0 ⇒ dL/dA = 0); the frozen base never does
    assert changed == {n for n in names if ".lora_B." in n}


def test_fsdp_bf16_reference_forward_first_then_update():
    """FSDP2 with the GPU's mixed precision (bf16 compute, fp32 gradient reduction), the reference
    (adapters off) as FSDP's first forward, then an update. peft's ``disable_adapter()`` froze the
    adapters during the reference forward; FSDP2 fixes a parameter's reduce dtype from its
    ``requires_grad`` when it (lazily) initialises, so a frozen-at-that-moment adapter later got a
    bf16 gradient assigned to an fp32 tensor ("assign a gradient with dtype BFloat16 to a tensor
    with grad_dtype Float": the GPU tier's LoRA rows). The adapters must keep ``requires_grad``
    inside the reference forward, and the update must train them."""
    from flowrl.engines.train.fsdp import FSDPTrainEngine
    from flowrl.runtime.io.distributed import init_single_process, teardown

    init_single_process("cpu")  # a one-rank gloo group, as `flowrl train` makes without torchrun
    try:
        actor = build_lora_actor(FSDPTrainEngine, tiny_llama(), LoraConfig(rank=4),
                                 TrainEngineConfig(lr=1e-2, micro_batch_size=2, strategy="fsdp",
                                                   mixed_precision="bf16"))
        adapters = [p for n, p in actor.model.named_parameters() if ".lora_" in n]
        assert adapters and all(p.requires_grad for p in adapters)
        seen: list[bool] = []
        hook = actor.model.register_forward_pre_hook(
            lambda mod, args: seen.append(all(p.requires_grad for p in adapters)))
        batch = _train_batch()
        ref = AdapterDisabledReference(actor)
        assert torch.isfinite(ref.logprobs(batch, 1.0).logprobs).all()
        hook.remove()
        assert seen and all(seen)  # never frozen, not even inside the reference forward
        m = actor.train_step(batch, token_mean_loss(batch), temperature=1.0)
        assert m["grad_norm"] > 0
    finally:
        teardown()


def test_chunked_head_and_plain_path_agree_on_a_lora_model():
    batch = _train_batch()
    chunked, plain = _lora_actor(), _lora_actor(logprob_chunk_size=None)
    assert chunked._head is not None  # the engine runs the transformers model, not PeftModel
    for eng in (chunked, plain):
        eng.train_step(batch, token_mean_loss(batch), temperature=1.0)
    a = chunked.logprobs(batch, 1.0).logprobs
    b = plain.logprobs(batch, 1.0).logprobs
    assert (a - b).abs().max().item() < 1e-5


def test_reference_is_the_base_model_and_no_copy():
    batch = _train_batch()
    actor = _lora_actor()
    ref = AdapterDisabledReference(actor)
    assert ref.model is actor.model  # one set of weights
    base = LocalTrainEngine(tiny_llama(), TrainEngineConfig(micro_batch_size=2), trainable=False)
    want = base.logprobs(batch, 0.7).logprobs
    for _ in range(2):
        actor.train_step(batch, token_mean_loss(batch), temperature=0.7)
    moved = actor.logprobs(batch, 0.7).logprobs
    assert (moved - want).abs().max().item() > 1e-3  # the adapters changed the policy
    got = ref.logprobs(batch, 0.7).logprobs
    assert (got - want).abs().max().item() < 1e-5
    # adapters are back on after the reference forward
    assert torch.equal(actor.logprobs(batch, 0.7).logprobs, moved)


def test_merged_weights_are_base_names_and_equal_peft_merge():
    actor = _lora_actor(LoraConfig(rank=4, modules_to_save=["lm_head"]))
    batch = _train_batch()
    for _ in range(2):
        actor.train_step(batch, token_mean_loss(batch), temperature=1.0)
    merged = dict(merged_weights(actor.model))
    ref = copy.deepcopy(actor.peft_model).merge_and_unload()
    want = ref.state_dict()
    plain_names = set(tiny_llama().state_dict())
    assert set(merged) <= plain_names and "lm_head.weight" in merged
    # only what changed: 7 linears per layer × 2 layers + lm_head, not embeddings or norms
    assert len(merged) == 15
    for n, t in merged.items():
        assert torch.allclose(t, want[n], atol=1e-6), n
    # the complete set (vLLM): exactly the plain model's parameter names, tied ones once
    full = dict(merged_weights(actor.model, full=True))
    assert set(full) == {n for n, _ in tiny_llama().named_parameters()}
    for n, t in full.items():
        assert torch.allclose(t, want[n], atol=1e-6), n


@pytest.mark.parametrize("sync", [True, False])
def test_rollout_copy_sees_every_update(tokenizer, sync):
    """The stale-adapter bug: a rollout engine with its own copy that misses the update keeps
    sampling the initial policy; its logprobs then disagree with the trainer's."""
    actor = _lora_actor()
    roll = HFRolloutEngine(tiny_llama(), tokenizer, HFRolloutConfig(batch_size=4))
    batch = _train_batch()
    for _ in range(3):
        actor.train_step(batch, token_mean_loss(batch), temperature=1.0)
        if sync:
            roll.load_weights(actor.named_weights())
            # only the 14 adapted linears (2 layers × 7) cross, fp32
            assert roll.last_load_counts == {"copied": 14, "shared": 0}
            assert actor.last_timings["gather_bytes"] == 4 * sum(
                t.numel() for _, t in merged_weights(actor.model))
    params = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8)
    rb = roll.generate(PROMPTS, PROMPT_MASK, params, torch.Generator().manual_seed(0))
    lp = actor.logprobs(dict(prompt_ids=PROMPTS, prompt_mask=PROMPT_MASK,
                             response_ids=rb.response_ids, response_mask=rb.response_mask), 1.0)
    mismatch = (lp.logprobs - rb.rollout_logprobs).abs().max().item()
    if sync:
        assert mismatch < 1e-4
    else:
        assert mismatch > 1e-2


def test_shared_rollout_module_needs_no_copy(tokenizer):
    actor = _lora_actor(sync="shared")
    roll = HFRolloutEngine(actor.model, tokenizer, shared=True)
    batch = _train_batch()
    actor.train_step(batch, token_mean_loss(batch), temperature=1.0)
    roll.load_weights(actor.named_weights())
    assert roll.last_load_counts == {"copied": 0, "shared": 0}
    assert actor.last_timings["gather_bytes"] == 0.0
    params = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8)
    rb = roll.generate(PROMPTS, PROMPT_MASK, params, torch.Generator().manual_seed(0))
    lp = actor.logprobs(dict(prompt_ids=PROMPTS, prompt_mask=PROMPT_MASK,
                             response_ids=rb.response_ids, response_mask=rb.response_mask), 1.0)
    assert (lp.logprobs - rb.rollout_logprobs).abs().max().item() < 1e-4


def test_state_dict_round_trip_continues_identically():
    batch = _train_batch()
    a = _lora_actor()
    a.train_step(batch, token_mean_loss(batch), temperature=1.0)
    saved = copy.deepcopy(a.state_dict())
    b = _lora_actor(LoraConfig(rank=4, init_seed=1))  # other adapter init: overwritten by the load
    b.load_state_dict(saved)
    for eng in (a, b):
        eng.train_step(batch, token_mean_loss(batch), temperature=1.0)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n


@pytest.fixture(scope="module")
def tokenizer():
    import transformers
    from test_engines import TOKENIZER_DIR

    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_vision_language_model_plans_and_checks_lora_names(capsys):
    """A Qwen2-VL config is no AutoModelForCausalLM: `flowrl plan` of the VLM job and the LoRA
    module-name check size it as an image-text-to-text model (both raised "Unrecognized
    configuration class Qwen2VLConfig" before)."""
    from flowrl.cli import main
    from flowrl.models.loading import ModelConfig
    from flowrl.models.lora import module_names
    from flowrl.models.size import model_size
    from flowrl.models.vision import tiny_vl_config

    assert main(["plan", "model=tiny_vl", "data=visual", "graph=grpo_vl"]) == 0
    assert "Unrecognized" not in capsys.readouterr().err
    cfg = ModelConfig(tiny=tiny_vl_config())
    names = module_names(cfg)
    assert "model.language_model.layers.0.self_attn.q_proj" in names
    assert "model.visual.blocks.0.attn.qkv" in names
    size = model_size(cfg)
    text = tiny_vl_config()["text_config"]
    assert (size.n_layers, size.hidden_size) == (text["num_hidden_layers"], text["hidden_size"])


# ---------------------------------------------------------------- vLLM adapter sync (no vLLM)
def test_adapter_sync_yields_peft_file_names_and_the_spec_expects_exactly_them(tmp_path):
    """``sync="adapter"``: the A/B tensors under the names ``PeftModel.save_pretrained`` writes,
    equal to its file; :func:`adapter_spec` (a meta model, no weights) names the same set and
    writes a config vLLM's PEFT reader takes (resolved targets, alpha / r)."""
    from safetensors.torch import load_file

    from flowrl.models.lora import adapter_spec

    lora = LoraConfig(rank=4, alpha=8.0)
    actor = _lora_actor(lora, sync="adapter")
    batch = _train_batch()
    actor.train_step(batch, token_mean_loss(batch), temperature=1.0)
    sent = dict(actor.named_weights())
    actor.peft_model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert set(sent) == set(saved) and len(sent) == 2 * 7 * 2  # A, B x 7 linears x 2 layers
    for n, t in sent.items():
        assert torch.equal(t, saved[n]), n
    assert actor.last_timings["gather_bytes"] == sum(t.numel() * 4 for t in sent.values())
    spec = adapter_spec(lora, tiny_llama().config)
    assert spec.tensor_names == frozenset(sent)
    assert spec.target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                   "up_proj", "v_proj")
    assert spec.adapter_config["r"] == 4 and spec.adapter_config["lora_alpha"] == 8.0
    assert sorted(spec.adapter_config["target_modules"]) == list(spec.target_modules)


def test_lora_sync_resolution_and_refusals():
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
    from flowrl.models.lora import adapter_spec

    cfg = tiny_llama().config
    ok = adapter_spec(LoraConfig(rank=4), cfg)
    attn = adapter_spec(LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]), cfg)
    head = adapter_spec(LoraConfig(rank=4, modules_to_save=["lm_head"]), cfg)
    assert VLLMRolloutConfig().lora_sync_for(None) == "merged"
    assert VLLMRolloutConfig().lora_sync_for(ok) == "merged"  # auto: AUTO_LORA_SYNC
    assert VLLMRolloutConfig(lora_sync="merged").lora_sync_for(ok) == "merged"
    assert VLLMRolloutConfig(lora_sync="adapter").lora_sync_for(attn) == "adapter"
    # auto falls back where the adapter path cannot run; an explicit adapter says why
    assert VLLMRolloutConfig().lora_sync_for(head) == "merged"
    assert VLLMRolloutConfig(sleep_level=2).lora_sync_for(ok) == "merged"
    with pytest.raises(ValueError, match=r"lora_sync=adapter: model.lora.modules_to_save="):
        VLLMRolloutConfig(lora_sync="adapter").lora_sync_for(head)
    with pytest.raises(ValueError, match="sleep_level=2 discards the base weights"):
        VLLMRolloutConfig(lora_sync="adapter", sleep_level=2).lora_sync_for(ok)
    with pytest.raises(ValueError, match="rollout.vllm.lora_sync must be one of"):
        VLLMRolloutConfig(lora_sync="tensors")


def test_adapter_sync_refuses_modules_vllm_does_not_adapt():
    """GPT-2's fused ``c_attn`` is no module vLLM's adapter path takes: refused naming
    ``model.lora.target_modules``."""
    import transformers

    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
    from flowrl.models.lora import adapter_spec

    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    spec = adapter_spec(LoraConfig(rank=4, target_modules=["c_attn"]), gpt2)
    assert spec.target_modules == ("c_attn",)
    assert VLLMRolloutConfig().lora_sync_for(spec) == "merged"
    with pytest.raises(ValueError, match=r"model.lora.target_modules has \['c_attn'\]"):
        VLLMRolloutConfig(lora_sync="adapter").lora_sync_for(spec)


def test_an_asleep_engine_maps_its_weights_before_the_adapter_goes_in(tmp_path, monkeypatch):
    """vLLM allocates its LoRA slots with the weights (the cumem pool's "weights" tag): after a
    level-1 sleep they are unmapped on CUDA, and ``add_lora`` copying into them failed on the H200
    with "CUDA error: invalid argument" (benchmarks/results/lora_sync_h200.md). An adapter sync
    into a sleeping engine must wake the weights first, as a full load does; the KV cache stays
    asleep until ``wake``."""
    import sys
    import types

    from flowrl.engines.rollout.vllm import VLLMRolloutEngine
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
    from flowrl.models.lora import adapter_spec

    calls: list = []

    class LLM:
        def __init__(self):
            self.llm_engine = types.SimpleNamespace(
                add_lora=lambda req: calls.append(("add_lora", req.lora_int_id)) or True,
                remove_lora=lambda i: calls.append(("remove_lora", i)))

        def wake_up(self, tags=None):
            calls.append(("wake_up", tags))

        def sleep(self, level):
            calls.append(("sleep", level))

        def reset_prefix_cache(self):
            pass

    class LoRARequest:  # vllm.lora.request.LoRARequest's fields the engine reads
        def __init__(self, name, lora_int_id, lora_path):
            self.lora_name, self.lora_int_id, self.lora_path = name, lora_int_id, lora_path

    monkeypatch.setitem(sys.modules, "vllm.lora.request", types.SimpleNamespace(LoRARequest=LoRARequest))
    spec = adapter_spec(LoraConfig(rank=4), tiny_llama().config)
    eng = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    eng.cfg, eng.llm, eng.lora, eng._lora_root = VLLMRolloutConfig(sleep_level=1), LLM(), spec, tmp_path
    eng.weight_names, eng.lora_request, eng.sleep_supported = spec.tensor_names, None, True
    eng._asleep, eng._weights_awake, eng._weights_valid = 0, True, True
    eng.vision = None  # a text model: no encoder cache to drop
    adapters = [(n, torch.zeros(4, 4)) for n in sorted(spec.tensor_names)]

    eng.sleep()
    eng.load_weights(iter(adapters))
    assert calls == [("sleep", 1), ("wake_up", ["weights"]), ("add_lora", 1)]
    eng.wake()  # the rest (KV cache) only: the weights are up already
    assert calls[-1] == ("wake_up", ["kv_cache", "scheduling"])
    calls.clear()
    eng.load_weights(iter(adapters))  # awake: no wake, the old adapter goes first
    assert calls == [("remove_lora", 1), ("add_lora", 2)]
    assert eng.lora_request.lora_int_id == 2 and eng._weights_valid


def test_the_console_says_lora_is_on_and_what_trains(caplog):
    """Only plan.txt said LoRA was on (fresh-user report): the build says it with the count."""
    with caplog.at_level("INFO", logger="flowrl"):
        eng = _lora_actor(LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    trained = sum(p.numel() for p in eng.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in eng.model.parameters())
    assert f"start-up: LoRA rank 4 (alpha 16) on q_proj, v_proj: {trained:,} of {total:,} " \
           "parameters train (" in caplog.text
