"""``sdpa_flex``: SDPA everywhere, document-masked ``flex_attention`` for packed micro-batches.

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
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

import torch

SDPA_FLEX = "sdpa_flex"

# "" outside a packed forward; inside: "flex", "dense" or "auto" (flex on CUDA, dense elsewhere)
_PACKED: contextvars.ContextVar[str] = contextvars.ContextVar("flowrl_packed_attention", default="")
_compiled: dict[str, Any] = {}
_registered = False


@contextlib.contextmanager
def packed_attention(flex: Optional[bool] = None) -> Iterator[None]:
    """Inside: the forward of a packed row. A ``sdpa_flex`` model then masks per document with a
    flex BlockMask when ``flex`` (None: on CUDA), else with SDPA's dense (T, T) block-diagonal
    mask (on CPU: torch's flex_attention has no CPU backward)."""
    token = _PACKED.set("auto" if flex is None else ("flex" if flex else "dense"))
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
    mode = _PACKED.get()
    if mode == "auto":
        mode = "flex" if torch.device(device).type == "cuda" else "dense"
    if mode != "flex":  # outside a packed forward, or its dense SDPA mask
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


def register_sdpa_flex() -> None:
    """Register ``sdpa_flex`` with transformers (idempotent); call before a model is built with
    ``attn_implementation="sdpa_flex"``."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SDPA_FLEX, sdpa_flex_attention)
    AttentionMaskInterface.register(SDPA_FLEX, sdpa_flex_mask)
    _registered = True
