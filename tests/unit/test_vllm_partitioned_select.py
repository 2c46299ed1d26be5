"""rollout=vllm placement=partitioned: accepted before any model loads, and a partitioned rollout
pool gets the vLLM engine in child processes (engines/rollout/vllm_proc.py), never the in-process
one; engines are closed when a partitioned run fails. No vLLM needed: the engine classes are
replaced by recorders."""
import pytest
import torch

from flowrl.config import compose, to_train_config
from flowrl.engines import rollout as rollout_pkg
from flowrl.engines.rollout import build_rollout_engine, vllm_proc
from flowrl.engines.rollout import hf as hf_mod
from flowrl.engines.rollout import vllm as vllm_mod
from flowrl.runtime.control.preflight import prepare_placement
from flowrl.runtime.step.resources import build_engines
from flowrl.train import prepare

PARTITIONED_VLLM = ["rollout=vllm", "placement=partitioned", "launcher.nproc=2", "model=tiny",
                    "trainer=smoke", "model.tiny.num_attention_heads=2",
                    "model.tiny.num_key_value_heads=1"]


class Recorder:
    """Stands in for an engine class: records how it was built."""

    def __init__(self, kind, built):
        self.kind, self.built = kind, built

    def __call__(self, model, tokenizer, cfg=None, procs=None, **kw):
        self.built.append((self.kind, procs))
        return self.kind


@pytest.fixture
def built(monkeypatch):
    out: list = []
    monkeypatch.setattr(vllm_proc, "VLLMProcessEngine", Recorder("process", out))
    monkeypatch.setattr(vllm_mod, "VLLMRolloutEngine", Recorder("in_process", out))
    monkeypatch.setattr(hf_mod, "HFRolloutEngine", Recorder("hf", out))
    return out


def test_partitioned_vllm_composes_and_places(tmp_path):
    spec = prepare(compose(PARTITIONED_VLLM + [f"trainer.output_dir={tmp_path}"]))
    cfg, plan = spec.config, spec.plan
    assert cfg.rollout.backend == "vllm" and cfg.placement.mode == "partitioned"
    placement = prepare_placement(cfg, plan, 2)
    assert {k: list(v.ranks) for k, v in placement.pools.items()} == {"rollout": [1], "train": [0]}
    assert "rollout" in placement.pools["rollout"].roles
    assert "rollout" not in placement.pools["train"].roles


@pytest.mark.parametrize("own_process, engine_procs, expected", [
    (False, "null", ("in_process", None)),  # default on CPU: vLLM in the rank's process
    (True, "null", ("process", 1)),  # partitioned rollout pool on CPU: one engine process
    (False, 0, ("in_process", None)),
    (True, 0, ("process", 1)),  # partitioned rollout pool: 0 means one engine process
    (True, 2, ("process", 2)),
    (False, 3, ("process", 3)),  # colocated, asked for engine processes
])
def test_vllm_builder_picks_the_process_engine(built, own_process, engine_procs, expected):
    cfg = to_train_config(compose(["rollout=vllm", f"rollout.vllm.engine_procs={engine_procs}",
                                   "rollout.vllm.max_num_seqs=8", "trainer.output_dir=x"]))
    model = torch.nn.Linear(4, 4)  # on CPU
    engine = build_rollout_engine(cfg.rollout, model, None, own_process=own_process)
    assert built == [expected] and engine == expected[0]


def test_auto_engine_procs_on_cuda_follows_the_weights_size():
    from flowrl.engines.rollout.vllm_config import AUTO_ENGINE_PROCS, VLLMRolloutConfig

    cfg = VLLMRolloutConfig(gpu_memory_utilization=0.5)  # engine_procs null
    h200 = 141 * 2**30
    # 4 copies of a 0.5B bf16 model (0.99 GB) fit in a quarter of 0.5 x 141 GiB: 4 engines
    assert cfg.engine_procs_for(988_065_536, h200) == AUTO_ENGINE_PROCS == 4
    # the limit: 4 copies == a quarter of the budget (4.41 GiB each)
    edge = int(0.5 * h200 / 4 / 4)
    assert cfg.engine_procs_for(edge, h200) == 4
    assert cfg.engine_procs_for(edge + 1, h200) == 1  # a 7B model: one engine (own process)
    assert cfg.engine_procs_for(10, None) == 0  # CPU: in process
    assert cfg.engine_procs_for(10, None, own_process=True) == 1
    assert VLLMRolloutConfig(engine_procs=2).engine_procs_for(edge + 1, h200) == 2  # explicit wins


def test_hf_builder_ignores_own_process(built):
    cfg = to_train_config(compose(["rollout=hf", "trainer.output_dir=x"]))
    assert build_rollout_engine(cfg.rollout, None, None, own_process=True) == "hf"
    assert built == [("hf", None)]


def test_build_engines_gives_a_pool_rank_its_own_process(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(rollout_pkg, "build_rollout_engine",
                        lambda *a, **kw: calls.append(kw) or "engine")
    from flowrl.models.loading import load_tokenizer

    spec = prepare(compose(PARTITIONED_VLLM + [f"trainer.output_dir={tmp_path}"]))
    cfg, plan = spec.config, spec.plan
    tok = load_tokenizer(cfg.model)
    pools = prepare_placement(cfg, plan, 2).pools
    engines = build_engines(cfg, pools["rollout"].plan, tok, world_size=1, group=object())
    assert engines.by_role() == {"rollout": "engine"}
    assert [{k: v for k, v in kw.items() if k != "job"} for kw in calls] == [
        {"shared": False, "own_process": True, "image_processor": None, "lora": None}]  # text, no LoRA
    assert calls[0]["job"].ranks == 1  # the pool rank's own engine
    calls.clear()
    spec = prepare(compose(["rollout=vllm", "model=tiny", "trainer=smoke",
                                           "model.tiny.num_attention_heads=2",
                                           f"trainer.output_dir={tmp_path}"]))
    colo_cfg, colo_plan = spec.config, spec.plan
    build_engines(colo_cfg, colo_plan, tok)  # colocated, one process: in-process vLLM
    assert [{k: v for k, v in kw.items() if k != "job"} for kw in calls] == [
        {"shared": True, "own_process": False, "image_processor": None, "lora": None}]
    t = colo_cfg.trainer
    assert calls[0]["job"].seqs_per_step == t.prompts_per_step * colo_cfg.algorithm.n


def test_partitioned_run_closes_its_engines_on_error(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from flowrl.ops.context import DistInfo
    from flowrl.runtime.control import job

    closed = []

    class Engine:
        def close(self):
            closed.append(True)

    def fail(self, resume_from):  # the job's run, after its rank built a rollout engine
        self.engines.rollout = Engine()
        raise RuntimeError("rollout failed")

    monkeypatch.setattr(job._Job, "run", fail)
    cfg = SimpleNamespace(trainer=SimpleNamespace(keep_last=2, resume=False, total_steps=1))
    with pytest.raises(RuntimeError, match="rollout failed"):
        job.run_placement(cfg, None, None, DistInfo(), tmp_path)
    assert closed == [True]
