"""CPU smoke test of benchmarks/rollout.py: the HF variants on a 2-layer model, the JSON it writes, and
the markdown report (ratios, floor) built from results."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

rollout = pytest.importorskip("benchmarks.rollout")


def test_hf_variants_run_and_report(tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rollout.main(["--smoke", "--in-process", "--variants", "hf-dynamic,hf-static", "--batches", "2,3",
                  "--prompt-len", "4", "--new-tokens", "5", "--model-dir", str(tmp_path / "m"),
                  "--json-out", str(out), "--md-out", str(md)])
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    got = sorted((r["variant"], r["batch"]) for r in res["rows"])
    assert got == [("hf-dynamic", 2), ("hf-dynamic", 3), ("hf-static", 2), ("hf-static", 3)]
    for r in res["rows"]:
        assert 0 < r["tokens"] <= r["batch"] * 5  # a random model may sample EOS early
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
    assert set(res["floor"]) == {"2", "3"}
    text = md.read_text()
    assert "| hf-static | lp | 3 |" in text and "--smoke --in-process" in text


def _result(rows, floor):
    return dict(command="python benchmarks/rollout.py x", date="d", git="g", gpu="G", n_params=1e6,
                machine={"cpu": "c", "logical_cpus": "1"}, versions={}, prompt_len=4, new_tokens=5,
                rows=rows, errors={}, floor=floor)


def _row(variant, sampling, tokens, seconds, **extra):
    return dict(variant=variant, batch=8, sampling=sampling, tokens=tokens, seconds=seconds,
                tokens_per_s=tokens / seconds, settings={}, **extra)


def test_report_ratios_and_floor_share():
    rows = [_row("hf-static", "lp", 100, 1.0),
            _row("vllm-tuned", "lp-flat", 100, 0.4, effective={"max_num_seqs": 8}),
            _row("flowrl-vllm", "lp-flat+gc-freeze+seeded", 96, 0.48, mean_response_len=12.0),
            _row("flowrl-vllm", "lp-flat+gc-freeze+unseeded", 100, 0.2, mean_response_len=12.5),
            _row("flowrl-vllm-procs2", "lp-flat+gc-freeze+seeded", 96, 0.24, mean_response_len=12.0)]
    text = rollout.report([_result(rows, {"8": 1000.0})], notes="NOTE-X", this_command="python r.py")
    # columns: variant, sampling, B, mean len, tok/s, s, x hf-static, x flowrl-vllm, % of floor
    assert "| hf-static | lp | 8 | 12.5 | 100 | 1.00 | 1.00 | 0.20 | 10.0 |" in text
    # raw vLLM rows compare with the unseeded flowrl-vllm row (500 tok/s)
    assert "| vllm-tuned | lp-flat | 8 | 12.5 | 250 | 0.40 | 2.50 | 0.50 | 25.0 |" in text
    # flowrl rows compare with flowrl-vllm of the same sampling (seeded: 200 tok/s)
    assert "| flowrl-vllm-procs2 | lp-flat+gc-freeze+seeded | 8 | 12.0 | 400 | 0.24 | 4.00 | 2.00 | 40.0 |" in text
    assert "| flowrl-vllm | lp-flat+gc-freeze+seeded | 8 | 12.0 | 200 | 0.48 | 2.00 | 1.00 | 20.0 |" in text
    assert text.rstrip().endswith("NOTE-X") and "    python r.py" in text


def test_report_switch_columns():
    raw = dict(variant="switch", batch=0, sampling="", tokens=0, seconds=0.0, tokens_per_s=0.0,
               switch={"sleep1_s": 0.2, "wake1_s": 0.6, "load_s": 0.05, "sleep2_s": 0.1,
                       "wake2_weights_s": 0.02, "load2_s": 0.07, "wake2_kv_s": 0.4},
               load_max_abs_diff=0.0, generate_after_switch_ok=True, weight_gb=0.99)
    own = dict(variant="flowrl-vllm-procs2", batch=0, sampling="", tokens=0, seconds=0.0, tokens_per_s=0.0,
               switch={"sleep1_s": 0.1, "wake1_s": 0.3, "load1_s": 0.25, "sleep2_s": 0.1, "load2_s": 0.3,
                       "wake2_s": 0.2},
               switch_wall={"sleep1_s": 0.2, "wake1_s": 0.3, "load1_s": 0.25, "sleep2_s": 0.1,
                            "load2_s": 0.3, "wake2_s": 0.2},
               weights_changed=True, generate_after_switch_ok=True, sleep_supported=True, weight_gb=0.99)
    text = rollout.report([_result([raw, own], {})])
    assert "| phase | vllm.LLM | flowrl-vllm-procs2 |" in text
    assert "| load_s | 0.050 | - |" in text and "| load1_s | - | 0.250 |" in text
    assert "| **level 1 total** | 0.850 | 0.650 |" in text
    assert "| **level 2 total** | 0.590 | 0.600 |" in text
    assert "benchmark wall time level 1 0.750 s, level 2 0.600 s" in text
    assert "## Throughput" in text and "| switch |" not in text  # switch rows stay out of the table


def test_floor_of_the_benchmarked_shape():
    """The floor quoted in benchmarks/results/rollout_h200.md for the 494M Qwen2.5-0.5B shape."""
    import torch
    with torch.device("meta"):
        m = rollout.build_model(False)
    n = sum(p.numel() for p in m.parameters())
    assert n == 494_032_768
    assert rollout.floor_tokens_per_s(256, 128, 256, n, m.config) == pytest.approx(261_831, abs=1)
    assert rollout.floor_tokens_per_s(2048, 128, 256, n, m.config) == pytest.approx(329_612, abs=1)


def test_flowrl_engine_settings_of_the_gpu_run(tmp_path):
    """What the flowrl variants hand to the engines on the GPU (no vLLM needed to build them)."""
    import argparse

    import torch
    from transformers import AutoTokenizer

    from benchmarks import _rollout_flowrl as fl

    with torch.device("meta"):
        m = rollout.build_model(False)
    # 12,288 B/token (24 layers x 2 KV heads x 64 x K+V x bf16); 2048 x 384 tokens x 1.5 = 13.5 GiB
    assert fl.kv_cache_gb(2048, 384, m.config) == 13.5
    args = argparse.Namespace(prompt_len=128, new_tokens=256, batches=[256, 2048])
    cfg = fl.engine_config(args, m.config, on_cuda=True)
    assert (cfg.max_model_len, cfg.dtype, cfg.kv_cache_memory_gb, cfg.max_num_seqs) == (384, "bfloat16", 13.5, 2048)
    assert fl.per_engine_settings(cfg, 4) == dict(
        procs=4, max_num_seqs=512, max_cudagraph_capture_size=512, max_num_batched_tokens=32768,
        kv_cache_memory_gb=3.375, gpu_memory_utilization=0.125, dtype="bfloat16")
    assert fl.per_engine_settings(cfg, 0)["max_cudagraph_capture_size"] == 2048
    tok = fl.bench_tokenizer(rollout.EOS)
    tok.save_pretrained(tmp_path)  # what the engines' export does; vLLM reloads it from there
    back = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (back.eos_token_id, back.pad_token_id, tok.eos_token_id) == (151643, 151643, 151643)


def test_flowrl_ab_variants_name_real_settings():
    """Each A/B partner of a flowrl variant sets real rollout.vllm fields to the values it names
    (a misspelt field would only fail inside the GPU run's child) and keeps its engine count."""
    import dataclasses

    from benchmarks._rollout_flowrl import FLOWRL_CONFIG, FLOWRL_ENV, FLOWRL_VARIANTS
    from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig

    assert set(FLOWRL_CONFIG) | set(FLOWRL_ENV) <= set(FLOWRL_VARIANTS)
    base = VLLMRolloutConfig()
    for fields in FLOWRL_CONFIG.values():
        cfg = dataclasses.replace(base, **fields)
        assert {k: getattr(cfg, k) for k in fields} == fields != {k: getattr(base, k) for k in fields}
    assert FLOWRL_CONFIG["flowrl-vllm-procs4-threads"] == {"serve_threads": None}
    assert FLOWRL_ENV["flowrl-vllm-procs4-v1runner"] == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert FLOWRL_VARIANTS["flowrl-vllm-procs4-threads"] == FLOWRL_VARIANTS["flowrl-vllm-procs4"] == 4
