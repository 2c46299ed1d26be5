"""engines/rollout/vllm_prefetch.py without vLLM: where vLLM's model-info cache lives, when a
prefetch starts, and that a prefetch that fails changes nothing (the vLLM tier runs a real one:
tests/vllm_backend/test_vllm_prefetch_engine.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from flowrl.engines.rollout import vllm_prefetch
from flowrl.models.bundled import SMOLLM2


def test_cache_dir_follows_vllms_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "v"))
    assert vllm_prefetch.cache_dir() == tmp_path / "v" / "modelinfos"
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert vllm_prefetch.cache_dir() == tmp_path / "x" / "vllm" / "modelinfos"


def test_cached_reads_the_class_file(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert not vllm_prefetch.cached("LlamaForCausalLM")
    (tmp_path / "modelinfos").mkdir()
    (tmp_path / "modelinfos" / "vllm-model_executor-models-llama-LlamaForCausalLM.json").write_text("{}")
    assert vllm_prefetch.cached("LlamaForCausalLM")
    assert not vllm_prefetch.cached("Qwen2ForCausalLM")
    assert vllm_prefetch.start("LlamaForCausalLM") is None  # nothing to do
    assert vllm_prefetch.start(None) is None


def test_architecture_of_a_model_type():
    assert vllm_prefetch.causal_lm_architecture("llama") == "LlamaForCausalLM"
    assert vllm_prefetch.causal_lm_architecture("qwen2") == "Qwen2ForCausalLM"
    assert vllm_prefetch.causal_lm_architecture("no_such_type") is None
    assert vllm_prefetch.causal_lm_architecture(None) is None


def test_a_failed_prefetch_is_reported_and_changes_nothing(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(vllm_prefetch, "_SCRIPT", "import sys; sys.exit(3)")
    p = vllm_prefetch.start("LlamaForCausalLM")
    assert p is not None
    with caplog.at_level(logging.INFO, logger="flowrl"):
        assert p.wait(timeout_s=60) >= 0
    assert "prefetch for LlamaForCausalLM did not finish (exit 3)" in caplog.text
    assert p.wait() is None  # waited for once


def test_a_hung_prefetch_is_killed_at_its_timeout(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(vllm_prefetch, "_SCRIPT", "import time; time.sleep(60)")
    p = vllm_prefetch.start("LlamaForCausalLM")
    with caplog.at_level(logging.INFO, logger="flowrl"):
        assert p.wait(timeout_s=0.5) < 30
    assert "did not finish (timed out)" in caplog.text


@pytest.mark.parametrize("backend, roles, expected", [
    ("vllm", {"actor", "rollout"}, ["LlamaForCausalLM"]),
    ("hf", {"actor", "rollout"}, []),
    ("vllm", {"actor", "ref"}, []),  # a pool without a rollout engine
])
def test_build_engines_prefetches_the_policys_architecture(monkeypatch, backend, roles, expected):
    from flowrl.runtime.step import resources

    started: list = []
    monkeypatch.setattr(vllm_prefetch, "start", lambda a: started.append(a) or None)
    model = SimpleNamespace(path=SMOLLM2, tiny=None)
    cfg = SimpleNamespace(rollout=SimpleNamespace(backend=backend), model=model,
                          teacher=SimpleNamespace(is_set=False))
    assert resources._start_vllm_prefetch(cfg, roles) == []
    assert started == expected


def test_a_generating_teacher_is_prefetched_too(monkeypatch):
    from flowrl.runtime.step import resources

    started: list = []
    monkeypatch.setattr(vllm_prefetch, "start", lambda a: started.append(a) or None)
    cfg = SimpleNamespace(rollout=SimpleNamespace(backend="vllm"),
                          model=SimpleNamespace(path=SMOLLM2, tiny=None),
                          teacher=SimpleNamespace(is_set=True, path="", tiny={"model_type": "qwen2"}))
    resources._start_vllm_prefetch(cfg, {"actor", "rollout", "teacher_rollout"})
    assert started == ["LlamaForCausalLM", "Qwen2ForCausalLM"]
