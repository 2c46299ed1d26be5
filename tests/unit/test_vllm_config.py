"""rollout=vllm configuration: validated before any model (or vLLM) loads; vllm is never imported."""
import subprocess
import sys

import pytest

from flowrl.config import compose, to_train_config
from flowrl.engines.base import SamplingConfig
from flowrl.engines.rollout import ROLLOUT_BACKENDS, build_rollout_engine
from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig, check_model_for_vllm


@pytest.mark.parametrize("field, value", [
    ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5), ("kv_cache_memory_gb", 0),
    ("tensor_parallel_size", 0), ("tensor_parallel_size", 2), ("max_num_seqs", 0), ("max_num_batched_tokens", 0),
    ("max_model_len", 0), ("dtype", "fp8"), ("sleep_level", 3), ("logprobs_mode", "raw"),
    ("serve_threads", 0),
])
def test_config_rejects_bad_field_naming_it(field, value):
    with pytest.raises(ValueError, match=f"rollout.vllm.{field}"):
        VLLMRolloutConfig(**{field: value})


def test_tempered_logprobs_refuse_truncated_sampling():
    cfg = VLLMRolloutConfig()
    cfg.check_sampling(SamplingConfig(temperature=0.7))  # untruncated: fine
    cfg.check_sampling(SamplingConfig(temperature=0.0, top_p=0.5))  # greedy ignores top_p
    with pytest.raises(ValueError, match="logprobs_mode=processed"):
        cfg.check_sampling(SamplingConfig(temperature=0.7, top_p=0.9))
    with pytest.raises(ValueError, match="top_k=5"):
        cfg.check_sampling(SamplingConfig(temperature=1.0, top_k=5))
    VLLMRolloutConfig(logprobs_mode="processed").check_sampling(SamplingConfig(top_p=0.9, top_k=5))


def test_rollout_vllm_composes_and_validates_before_loading():
    cfg = to_train_config(compose(["rollout=vllm", "model=tiny", "trainer.output_dir=x"]))
    assert cfg.rollout.backend == "vllm"
    assert cfg.rollout.vllm.sleep_level == 1 and cfg.rollout.vllm.enable_prefix_caching
    assert cfg.rollout.sampling.temperature == 0.7
    with pytest.raises(ValueError, match="logprobs_mode"):
        to_train_config(compose(["rollout=vllm", "rollout.sampling.top_p=0.9", "trainer.output_dir=x"]))
    with pytest.raises(ValueError, match=r"rollout.backend must be auto or one of \['hf', 'vllm'\]"):
        to_train_config(compose(["rollout.backend=sglang", "trainer.output_dir=x"]))


def test_factory_names_backends_and_rejects_unknown():
    assert sorted(ROLLOUT_BACKENDS) == ["hf", "vllm"]

    class Cfg:
        backend = "tgi"
    with pytest.raises(ValueError, match="rollout.backend must be one of"):
        build_rollout_engine(Cfg(), None, None)


def test_cpu_head_size_check_names_the_fix():
    from transformers import LlamaConfig

    check_model_for_vllm(LlamaConfig(hidden_size=64, num_attention_heads=2), on_cpu=True)  # 32
    check_model_for_vllm(LlamaConfig(hidden_size=64, num_attention_heads=4), on_cpu=False)  # GPU
    with pytest.raises(ValueError, match="num_attention_heads=2"):
        check_model_for_vllm(LlamaConfig(hidden_size=64, num_attention_heads=4), on_cpu=True)


def test_flowrl_imports_without_vllm():
    code = ("import sys, flowrl.train, flowrl.engines.rollout.vllm, flowrl.config; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
