"""Fused Triton kernels for the policy's forward/backward: liger-kernel's RMSNorm, SwiGLU and RoPE.

Why: in one GRPO update on the H200 (``benchmarks/update_step.py``, Qwen2.5-0.5B shape, 256 rows)
55 % of the GPU's kernel time is elementwise and reduction kernels of eager PyTorch (RMSNorm's
upcasts, SiLU x mul, RoPE's rotate-half, their backward), not matmuls; liger-kernel's fused
kernels cut the step to 0.85x (0.5B) and 0.83x (1.5B: MFU 33.6 % -> 40.3 %) and lower the
activation peak (benchmarks/results/update_step_h200.md).

Only these three are used: the LM head and its log-softmax are flowrl's own chunked path
(``algorithms/logprobs.linear_logprobs``), so liger's fused linear cross-entropy is left off.

``model.liger_kernel`` (``ModelConfig``): ``auto`` = on with a CUDA device, the package installed,
a model type in :data:`AUTO_MODEL_TYPES` (the ones measured and GPU-tested) and a job whose
updates come to :data:`LIGER_MIN_JOB_PFLOP` (its import costs ~10 s of start-up); ``true`` = any
model type liger-kernel supports (refused before loading when the package, CUDA or the type is
missing); ``false`` = never. Resolved in ``flowrl/machine.py``.

RoPE over one row: liger-kernel 0.8.5's RoPE kernel takes the batch size as a Triton
``constexpr``, so every new micro-batch row count compiles two new kernels (forward and backward)
in the middle of a step. Padded micro-batches cut to a token budget have a new row count whenever
the step's lengths change (SmolLM2's short, varying answers: every step; its update beside TRL
took 1.6x TRL's, benchmarks/results/e2e_vs_trl_h100.md, where this is one of two suspected
per-shape costs; its share is not measured apart). :func:`rope_over_one_row` hands liger the
(b, L) positions as one row of b*L (RoPE is per position, so the result is the same), and the
kernel compiles once.

Decoding runs eager: inside :func:`eager_kernels` (the HF rollout engine's ``generate``) the
patched model runs transformers' own RMSNorm, MLP and RoPE code, since at one token a row liger's host cost
per call (90-120 µs) outweighs its GPU saving and the decode loop is host-bound.

Caveat (liger-kernel 0.8.5): besides the model instance it is given, ``apply_liger_kernel_to_*``
replaces the transformers module's RMSNorm / MLP classes and its ``apply_rotary_pos_emb``
function. :func:`apply_liger_kernels` puts the classes back (the instance keeps its patched
modules), so a later ``model.liger_kernel=false`` model of that type is built with eager modules
(found by the GPU tier: a test's eager model got liger's MLP after an earlier run in the same
process); the RoPE function stays liger's (through :func:`rope_over_one_row`), since the patched
instance looks it up in that module at call time (same math: tests/gpu/test_liger_gpu.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

if TYPE_CHECKING:
    from torch import Tensor, nn

RopeFn = Callable[..., "tuple[Tensor, Tensor]"]  # transformers' apply_rotary_pos_emb signature

LIGER_MODES = ("auto", "true", "false")
# model types `auto` turns liger on for: measured on the H200 (qwen2) or the same kernels on the
# same module layout (llama: SmolLM2; mistral, qwen3), and covered by tests/gpu/test_liger_gpu.py
AUTO_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# ... and only for a job whose updates are long enough to repay liger's import: importing its
# monkey_patch (torch._dynamo, triton, peft and a transformers model module per supported type)
# took 7.3 s on an H100 and 10.2 s of the default job's 34.6 s to step 1 on a warm H200
# (benchmarks/results/first_step_h200.md), against an update 0.85x as long with its kernels
# (update_step_h200.md). 10 PFLOP of update (6 x params x tokens, tokens counted at
# data.max_prompt_tokens + max_new_tokens per row) is ~30-55 s of update at the 20-35 % MFU
# measured there, of which 15 % repays ~5-8 s. The default job (SmolLM2-135M, 20 x 64 rows) has
# 0.3 PFLOP; 100 steps of the e2e pair's 256 rows at the 0.5B shape 38.
LIGER_MIN_JOB_PFLOP = 10.0


def job_update_pflop(n_params: int, rows: int, tokens_per_row: int, passes: int = 1) -> float:
    """The training FLOP of a whole job's updates in PFLOP: 6 x ``n_params`` x tokens (forward
    and backward of a dense decoder, Kaplan et al. 2020, eq. 2.1), tokens = ``rows`` (all steps)
    x ``tokens_per_row`` (an upper bound: prompt limit + response width) x ``passes``
    (``algorithm.ppo_epochs``)."""
    return 6 * n_params * rows * tokens_per_row * passes / 1e15


@contextlib.contextmanager
def eager_kernels(model: "nn.Module") -> Iterator[None]:
    """Inside, ``model`` (patched by :func:`apply_liger_kernels`; any other model is left as it
    is) runs transformers' own RMSNorm, MLP and RoPE code instead of liger's kernels: same
    parameters, same math up to bf16 rounding. On exit liger's are back. Nests.

    Why: each liger call costs 90-120 µs of host time (an autograd Function and a Triton launch)
    against a few µs of GPU time at a decode step's shape (256 rows x 1 token); in the 0.5B HF
    rollout on an H100 that was 2.2 s of host time in an 8.0 s generate, host-bound
    (benchmarks/results/e2e_vs_trl_h100.md). Eager's few small ATen ops cost less there.
    The HF rollout engine runs its whole ``generate`` inside this (``engines/rollout/hf.py``;
    the prefill too: one call of many, not worth a switch), with ``rollout.hf.compile=true`` as
    well: dynamo then compiles transformers' own modules instead of tracing liger's kernels,
    which it could not (liger-kernel 0.8.5's RMSNorm kernel failed in its Triton-kernel wrapper:
    7 graph breaks, 16 graph pieces per decode step, 37.8 ms a step against eager's 28.8 ms on an
    H100, ``benchmarks/results/hf_generate_compile_h100.md``); training and logprob passes, whose
    shapes are thousands of tokens, keep liger's kernels.
    RoPE goes back to transformers' own only where flowrl installed liger's
    (``rope_over_one_row``: the types of :data:`AUTO_MODEL_TYPES`); another type forced on with
    ``model.liger_kernel=true`` keeps liger's own RoPE patch here.

    How: the patched modules' instance ``forward`` (liger's) is removed for the duration, so the
    class's own runs, and the transformers module's ``apply_rotary_pos_emb`` is its own function
    again (that swap is module-wide: a model of the same type running in another thread
    meanwhile would compute the same values with eager RoPE). Nothing is checked per call, so a
    ``torch.compile``'d model traces no flag (a per-call context check broke its graph at every
    module).
    """
    # only where liger's forward is still the one installed (a later wrapper is left alone)
    modules = [m for m in model.modules()
               if "_liger_forward" in vars(m) and vars(m).get("forward") is vars(m)["_liger_forward"]]
    ropes: dict[types.ModuleType, tuple[RopeFn, RopeFn]] = {}  # module: (installed, eager)
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        rope = getattr(mod, "apply_rotary_pos_emb", None)
        eager = getattr(rope, "eager", None)
        if mod is not None and rope is not None and eager is not None:
            ropes[mod] = (rope, eager)
    for m in modules:
        del m.__dict__["forward"]  # the class's own forward runs
    for mod, (_, eager) in ropes.items():
        setattr(mod, "apply_rotary_pos_emb", eager)  # noqa: B010
    try:
        yield
    finally:
        for m in modules:
            m.__dict__["forward"] = m.__dict__["_liger_forward"]
        for mod, (rope, _) in ropes.items():
            setattr(mod, "apply_rotary_pos_emb", rope)  # noqa: B010


def rope_over_one_row(inner: RopeFn, eager: Optional[RopeFn] = None) -> RopeFn:
    """``inner`` (a RoPE function with transformers' ``apply_rotary_pos_emb`` signature: liger's)
    applied to a micro-batch's rows as one row, so ``inner`` always sees batch size 1.

    Why: liger-kernel's RoPE kernel compiles per batch size (module docstring). RoPE rotates each
    (row, position) pair by its own ``cos``/``sin``, so the (b, L) positions laid end to end as
    one row of b*L give the same values (tests/unit/test_liger_rope_rows.py: bitwise equal with
    the eager function as ``inner``).

    The returned function takes ``q`` (b, n_q_heads, L, head_dim), ``k`` (b, n_kv_heads, L,
    head_dim), ``cos``/``sin`` (b or 1, L, rotary_dim), any dtype and device, and returns the
    rotated ``(q, k)`` in the input shapes. Moving to one row is a view when ``q``/``k`` are
    transposes of (b, L, heads, head_dim) tensors (transformers' attention layout); ``cos``/``sin``
    of batch 1 are expanded to b rows (b*L*rotary_dim values copied). Calls ``inner`` unchanged
    for b == 1, ``cos`` not 3-d, or any argument past ``sin`` (``unsqueeze_dim``: a layout this
    was not written for; the attention of the types it is installed for passes none).
    ``eager`` (transformers' own function) is kept as the result's ``eager`` attribute: what
    :func:`eager_kernels` puts back for its duration, and what a later install finds.
    """
    def rope(q: "Tensor", k: "Tensor", cos: "Tensor", sin: "Tensor", *args: object,
             **kwargs: object) -> "tuple[Tensor, Tensor]":
        b, L = q.shape[0], q.shape[2]
        if b == 1 or cos.dim() != 3 or args or kwargs:
            return inner(q, k, cos, sin, *args, **kwargs)

        def one_row(x: "Tensor") -> "Tensor":  # (b, h, L, d) -> (1, h, b*L, d)
            return x.transpose(1, 2).reshape(1, b * L, x.shape[1], x.shape[3]).transpose(1, 2)

        def rows(x: "Tensor", h: int) -> "Tensor":  # (1, h, b*L, d) -> (b, h, L, d)
            return x.transpose(1, 2).reshape(b, L, h, x.shape[3]).transpose(1, 2)

        def flat(t: "Tensor") -> "Tensor":  # (b or 1, L, r) -> (1, b*L, r)
            return t.expand(b, L, t.shape[-1]).reshape(1, b * L, t.shape[-1])

        q1, k1 = inner(one_row(q), one_row(k), flat(cos), flat(sin))
        return rows(q1, q.shape[1]), rows(k1, k.shape[1])

    rope.eager = eager  # type: ignore[attr-defined]  # a later install finds transformers' own
    return rope


def liger_importable() -> bool:
    """liger-kernel is installed (found without importing it: it imports triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def model_type_of(path: str, tiny: Optional[dict], smollm2: str) -> Optional[str]:
    """The ``model_type`` a ``ModelConfig`` will load, without loading it: a tiny model's own,
    ``llama`` for the bundled SmolLM2 GGUF, else the HF directory's ``config.json``; None when it
    cannot be read (a GGUF in a directory of its own)."""
    if tiny is not None:
        return str(tiny.get("model_type"))
    if path == smollm2:
        return "llama"
    try:
        return str(json.loads((Path(path) / "config.json").read_text())["model_type"])
    except (OSError, ValueError, KeyError):
        return None


def liger_supported_types() -> tuple[str, ...]:
    """Every model type liger-kernel has a patch for (imports liger-kernel and triton)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return tuple(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))


def apply_liger_kernels(model: "nn.Module") -> str:
    """Swap the RMSNorm, SwiGLU MLP and RoPE of ``model`` (a transformers causal LM, on CUDA) for
    liger-kernel's Triton kernels, in place; same parameters and state dict, same math up to bf16
    rounding (tests/gpu/test_liger_gpu.py bounds the logprob and gradient differences).

    Returns:
        The model type patched (for the console).

    Raises:
        ValueError: liger-kernel has no patch for the model's type.
        ImportError: liger-kernel is not installed.
    """
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(str(model_type))
    if fn is None:
        raise ValueError(f"model.liger_kernel=true: liger-kernel has no kernels for model type "
                         f"{model_type!r} (it has: {', '.join(liger_supported_types())}); use "
                         "model.liger_kernel=false or auto")
    import inspect

    module = sys.modules.get(type(model).__module__)
    # the measured types' attention calls its module's apply_rotary_pos_emb(q, k, cos, sin):
    # liger's RoPE goes in through rope_over_one_row; other types keep liger's own patch
    one_row = str(model_type) in AUTO_MODEL_TYPES and hasattr(module, "apply_rotary_pos_emb")
    wanted = dict(rope=not one_row, rms_norm=True, swiglu=True, cross_entropy=False,
                  fused_linear_cross_entropy=False)
    params = inspect.signature(fn).parameters
    before = dict(vars(module)) if module is not None else {}
    bound = {id(m) for m in model.modules() if "forward" in vars(m)}
    fn(model=model, **{k: v for k, v in wanted.items() if k in params})
    for name, old in before.items():  # the module's classes back (see the module docstring)
        if isinstance(old, type) and getattr(module, name) is not old:
            setattr(module, name, old)
    for m in model.modules():  # the modules liger's patch bound a forward to: eager_kernels
        if "forward" in vars(m) and id(m) not in bound:  # takes it away and puts it back
            # a bound method, so a deep copy of the model (the frozen reference) rebinds it to
            # the copy's module (a closure would keep the original's weights)
            m.__dict__["_liger_forward"] = m.__dict__["forward"]
    if one_row and module is not None:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        current = getattr(module, "apply_rotary_pos_emb")  # noqa: B009
        eager = getattr(current, "eager", None) or current  # transformers' own, even on a re-install
        # setattr: an attribute of the transformers module that mypy cannot see
        setattr(module, "apply_rotary_pos_emb",  # noqa: B010
                rope_over_one_row(liger_rotary_pos_emb, eager=eager))
    return str(model_type)
