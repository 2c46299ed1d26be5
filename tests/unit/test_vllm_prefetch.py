"""engines/rollout/vllm_prefetch.py without vLLM: where vLLM's model-info cache lives, when a
prefetch starts, and that a prefetch that fails changes nothing (the vLLM tier runs a real one:
tests/vllm_backend/test_vllm_prefetch_engine.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from flowrl.engines.rollout import vllm_prefetch
from flowrl.models.bundled import SMOLLM2


@pytest.fixture(autouse=True)
def _no_prefetch_left():
    yield
    vllm_prefetch.cancel_all()


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
    # the model type's check, without transformers: vLLM's module is named like the type
    assert vllm_prefetch.likely_cached("llama") and not vllm_prefetch.likely_cached("qwen2")
    assert not vllm_prefetch.likely_cached("lla")  # a whole module name, not a prefix
    assert vllm_prefetch.start("llama") is None  # nothing to do
    assert vllm_prefetch.start(None) is None


def test_architecture_of_a_model_type():
    assert vllm_prefetch.causal_lm_architecture("llama") == "LlamaForCausalLM"
    assert vllm_prefetch.causal_lm_architecture("qwen2") == "Qwen2ForCausalLM"
    assert vllm_prefetch.causal_lm_architecture("no_such_type") is None
    assert vllm_prefetch.causal_lm_architecture(None) is None


def test_a_failed_prefetch_is_reported_and_changes_nothing(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(vllm_prefetch, "_SCRIPT", "import sys; sys.exit(3)")
    p = vllm_prefetch.start("llama")
    assert p is not None
    with caplog.at_level(logging.INFO, logger="flowrl"):
        assert p.wait(timeout_s=60) >= 0
    assert "prefetch for model type 'llama' did not finish (exit 3)" in caplog.text
    assert p.wait() is None  # waited for once


def test_a_hung_prefetch_is_killed_at_its_timeout(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(vllm_prefetch, "_SCRIPT", "import time; time.sleep(60)")
    p = vllm_prefetch.start("llama")
    with caplog.at_level(logging.INFO, logger="flowrl"):
        assert p.wait(timeout_s=0.5) < 30
    assert "did not finish (timed out)" in caplog.text


@pytest.mark.parametrize("backend, roles, expected", [
    ("vllm", {"actor", "rollout"}, ["llama"]),
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
    assert resources.start_vllm_prefetch(cfg, roles) == []
    assert started == expected


def test_a_generating_teacher_is_prefetched_too(monkeypatch):
    from flowrl.runtime.step import resources

    started: list = []
    monkeypatch.setattr(vllm_prefetch, "start", lambda a: started.append(a) or None)
    cfg = SimpleNamespace(rollout=SimpleNamespace(backend="vllm"),
                          model=SimpleNamespace(path=SMOLLM2, tiny=None),
                          teacher=SimpleNamespace(is_set=True, path="", tiny={"model_type": "qwen2"}))
    resources.start_vllm_prefetch(cfg, {"actor", "rollout", "teacher_rollout"})
    assert started == ["llama", "qwen2"]


def test_a_running_prefetch_is_taken_not_started_twice_and_cancel_ends_it(monkeypatch, tmp_path):
    # `flowrl train` starts it before the machine check; the engine build later takes that one
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(vllm_prefetch, "_SCRIPT", "import time; time.sleep(60)")
    first = vllm_prefetch.start("llama")
    assert first is not None and first.proc is not None
    assert vllm_prefetch.start("llama") is first
    other = vllm_prefetch.start("qwen2")
    assert other is not first
    procs = [first.proc, other.proc]
    vllm_prefetch.cancel_all()
    assert [p.poll() for p in procs] == [-9, -9]  # killed, not left running
    assert first.proc is None and first.wait() is None
    assert vllm_prefetch._RUNNING == {}


def test_flowrl_train_starts_it_before_the_machine_check_and_ends_it_on_refusal(monkeypatch, tmp_path):
    # a run refused by the machine check (after the prefetch started) leaves no process behind
    from flowrl import train as train_mod
    from flowrl.runtime.control.preflight import ConfigError

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(vllm_prefetch, "_SCRIPT", "import time; time.sleep(60)")
    seen: list = []

    def refuse(cfg):
        seen.extend(h.proc for h in vllm_prefetch._RUNNING.values())
        raise ConfigError("machine says no")

    monkeypatch.setattr(train_mod, "check_machine", refuse)
    with pytest.raises(SystemExit) as e:
        train_mod.main(["rollout=vllm", f"trainer.output_dir={tmp_path / 'run'}"])
    assert e.value.code == 2
    assert len(seen) == 1 and seen[0].args[-1] == "llama"  # SmolLM2's model type
    assert seen[0].poll() == -9
    assert vllm_prefetch._RUNNING == {}
    assert not (tmp_path / "run").exists()


def test_no_prefetch_in_torchruns_supervisor(monkeypatch):
    from flowrl import train as train_mod

    started: list = []
    monkeypatch.setattr(vllm_prefetch, "start", lambda a: started.append(a) or None)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    spec = SimpleNamespace(config=SimpleNamespace(launcher=SimpleNamespace(distributed=True)))
    train_mod._start_ahead(spec)
    assert started == []


def test_a_prefetch_nobody_waited_for_ends_with_its_process(tmp_path):
    # a run refused inside its job (a corrupt checkpoint on resume) exits without building an
    # engine: its prefetch must not outlive it (it kept running ~17 s and wrote vLLM's cache)
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (f"import os; os.environ['VLLM_CACHE_ROOT'] = {str(tmp_path)!r}\n"
            "from flowrl.engines.rollout import vllm_prefetch\n"
            "vllm_prefetch._SCRIPT = 'import time; time.sleep(120)'\n"
            "h = vllm_prefetch.start('llama')\n"
            "print(h.proc.pid, flush=True)\n"
            "raise SystemExit(3)\n")
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 3, r.stderr
    pid = int(r.stdout.split()[0])
    with pytest.raises(ProcessLookupError):  # killed and reaped by its parent at exit
        os.kill(pid, 0)


def test_the_process_looks_the_class_up_and_stops_where_vllms_cache_has_it(monkeypatch, tmp_path,
                                                                           caplog):
    """The real script, before it would import vLLM: transformers' class of the type, then the
    cache (a module named otherwise than the type: the parent's quick check cannot tell); a type
    transformers has no causal LM for ends there too. Neither imports vLLM (not installed here)."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    (tmp_path / "modelinfos").mkdir()
    (tmp_path / "modelinfos" / "vllm-model_executor-models-other-LlamaForCausalLM.json").write_text("{}")
    assert not vllm_prefetch.likely_cached("llama")
    with caplog.at_level(logging.INFO, logger="flowrl"):
        p = vllm_prefetch.start("llama")
        assert p is not None and p.wait(timeout_s=120) is not None
        q = vllm_prefetch.start("no_such_type")
        assert q is not None and q.wait(timeout_s=120) is not None
    assert "model info for model type 'llama' was in its cache" in caplog.text
    assert "model type 'no_such_type' did not finish (no transformers causal-LM class)" in caplog.text
