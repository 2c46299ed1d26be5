"""The one rule for where tensors live (DESIGN.md "Where tensors live",
flowrl/runtime/step/devices.py), checked on CPU with a train engine on PyTorch's ``meta`` device
standing in for a GPU: any op or loss function that mixes the store's host tensors with the engine's
would raise here exactly as ``cuda:0`` vs ``cpu`` does on a GPU (the first GPU run died in
ops/logprobs.py and in the loss of ``update``), and any ``.item()`` inside a loss function (a stream
sync per micro-batch on a GPU) raises on ``meta`` too.

Also: the machine defaults (flowrl/machine.py) with exact expected values.
"""
from pathlib import Path

import pytest
import torch

from flowrl.compiler.plan import compile_plan
from flowrl.engines.base import LogprobOutput
from flowrl.graph import Graph
from flowrl.ops.context import StageContext
from flowrl.ops.registry import OPS
from flowrl.runtime.step.devices import home_device, stage_device, to_device
from flowrl.runtime.step.executor import Executor
from flowrl.runtime.step.resources import Engines
from flowrl.runtime.step.store import TensorStore

GRPO = Path(__file__).resolve().parents[2] / "graphs" / "grpo.yaml"
META = torch.device("meta")
B, P, R = 4, 3, 5


class MetaTrain:
    """A train engine whose parameters live on another device (meta)."""

    device = META

    def __init__(self):
        self.seen: list[torch.device] = []

    def logprobs(self, batch, temperature, with_entropy=False):
        self.seen += [v.device for v in batch.values()]
        return LogprobOutput(torch.zeros(B, R, device=META),
                             torch.zeros(B, R, device=META) if with_entropy else None)


class HostRollout:
    device = torch.device("cpu")


def executor():
    plan = compile_plan(Graph.load(GRPO), {"algorithm": {"kl_coef": 0.0,
                                                         "recompute_old_logprobs": True}})
    ex = Executor(plan, Engines(actor=MetaTrain(), rollout=HostRollout()), {},
                  device=torch.device("cpu"))
    mask = torch.tensor([[1, 1, 1, 0, 0]] * B, dtype=torch.bool)
    ex.store.put("sample", {"prompt_ids": torch.ones(B, P, dtype=torch.long),
                            "prompt_mask": torch.ones(B, P, dtype=torch.bool),
                            "group_id": torch.arange(B), "ground_truth": ["1"] * B})
    ex.store.put("rollout", {"response_ids": torch.ones(B, R, dtype=torch.long),
                             "response_mask": mask, "rollout_logprobs": torch.zeros(B, R),
                             "truncated": torch.zeros(B, dtype=torch.bool)})
    ex.store.put("advantage", {"advantages": torch.ones(B, R)})
    ex.store.put("old_logprobs", {"logprobs": torch.zeros(B, R)})
    return ex


class Sampling:
    temperature, logprobs = 1.0, "all"


class Algo:
    clip_ratio_low, clip_ratio_high, clip_ratio_c = 0.2, 0.2, None
    loss_agg_mode, rollout_is, rollout_is_cap = "token-mean", "none", 2.0
    kl_coef, kl_in_reward, kl_type, kl_clamp, entropy_coef = 0.0, False, "k3", 10.0, 0.0


def test_store_moves_what_it_is_given_home_and_counts_device_bytes():
    store = TensorStore({"a": []}, device=META)
    store.put("a", {"x": torch.zeros(2, 3), "y": [torch.ones(2)], "s": "text"})
    assert store.get("a.x").device == META and store.get("a.y")[0].device == META
    assert store.get("a.s") == "text"
    # meta/CPU storage is not accelerator memory: the device counters stay 0 off-GPU
    assert store.stats.peak_device_bytes == 0 and store.stats.produced_device_bytes == 0
    host = TensorStore({"a": []}, device=torch.device("cpu"))
    host.put("a", {"x": torch.zeros(2, 3)})
    assert host.stats.peak_bytes == 24 and host.stats.peak_device_bytes == 0


def test_to_device_keeps_tensors_already_there_and_recurses():
    t = torch.zeros(3)
    assert to_device(t, torch.device("cpu")) is t
    out = to_device({"a": [t, (t, 1)], "b": None}, META)
    assert out["a"][0].device == META and out["a"][1][0].device == META
    assert out["a"][1][1] == 1 and out["b"] is None


def test_stage_and_home_devices():
    assert stage_device(None) == torch.device("cpu")  # role-less ops run on the host
    assert stage_device(MetaTrain()) == META
    assert home_device({"rollout": HostRollout(), "actor": MetaTrain()}) == META
    assert home_device({}) == torch.device("cpu")


def test_logprobs_op_sees_its_inputs_on_the_engine_device():
    ex = executor()
    inputs = ex.stage_inputs("old_logprobs")
    assert {v.device for v in inputs.values() if isinstance(v, torch.Tensor)} == {META}
    engine = ex.engines.actor
    ctx = StageContext(stage="old_logprobs", step=1, engine=engine,
                       resources={"sampling": Sampling()})
    cfg = ex.plan.stages[[c.stage.name for c in ex.plan.stages].index("old_logprobs")].config
    out = OPS["logprobs"].fn(ctx, cfg, **inputs)
    assert out["logprobs"].device == META
    assert set(engine.seen) == {META}
    # the mismatch metric stays a device tensor until the executor reads the stage's metrics
    assert ctx.pending["rollout/logprob_mismatch"].device == META
    # what the first GPU run did: host inputs against the engine's output
    host = {k: ex.store.get(ref) for k, ref in ex.plan.graph["old_logprobs"].inputs.items()}
    with pytest.raises(RuntimeError, match="device"):
        OPS["logprobs"].fn(StageContext(stage="old_logprobs", step=1, engine=engine,
                                        resources={"sampling": Sampling()}), cfg, **host)


def test_update_inputs_and_loss_fn_on_the_engine_device():
    from flowrl.engines.train.local import LocalTrainEngine
    from flowrl.ops.update import make_policy_loss_fn

    ex = executor()
    inputs = ex.stage_inputs("update")
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    assert {v.device for v in tensors.values()} == {META}
    # the micro-batch the engine cuts is a slice of that batch: on the engine's device
    mb = LocalTrainEngine._micro_batch({k: v for k, v in tensors.items() if v.dim() >= 1},
                                       [0, 1], B)
    logprobs = torch.zeros(2, R, device=META, requires_grad=True)
    loss_fn = make_policy_loss_fn(Algo(), "ppo_clip", num_tokens=6.0, num_seqs=2.0,
                                  max_response_len=R)
    loss, metrics = loss_fn(mb, logprobs, torch.zeros(2, R, device=META))
    assert loss.device == META
    # metrics are device tensors (no .item() per micro-batch, which also cannot run on meta)
    assert metrics and all(v.device == META for v in metrics.values())


def test_stage_metrics_are_read_once_as_floats():
    ctx = StageContext(stage="s", step=1)
    ctx.log(a=torch.tensor(0.5), b=2, c=torch.tensor([3.0]))
    assert isinstance(ctx.pending["a"], torch.Tensor)
    assert ctx.metrics == {"a": 0.5, "b": 2.0, "c": 3.0}


# ----------------------------------------------------------------------------- machine defaults

def _cfg(*overrides):
    from flowrl.config import compose, to_train_config

    return to_train_config(compose(["model=tiny", "trainer.output_dir=/tmp/unused", *overrides]))


def _resolve(field: str, *overrides: str, cuda: bool = True, vllm: bool = True,
             liger: bool = False) -> tuple[object, str | None]:
    """(the resolved value of ``field``, its printed resolution line or None) on a machine with
    ``cuda`` / ``vllm`` / ``liger`` as given (no flash-attn, no varlen)."""
    from flowrl.machine import resolve_machine_defaults

    cfg = _cfg(*overrides)
    got = {r.field: str(r) for r in resolve_machine_defaults(
        cfg, cuda=cuda, vllm=vllm, flash_attn=False, varlen=False, liger=liger)}
    value = cfg
    for part in field.split("."):
        value = getattr(value, part)
    return value, got.get(field)


def test_gpu_machine_resolves_gpu_defaults(monkeypatch):
    from flowrl import machine
    from flowrl.machine import resolve_machine_defaults

    # the default: sdpa, sdpa_varlen opt-in (measured no faster on the H200: AUTO_SDPA_VARLEN)
    cfg = _cfg()
    got = resolve_machine_defaults(cfg, cuda=True, vllm=True, flash_attn=False, varlen=True)
    assert str(got[-1]) == ("model.attn_implementation=sdpa (flash-attn not installed; "
                            "sdpa_varlen measured no faster on the H200: opt-in)")
    monkeypatch.setattr(machine, "AUTO_SDPA_VARLEN", True)  # the rule once it is turned on
    cfg = _cfg()
    got = resolve_machine_defaults(cfg, cuda=True, vllm=True, flash_attn=False, varlen=True)
    assert (cfg.trainer.device, cfg.model.dtype, cfg.trainer.engine.strategy, cfg.rollout.backend,
            cfg.rollout.vllm.dtype, cfg.rollout.hf.dtype, cfg.model.attn_implementation,
            cfg.trainer.engine.max_tokens_per_micro_batch) == (
        "cuda", "float32", "fsdp", "vllm", "bfloat16", "bfloat16", "sdpa_varlen", 16384)
    assert [r.field for r in got] == [
        "trainer.device", "model.dtype", "trainer.engine.strategy",
        "trainer.engine.max_tokens_per_micro_batch", "rollout.backend",
        "rollout.sampling.logprobs", "rollout.vllm.dtype", "model.liger_kernel",
        "model.attn_implementation"]
    assert str(got[0]) == "trainer.device=cuda (a CUDA device is visible)"
    assert str(got[-1]) == ("model.attn_implementation=sdpa_varlen (flash-attn not installed; "
                            "torch's varlen_attn packs micro-batches)")
    cfg = _cfg()
    got = resolve_machine_defaults(cfg, cuda=True, vllm=True, flash_attn=False, varlen=False)
    assert str(got[-1]) == ("model.attn_implementation=sdpa (flash-attn not installed; no torch "
                            "varlen_attn or an sm80+ GPU)")


def test_liger_kernel_auto_is_on_for_measured_model_types_on_a_gpu(tmp_path):

    def liger(*overrides, cuda=True, installed=True):
        return _resolve("model.liger_kernel", *overrides, cuda=cuda, liger=installed)

    # a job long enough to repay liger's import: 20,000 steps x 64 rows x (256 + 48) tokens x
    # 6,365,504 params x 6 = 14.9 PFLOP
    long = "trainer.total_steps=20000"
    assert liger(long) == ("true", "model.liger_kernel=true (fused RMSNorm/SwiGLU/RoPE for the llama "
                                   "model; the job's updates ~14.9 PFLOP)")
    assert liger(long, "model.tiny.model_type=qwen2") == (
        "true", "model.liger_kernel=true (fused RMSNorm/SwiGLU/RoPE for the qwen2 model; the job's "
                "updates ~14.9 PFLOP)")
    # this config's 20 steps: 0.0149 PFLOP, the import would cost more than the kernels save
    assert liger() == ("false", "model.liger_kernel=false (the job's updates ~0.0149 PFLOP, < 10: "
                                "liger's import (~10 s) would cost more than its kernels save; "
                                "model.liger_kernel=true turns it on)")
    assert liger("trainer.total_steps=13000")[0] == "false"  # 9.66 PFLOP
    assert liger("trainer.total_steps=13000", "algorithm.ppo_epochs=2",
                 "algorithm.recompute_old_logprobs=true")[0] == "true"  # two passes: 19.3
    assert liger(cuda=False) == ("false", "model.liger_kernel=false (CPU: liger's Triton kernels "
                                          "need a GPU)")
    assert liger(installed=False) == ("false", "model.liger_kernel=false (liger-kernel is not "
                                               "installed (pip install liger-kernel))")
    assert liger(long, "model.tiny.model_type=gpt2")[0] == "false"
    assert "not one auto turns liger on for" in liger(long, "model.tiny.model_type=gpt2")[1]
    # an HF directory: its config.json's model_type, read without loading the model
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text("{}")
    from flowrl.models.kernels import model_type_of

    assert model_type_of(str(d), None, "smollm2") == "qwen3"
    assert model_type_of("smollm2", None, "smollm2") == "llama"
    assert model_type_of(str(tmp_path), None, "smollm2") is None
    # explicit settings win, YAML booleans included
    assert liger("model.liger_kernel=false") == ("false", None)
    assert liger("model.liger_kernel=true", cuda=False) == ("true", None)


def test_liger_kernel_setting_is_checked_before_anything_loads():
    from flowrl.machine import machine_problems

    with pytest.raises(ValueError, match="model.liger_kernel must be one of"):
        _cfg("model.liger_kernel=fast")
    got = machine_problems(_cfg("trainer.device=cpu", "rollout=hf", "model.liger_kernel=true"),
                           cuda=False, vllm=False, flash_attn=False)
    assert got == ["model.liger_kernel=true needs trainer.device=cuda (liger-kernel's Triton "
                   "kernels run on a GPU); use auto or false"]


def test_gpu_without_vllm_and_explicit_settings_win():
    from flowrl.machine import resolve_machine_defaults

    cfg = _cfg()
    resolve_machine_defaults(cfg, cuda=True, vllm=False, flash_attn=True)
    assert (cfg.rollout.backend, cfg.model.attn_implementation) == ("hf", "flash_attention_2")
    cfg = _cfg("rollout=hf", "model.dtype=bfloat16", "trainer.engine.strategy=local",
               "trainer.engine.max_tokens_per_micro_batch=4096")
    got = resolve_machine_defaults(cfg, cuda=True, vllm=True, flash_attn=False)
    assert (cfg.rollout.backend, cfg.model.dtype, cfg.trainer.engine.strategy,
            cfg.trainer.engine.max_tokens_per_micro_batch, cfg.rollout.hf.dtype) == (
        "hf", "bfloat16", "local", 4096, "bfloat16")
    assert "rollout.backend" not in [r.field for r in got]


def test_cpu_machine_keeps_cpu_defaults():
    from flowrl.machine import resolve_machine_defaults
    from flowrl.runtime.step.resources import keep_resident

    cfg = _cfg()
    resolve_machine_defaults(cfg, cuda=False, vllm=True, flash_attn=True)
    assert (cfg.trainer.device, cfg.model.dtype, cfg.trainer.engine.strategy, cfg.rollout.backend,
            cfg.rollout.hf.dtype, cfg.model.attn_implementation,
            cfg.trainer.engine.max_tokens_per_micro_batch) == (
        "cpu", "float32", "auto", "hf", "float32", "sdpa", None)
    assert keep_resident(1, 1, torch.device("cpu")) is False
    # an explicit cuda still plans on a CPU-only machine (a GPU job inspected from a laptop)...
    gpu_job = _cfg("trainer.device=cuda")
    resolve_machine_defaults(gpu_job, cuda=False, vllm=False, flash_attn=False)
    assert (gpu_job.trainer.engine.strategy, gpu_job.rollout.hf.dtype) == ("fsdp", "bfloat16")


def test_machine_problems_name_what_cannot_run():
    from flowrl.machine import machine_problems

    assert machine_problems(_cfg("trainer.device=cpu", "rollout=hf"), cuda=False, vllm=False,
                            flash_attn=False) == []
    got = machine_problems(_cfg("trainer.device=cuda", "rollout=vllm",
                                "model.attn_implementation=flash_attention_2"),
                           cuda=False, vllm=False, flash_attn=False)
    assert [p.split(" ")[0] for p in got] == [
        "trainer.device=cuda", "rollout=vllm", "model.attn_implementation=flash_attention_2"]
    cpu_flex = machine_problems(_cfg("trainer.device=cpu", "rollout=hf",
                                     "model.attn_implementation=flex_attention"),
                                cuda=False, vllm=True, flash_attn=True)
    assert len(cpu_flex) == 1 and "flex_attention runs on CUDA only" in cpu_flex[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_train_refuses_cuda_without_a_device(tmp_path):
    from flowrl.config import compose
    from flowrl.train import ConfigError, train

    # ...but a run refuses it before anything loads, and writes no run directory content
    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA device"):
        train(compose(["model=tiny", f"trainer.output_dir={tmp_path}/run", "trainer.device=cuda"]))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device, offload, expected", [
    ("cpu", "auto", "trainer.offload=auto: the timeline's offload/onload actions are skipped: "
                    "every model stays resident (CPU run: nothing to free)"),
    ("cuda", "auto", "trainer.offload=auto: decided at start-up from the built engines: every "
                     "model stays resident (the offload/onload actions are skipped) when the "
                     "training state and the rollout budget fit in 80% of the device, else they "
                     "all run"),
    ("cpu", "never", "trainer.offload=never: the timeline's offload/onload actions are skipped: "
                     "every model stays resident"),
    ("cuda", "rollout", "trainer.offload=rollout: only the generation engines' offload/onload run "
                        "(vLLM sleeps through the update, an HF copy moves to host memory); the "
                        "training state stays resident"),
])
def test_plan_says_what_offload_does_with_the_swap_actions(device, offload, expected):
    """`flowrl plan` prints the timeline's offload/onload actions whatever trainer.offload says;
    its machine-defaults block says which of them a run really performs (fresh-user check)."""
    from flowrl.plan import start_up_resolutions

    cfg = _cfg(f"trainer.device={device}", f"trainer.offload={offload}", "rollout=hf")
    lines = start_up_resolutions(cfg)
    assert lines[0] == expected
    # the HF engine's compile rule, as flowrl train prints it at start-up
    assert lines[1].startswith("rollout.hf.compile=false (")
    assert len(lines) == 2


def test_rollout_logprobs_auto_measures_a_sample_only_where_nothing_reads_them():

    def mode(*overrides, cuda=True, vllm=True):
        return _resolve("rollout.sampling.logprobs", *overrides, cuda=cuda, vllm=vllm)

    assert mode() == ("sampled", "rollout.sampling.logprobs=sampled (nothing in the loss reads "
                                 "them: steps 1, 9, 17, ... ask vLLM for them and log "
                                 "rollout/logprob_mismatch; the others decode ~8% faster without)")
    assert mode("algorithm.rollout_is=tis") == (
        "all", "rollout.sampling.logprobs=all (algorithm.rollout_is=tis weighs every token by it)")
    assert mode(vllm=False) == ("all", "rollout.sampling.logprobs=all (transformers' logprobs "
                                       "cost nothing)")
    assert mode(cuda=False) == ("all", "rollout.sampling.logprobs=all (transformers' logprobs "
                                       "cost nothing)")
    assert mode("rollout.sampling.logprobs=none") == ("none", None)  # explicit: left alone


def test_rollout_is_with_unmeasured_rollout_logprobs_is_refused_before_any_model_loads():
    from flowrl.config import compose
    from flowrl.train import prepare

    for mode, what in (("sampled", r"measures them on steps 1, 9, 17, \.\.\. only"),
                       ("none", "measures none")):
        with pytest.raises(Exception, match=r"algorithm.rollout_is=tis weighs every token by its "
                                            r"rollout logprob, but rollout.sampling.logprobs="
                                            f"{mode} {what}: use auto or all"):
            prepare(compose(["model=tiny", "trainer.output_dir=/tmp/unused",
                             "algorithm.rollout_is=tis", f"rollout.sampling.logprobs={mode}"]))


def test_job_update_pflop():
    from flowrl.models.kernels import job_update_pflop

    # 100 steps of the e2e pair: 256 rows x (256 + 256) tokens at the Qwen2.5-0.5B shape
    assert job_update_pflop(494_032_768, 100 * 256, 512) == pytest.approx(38.853, abs=1e-3)
    assert job_update_pflop(1_000_000, 1000, 100, passes=4) == pytest.approx(2.4e-3)


@pytest.mark.parametrize("overrides, procs_line", [
    ((), "rollout.vllm.engine_procs=0 (one engine, in the trainer's process"),
    (("placement.staleness=1",), "rollout.vllm.engine_procs=1 (1 engine process(es)"),
])
def test_plan_sizes_vllm_as_the_engine_build_does(monkeypatch, overrides, procs_line):
    """`flowrl plan` of a GPU job with vLLM (planned on this CPU machine: the H200 profile's
    memory) prints the job-sized rollout.vllm settings exactly as the engine build resolves them
    from the *loaded* model (its parameter bytes and kv_shape): the plan reads the size from the
    config alone, so a disagreement between the two would show here."""
    import flowrl.machine
    from flowrl.compiler.devices import DEVICES
    from flowrl.engines.rollout.vllm import kv_shape, weights_and_device_memory
    from flowrl.models.loading import load_model
    from flowrl.plan import vllm_start_up
    from flowrl.runtime.step.resources import response_tokens, rollout_job
    from flowrl.train import prepare

    monkeypatch.setattr(flowrl.machine, "cuda_available", lambda: False)
    spec = prepare(["model=tiny", "trainer.device=cuda", "rollout=vllm",
                    "trainer.output_dir=/tmp/unused", *overrides], plan_only=True)
    cfg, pp = spec.config, spec.placement
    lines = vllm_start_up(cfg, pp)
    assert lines[0] == "rollout.vllm, sized at start-up for an H200 (device profile; no CUDA device here):"

    v = cfg.rollout.vllm
    model = load_model(cfg.model)  # fp32 master weights on CPU: the bytes a GPU run loads too
    weight_bytes, _ = weights_and_device_memory(model)
    _, _, why = v.sized_for(rollout_job(cfg, 1, response_tokens(pp.full)), weight_bytes,
                            DEVICES["h200"].memory, own_process=pp.overlapped,
                            kv=kv_shape(model, v))
    assert lines[1:] == [f"  {line}" for line in why]
    assert lines[1].startswith(f"  {procs_line}")
    assert any(line.startswith("  rollout.vllm.torch_compile=false (") for line in lines)
    assert any(line.startswith("  rollout.vllm.kv_cache_memory_gb=") for line in lines)
