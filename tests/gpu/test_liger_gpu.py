"""GPU tier: liger-kernel's RMSNorm / SwiGLU / RoPE (``model.liger_kernel``) compute the model's math.

Opt-in: ``pytest -m gpu tests/gpu/test_liger_gpu.py`` on a CUDA device with liger-kernel installed.
What ``model.liger_kernel=auto`` turns on for a GPU run (flowrl/models/kernels.py) must not change
what the trainer computes: per-token logprobs of a tiny random Llama and Qwen2 (grouped-query heads,
tied embeddings) and one forward/backward's gradients, liger against eager PyTorch on the same
weights. fp32 with TF32 off: max |Δ logprob| ≤ 1e-4 nats and gradient cosine ≥ 0.9999 (the kernels
reorder sums; measured ~1e-6); bf16 (what a GPU run computes in): max |Δ logprob| ≤ 0.1 nats
(bf16 rounding of 64-dim heads and a 1,024 vocabulary) and gradient cosine ≥ 0.99.
liger patches transformers' module classes and RoPE function globally (kernels.py's caveat): each
test restores them (``monkeypatch``) so later tests build eager models.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from gpu_helpers import ragged_batch

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine
from flowrl.models.kernels import liger_importable
from flowrl.models.loading import ModelConfig, build_tiny, load_model, tiny_model_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not liger_importable(),
                                 reason="needs a CUDA device and liger-kernel")]


def _keep_transformers_modules(monkeypatch, kind: str) -> None:
    """Restore what apply_liger_kernel_to_<kind> replaces in transformers' module at teardown."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    prefix = {"llama": "Llama", "qwen2": "Qwen2"}[kind]
    for name in ("apply_rotary_pos_emb", f"{prefix}RMSNorm", f"{prefix}MLP"):
        monkeypatch.setattr(mod, name, getattr(mod, name))


def _tiny(kind: str, dtype: torch.dtype):
    tiny = {**tiny_model_config("llama"), "model_type": kind, "hidden_size": 256,
            "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 1024, "tie_word_embeddings": True}
    return build_tiny(ModelConfig(tiny=tiny, attn_implementation="sdpa"), dtype,
                      device=torch.device("cuda"))


_batch = ragged_batch


def _logprobs_and_grads(model, batch):
    eng = LocalTrainEngine(model, TrainEngineConfig(lr=1e-5, micro_batch_size=len(batch["prompt_ids"])))
    lp, _ = eng._logprobs(batch, 1.0, with_entropy=False)
    m = batch["response_mask"].to(lp.device)
    (-(lp * m).sum() / m.sum()).backward()
    grads = torch.cat([p.grad.float().flatten() for p in eng.model.parameters()])
    return lp.detach().float(), m, grads


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype,lp_tol,cos_min", [(torch.float32, 1e-4, 0.9999),
                                                  (torch.bfloat16, 0.1, 0.99)])
def test_liger_kernels_keep_logprobs_and_gradients(monkeypatch, kind, dtype, lp_tol, cos_min):
    from flowrl.models.kernels import apply_liger_kernels

    _keep_transformers_modules(monkeypatch, kind)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    eager = _tiny(kind, dtype)
    fused = copy.deepcopy(eager)
    assert apply_liger_kernels(fused) == kind
    assert fused.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
    b = _batch()
    lp_e, m, g_e = _logprobs_and_grads(eager, b)
    lp_f, _, g_f = _logprobs_and_grads(fused, b)
    d = (lp_f - lp_e)[m.bool()].abs().max().item()
    cos = torch.nn.functional.cosine_similarity(g_f, g_e, dim=0).item()
    assert d <= lp_tol, f"max |Δ logprob| {d:.2e} > {lp_tol}"
    assert cos >= cos_min, f"gradient cosine {cos:.6f} < {cos_min}"
    assert abs(g_f.norm().item() / g_e.norm().item() - 1) < 0.05


def test_load_model_applies_liger_when_resolved_true(monkeypatch):
    _keep_transformers_modules(monkeypatch, "llama")
    tiny = {**tiny_model_config("llama"), "vocab_size": 1024}
    on = load_model(ModelConfig(tiny=tiny, liger_kernel="true"), "cuda")
    assert on.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
    # liger replaced transformers' classes too; apply_liger_kernels put them back, so a model
    # built afterwards with liger off is eager (the tier found the leak)
    off = load_model(ModelConfig(tiny=tiny, liger_kernel="false"), "cuda")
    assert off.model.layers[0].mlp._get_name() == "LlamaMLP"
    assert type(off.model.norm).__name__ == "LlamaRMSNorm"
    assert on.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"  # the patched one keeps it


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_liger_rope_sees_one_row_at_any_row_count(monkeypatch, kind):
    """liger's RoPE kernel compiles per batch size (a Triton constexpr): flowrl hands it every
    micro-batch as one row (kernels.rope_over_one_row), so micro-batches of 3, 5 and 8 rows reach
    it with batch 1 and keep the eager model's logprobs (fp32, TF32 off)."""
    import liger_kernel.transformers.rope as liger_rope

    from flowrl.models.kernels import apply_liger_kernels

    _keep_transformers_modules(monkeypatch, kind)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    seen, real = [], liger_rope.liger_rotary_pos_emb

    def spy(q, k, cos, sin, *args, **kwargs):
        seen.append(q.shape[0])
        return real(q, k, cos, sin, *args, **kwargs)

    monkeypatch.setattr(liger_rope, "liger_rotary_pos_emb", spy)
    eager = _tiny(kind, torch.float32)
    fused = copy.deepcopy(eager)
    apply_liger_kernels(fused)
    for n in (3, 5, 8):
        b = _batch(n=n, seed=n)
        lp_e, m, _ = _logprobs_and_grads(eager, b)
        lp_f, _, _ = _logprobs_and_grads(fused, b)
        assert (lp_f - lp_e)[m.bool()].abs().max().item() <= 1e-4
    assert seen and set(seen) == {1}, seen


def test_hf_generate_decodes_without_liger_and_training_keeps_it(monkeypatch):
    """The HF rollout engine decodes inside ``kernels.eager_kernels`` (liger's host cost per call
    exceeds its GPU saving at one token a row): a liger-patched model's generate runs no liger
    kernel and samples what the eager model samples (greedy, fp32); the train engine's forward
    of the same model still runs liger's."""
    import transformers

    from flowrl.engines.base import SamplingConfig
    from flowrl.engines.config import HFRolloutConfig
    from flowrl.engines.rollout.hf import HFRolloutEngine
    from flowrl.models.kernels import apply_liger_kernels

    _keep_transformers_modules(monkeypatch, "qwen2")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    eager = _tiny("qwen2", torch.float32)
    fused = copy.deepcopy(eager)
    apply_liger_kernels(fused)
    tok = transformers.AutoTokenizer.from_pretrained(
        Path(__file__).resolve().parents[2] / "flowrl/models/assets/smollm2-tokenizer")
    b = _batch()

    def generate(model):
        eng = HFRolloutEngine(model, tok, HFRolloutConfig())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = eng.generate(b["prompt_ids"], b["prompt_mask"].bool(),
                               SamplingConfig(temperature=0.0, max_new_tokens=8))
            torch.cuda.synchronize()
        return out.response_ids, {e.key for e in prof.key_averages()}

    ids_f, ops = generate(fused)
    ids_e, _ = generate(eager)
    assert not any(k.startswith("Liger") for k in ops), sorted(k for k in ops if "Liger" in k)
    assert torch.equal(ids_f, ids_e)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _logprobs_and_grads(fused, b)
    assert any(e.key.startswith("LigerRMSNorm") for e in prof.key_averages())
