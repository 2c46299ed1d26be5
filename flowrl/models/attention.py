"""``sdpa_varlen`` and ``sdpa_flex``: SDPA everywhere, a per-document kernel for packed micro-batches.

Padding-free training packs a micro-batch's sequences back to back in one row
(:mod:`flowrl.algorithms.packing`); attention must then stay inside each sequence. Under
transformers' ``sdpa`` that takes a dense (T, T) mask, so the kernel computes all T² scores (a
16k-token micro-batch of 64 sequences of 256: 64× the attention FLOPs of the documents alone);
flash-attn's varlen kernels are not installed on every GPU machine. torch's ``flex_attention``
(Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention
Kernels") skips the blocks a :class:`~torch.nn.attention.flex_attention.BlockMask` rules out, so a
packed row costs what its documents cost.

``sdpa_flex`` is registered with transformers' attention and mask interfaces under one name:

- the mask function builds the BlockMask of the causal, per-document mask (transformers finds the
  documents from the position ids, ``find_packed_sequence_indices``) only inside
  :func:`packed_attention` — the train engine's packed forward — and SDPA's mask everywhere else
  (``generate``, padded forwards): those run exactly as under ``sdpa``;
- the attention function dispatches on the mask it is given: a BlockMask → flex_attention, anything
  else → SDPA. The mask travels with the layer inputs, so an activation-checkpoint recompute in the
  backward pass takes the same kernel as the forward did.

On CUDA both the mask construction and the kernel are compiled (``torch.compile``: Triton). On
CPU, where flex_attention has no backward, a packed forward takes SDPA's dense block-diagonal
mask instead (same values; the CPU equivalence tests run both, flex without grad).

``sdpa_varlen`` (opt-in: ``flowrl/machine.py`` ``AUTO_SDPA_VARLEN`` says why it is not the default)
runs a packed row through PyTorch's own variable-length FlashAttention,
``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; Dao 2023, "FlashAttention-2"), with
nothing to compile: its mask function returns a :class:`VarlenMask` holding the row's document
boundaries (``cu_seqlens``, built on the host by :func:`flowrl.algorithms.packing.pack` and handed
in through :func:`packed_attention`), and its attention function runs the kernel on it, causal
inside each document. The torch releases differ (``is_causal`` in 2.10, ``window_size`` from 2.11,
``enable_gqa`` later): :func:`varlen_causal_attention` reads the signature once and repeats the
key/value heads itself where the kernel takes no grouped-query heads. On CPU (no varlen kernel) a
packed forward takes SDPA's dense block-diagonal mask, as under ``sdpa_flex``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

SDPA_FLEX = "sdpa_flex"
SDPA_VARLEN = "sdpa_varlen"


@dataclass(frozen=True)
class Documents:
    """The document boundaries of a packed row (:class:`flowrl.algorithms.packing.PackedBatch`).

    Attributes:
        cu_seqlens: (N+1,) int32 on the model's device: 0, then the cumulative document lengths
            (the last entry is the row's length T).
        max_seqlen: the longest document, in tokens (a host int: the kernel takes it as one).
    """

    cu_seqlens: Tensor
    max_seqlen: int


@dataclass(frozen=True)
class _Packed:
    kernel: Optional[bool]  # True: the per-document kernel, False: SDPA's dense mask, None: on CUDA
    documents: Optional[Documents]


# None outside a packed forward
_PACKED: contextvars.ContextVar[Optional[_Packed]] = contextvars.ContextVar(
    "flowrl_packed_attention", default=None)
_compiled: dict[str, Any] = {}
_registered: set[str] = set()


def sdpa_backends_enabled() -> list[Any]:
    """SDPA's kernels allowed right now (torch's global flags, as ``sdpa_kernel`` sets them)."""
    from torch.nn.attention import SDPBackend

    b = torch.backends.cuda
    return [k for k, on in ((SDPBackend.FLASH_ATTENTION, b.flash_sdp_enabled()),
                            (SDPBackend.EFFICIENT_ATTENTION, b.mem_efficient_sdp_enabled()),
                            (SDPBackend.MATH, b.math_sdp_enabled()),
                            (SDPBackend.CUDNN_ATTENTION, b.cudnn_sdp_enabled())) if on]


def sdpa_without_cudnn(device: torch.device, cudnn: bool = False) -> contextlib.AbstractContextManager[Any]:
    """SDPA's kernels for a masked call on ``device``: on CUDA (unless ``cudnn``) the ones allowed
    now less cuDNN attention, so a masked call takes the memory-efficient kernel; else no change.

    Why: cuDNN builds a graph for every new shape. On an H100 (``benchmarks/sdpa_shapes.py``,
    benchmarks/results/sdpa_shapes_h100.md) a new (rows, length) shape cost 86 ms of forward +
    backward against 1.5 ms for the memory-efficient kernel, and a decode step whose KV cache is
    one key longer each call 36 ms against 0.4 ms. The train engine's padded micro-batches and
    transformers' generate (a dynamic cache grows every step) both bring new shapes all the time.
    ``TrainEngineConfig.cudnn_attention`` / ``HFRolloutConfig.cudnn_attention`` set ``cudnn``.
    """
    if device.type != "cuda" or cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([b for b in sdpa_backends_enabled() if b != SDPBackend.CUDNN_ATTENTION])


def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager[Any],
                                     contextlib.AbstractContextManager[Any]]:
    """``torch.utils.checkpoint``'s ``context_fn``: a checkpointed layer's recompute (in the
    backward, possibly on autograd's device thread) runs under the attention state its forward
    ran under: the packed row (:func:`packed_attention`, a context variable) and SDPA's allowed
    kernels (the train engine leaves cuDNN out for padded micro-batches,
    ``TrainEngineConfig.cudnn_attention``). Both are gone by the backward: without this the
    recompute would take another kernel, and non-reentrant checkpointing raises
    ``CheckpointError`` (different saved tensors), or a packed row would recompute unpacked.
    Called once per checkpointed call, in the forward; returns (forward context, recompute
    context)."""
    packed, backends = _PACKED.get(), sdpa_backends_enabled()

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        from torch.nn.attention import sdpa_kernel

        token = _PACKED.set(packed)
        try:
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                yield
        finally:
            _PACKED.reset(token)

    return contextlib.nullcontext(), recompute()


def checkpoint_kwargs() -> dict[str, Any]:
    """What flowrl passes to transformers' ``gradient_checkpointing_enable`` /
    ``activation_checkpointing_enable``: non-reentrant checkpointing (the only kind that takes a
    ``context_fn``) with :func:`checkpoint_context_fn`."""
    return {"use_reentrant": False, "context_fn": checkpoint_context_fn}


@contextlib.contextmanager
def packed_attention(kernel: Optional[bool] = None, *,
                     documents: Optional[Documents] = None) -> Iterator[None]:
    """Inside: the forward of a packed row. A ``sdpa_flex`` / ``sdpa_varlen`` model then attends
    per document with its kernel (a flex BlockMask / ``varlen_attn`` over ``documents``) when
    ``kernel`` (None: on CUDA), else with SDPA's dense (T, T) block-diagonal mask (on CPU: torch's
    flex_attention has no CPU backward, varlen_attn no CPU kernel). ``sdpa_varlen``'s kernel needs
    ``documents``; ``sdpa_flex`` reads the documents from the position ids instead."""
    token = _PACKED.set(_Packed(kernel, documents))
    try:
        yield
    finally:
        _PACKED.reset(token)


def _flex(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "flex" not in _compiled:
        # one compiled kernel per process; dynamic from the start: every packed micro-batch has
        # its own length, and a static first compile would be thrown away at the second length
        _compiled["flex"] = torch.compile(flex_attention, dynamic=True)
    return _compiled["flex"]


def sdpa_flex_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                   kv_offset: int = 0, mask_function: Any = None, attention_mask: Any = None,
                   device: "torch.device | str" = "cpu", **kwargs: Any) -> Any:
    """transformers' mask interface of ``sdpa_flex``: a flex BlockMask inside a flex
    :func:`packed_attention` (built compiled on CUDA), ``sdpa_mask`` otherwise (arguments passed
    on; for a packed row transformers adds the per-document term to ``mask_function``)."""
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    state = _PACKED.get()
    flex = state is not None and (state.kernel if state.kernel is not None
                                  else torch.device(device).type == "cuda")
    if not flex:  # outside a packed forward, or its dense SDPA mask
        return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                            q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                            attention_mask=attention_mask, device=device, **kwargs)
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("a packed forward takes no padding mask (one row, position ids per document)")
    from torch.nn.attention.flex_attention import create_block_mask

    fn = mu.add_offsets_to_mask_function(mask_function, q_offset, kv_offset)
    return create_block_mask(mask_mod=fn, B=batch_size, H=None, Q_LEN=q_length, KV_LEN=kv_length,
                             device=device, _compile=torch.device(device).type == "cuda")


def sdpa_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: Any, scaling: Optional[float] = None,
                        dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface of ``sdpa_flex``: query (B, H, T, D), key/value
    (B, H_kv, T, D) → (B, T, H, D). A BlockMask runs flex_attention (grouped-query heads shared
    by ``enable_gqa``); any other mask runs transformers' SDPA function unchanged.

    Raises:
        ValueError: a packed forward with attention dropout, a soft-cap or sink tokens (what the
            flowrl packed path does not implement; flowrl trains with dropout off).
    """
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if dropout > 0 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("sdpa_flex: a packed forward supports no attention dropout, soft-cap or "
                         "sink tokens (set trainer.engine.padding_free=false)")
    gqa = query.shape[1] != key.shape[1]
    out = _flex(query.device)(query, key, value, block_mask=attention_mask, scale=scaling,
                              enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def varlen_attn_supported() -> bool:
    """torch's ``varlen_attn`` can run here: ``torch.nn.attention.varlen`` has it (torch >= 2.10)
    and the current CUDA device is sm80 or newer (FlashAttention-2's minimum)."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return tuple(torch.cuda.get_device_capability()) >= (8, 0)


def _varlen_kernel(device: torch.device) -> Optional[Callable[..., Any]]:
    """torch's ``varlen_attn`` for tensors on ``device``; None off CUDA (it has no CPU kernel).

    Raises:
        RuntimeError: on CUDA, a torch without ``torch.nn.attention.varlen.varlen_attn``.
    """
    if device.type != "cuda":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise RuntimeError(
            f"sdpa_varlen needs torch.nn.attention.varlen.varlen_attn (torch >= 2.10), torch "
            f"{torch.__version__} has none: use model.attn_implementation=sdpa_flex or sdpa") from e
    return varlen_attn


@functools.lru_cache(maxsize=8)
def _parameters(fn: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def varlen_causal_attention(fn: Callable[..., Any], query: Tensor, key: Tensor, value: Tensor,
                            documents: Documents, scale: Optional[float] = None) -> Tensor:
    """Causal attention inside each document of a packed row through ``fn`` (torch's
    ``varlen_attn``), whichever of its signatures this torch has: causal by ``window_size=(-1, 0)``
    (torch >= 2.11) or ``is_causal=True`` (2.10); grouped-query heads by ``enable_gqa`` where it
    exists, else by repeating each key/value head (``repeat_interleave``, as SDPA's
    ``enable_gqa`` does); ``scale`` folded into the query where ``fn`` takes none.

    Args:
        query: (T, H, D); key, value: (T, H_kv, D), H a multiple of H_kv; bf16/fp16 on CUDA.
        documents: the row's boundaries (``cu_seqlens[-1] == T``).
        scale: the score scale (None: 1/sqrt(D)).
    Returns:
        (T, H, D), the dtype of ``query``.

    Raises:
        ValueError: ``fn`` takes neither ``window_size`` nor ``is_causal``; H not a multiple of H_kv.
    """
    params = _parameters(fn)
    H, H_kv = query.shape[1], key.shape[1]
    if H % H_kv:
        raise ValueError(f"sdpa_varlen: {H} query heads are not a multiple of {H_kv} key/value heads")
    kw: dict[str, Any] = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    elif "is_causal" in params:
        kw["is_causal"] = True
    else:
        raise ValueError("sdpa_varlen: this torch's varlen_attn takes neither window_size nor "
                         "is_causal (no causal mode)")
    if H != H_kv:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            key = key.repeat_interleave(H // H_kv, dim=1)
            value = value.repeat_interleave(H // H_kv, dim=1)
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None:
        query = query * (scale * math.sqrt(query.shape[-1]))  # the kernel scales by 1/sqrt(D)
    cu, n = documents.cu_seqlens, documents.max_seqlen
    return fn(query, key, value, cu, cu, n, n, **kw)


# the probe's bound: bf16 attention of unit-scale inputs differs from SDPA's by ~1e-2 at most
_PROBE_TOL = 5e-2


@functools.lru_cache(maxsize=8)
def varlen_probe(device: torch.device) -> Optional[str]:
    """Run :func:`varlen_causal_attention` once on ``device`` (bf16, two documents of 5 and 3
    tokens, 4 query and 2 key/value heads, forward and backward) against SDPA per document; None
    when it agrees, else why not (the kernel raised, or outputs / gradients differ by more than
    ``_PROBE_TOL``). Cached per device: a few milliseconds, once per process.

    Why: ``sdpa_varlen`` packs every training micro-batch; a torch build
    whose ``varlen_attn`` fails on this GPU (or takes arguments differently) then turns packing
    off for the run with one warning (``engines/train/local.py``) instead of failing step 1.
    """
    try:
        kernel = _varlen_kernel(device)
        if kernel is None:
            return f"no varlen_attn kernel on {device.type}"
        g = torch.Generator(device=device).manual_seed(0)
        lens, H, H_kv, D = (5, 3), 4, 2, 64
        T = sum(lens)

        def leaf(h: int) -> Tensor:
            x = torch.randn(T, h, D, generator=g, device=device, dtype=torch.bfloat16)
            return x.requires_grad_()

        q, k, v = leaf(H), leaf(H_kv), leaf(H_kv)
        cu = torch.tensor([0, lens[0], T], dtype=torch.int32, device=device)
        out = varlen_causal_attention(kernel, q, k, v, Documents(cu, max(lens)))
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        ref_parts = []
        for a, b in ((0, lens[0]), (lens[0], T)):  # (1, H, t, D) per document
            qd, kd, vd = (x[a:b].float().transpose(0, 1)[None] for x in (q, k, v))
            ref_parts.append(torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        ref = torch.cat(ref_parts)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        gap = max([float((out.float() - ref).abs().max())]
                  + [float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6))
                     for a, b in zip(grads, ref_grads)])
        if not math.isfinite(gap) or gap > _PROBE_TOL:
            return f"varlen_attn disagrees with SDPA by {gap:.3g} (bound {_PROBE_TOL})"
    except Exception as e:  # noqa: BLE001 (any failure of the kernel means: do not pack with it)
        return f"varlen_attn failed: {type(e).__name__}: {e}".splitlines()[0][:300]
    return None


@dataclass(frozen=True)
class VarlenMask:
    """``sdpa_varlen``'s mask of a packed row: the kernel and the row's document boundaries. It
    reaches every layer as its ``attention_mask`` (so an activation-checkpoint recompute runs the
    kernel the forward ran)."""

    kernel: Callable[..., Any]
    documents: Documents


def sdpa_varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                     kv_offset: int = 0, mask_function: Any = None, attention_mask: Any = None,
                     device: "torch.device | str" = "cpu", **kwargs: Any) -> Any:
    """transformers' mask interface of ``sdpa_varlen``: a :class:`VarlenMask` inside a kernel
    :func:`packed_attention` (auto: on CUDA), ``sdpa_mask`` otherwise (arguments passed on).

    Raises:
        ValueError: a packed forward with no ``documents``, with a padding mask, or not one row
            without a KV cache; ``kernel=True`` off CUDA.
        RuntimeError: on CUDA, a torch without ``varlen_attn``.
    """
    from transformers import masking_utils as mu

    if mask_function is None:
        mask_function = mu.causal_mask_function
    state = _PACKED.get()
    wants = state is not None and state.kernel is not False
    fn = _varlen_kernel(torch.device(device)) if wants else None
    if state is None or not wants or (fn is None and state.kernel is None):
        # outside a packed forward, or its dense SDPA mask (asked for, or off CUDA)
        return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                            q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                            attention_mask=attention_mask, device=device, **kwargs)
    if fn is None:
        raise ValueError(f"sdpa_varlen: varlen_attn runs on CUDA only, not on {device}")
    if state.documents is None:
        raise ValueError("sdpa_varlen: a packed forward needs its document boundaries "
                         "(packed_attention(documents=...))")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("a packed forward takes no padding mask (one row, position ids per document)")
    if batch_size != 1 or q_length != kv_length or q_offset or kv_offset:
        raise ValueError(f"sdpa_varlen: a packed forward is one row without a KV cache, got "
                         f"{batch_size} rows, q_length {q_length}, kv_length {kv_length}")
    return VarlenMask(fn, state.documents)


def sdpa_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Any, scaling: Optional[float] = None,
                          dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface of ``sdpa_varlen``: query (1, H, T, D), key/value
    (1, H_kv, T, D) → (1, T, H, D). A :class:`VarlenMask` runs :func:`varlen_causal_attention`;
    any other mask runs transformers' SDPA function unchanged.

    Raises:
        ValueError: a packed forward with attention dropout, a soft-cap, sink tokens, a sliding
            window or a non-causal layer (what the flowrl packed path does not implement), or a
            float32 query on CUDA (FlashAttention takes bf16/fp16).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, VarlenMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if dropout > 0 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None \
            or kwargs.get("sliding_window") is not None or not getattr(module, "is_causal", True):
        raise ValueError("sdpa_varlen: a packed forward supports no attention dropout, soft-cap, "
                         "sink tokens, sliding window or non-causal layer (set "
                         "trainer.engine.padding_free=false)")
    if query.is_cuda and query.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"sdpa_varlen: varlen_attn takes bf16/fp16, got {query.dtype} (set "
                         "trainer.engine.mixed_precision=bf16, or padding_free=false)")
    out = varlen_causal_attention(attention_mask.kernel, query[0].transpose(0, 1),
                                  key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  attention_mask.documents, scale=scaling)
    return out.unsqueeze(0), None


_IMPLEMENTATIONS = {SDPA_FLEX: (sdpa_flex_attention, sdpa_flex_mask),
                    SDPA_VARLEN: (sdpa_varlen_attention, sdpa_varlen_mask)}


def register_attention(name: str) -> None:
    """Register ``name`` (``sdpa_flex`` or ``sdpa_varlen``) with transformers' attention and mask
    interfaces (idempotent); call before a model is built with ``attn_implementation=name``.

    Raises:
        ValueError: another name.
    """
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"register_attention: {name!r} is not one of {sorted(_IMPLEMENTATIONS)}")
    if name in _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attention, mask = _IMPLEMENTATIONS[name]
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    _registered.add(name)

