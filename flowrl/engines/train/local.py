"""Single-process train engine (actor, critic-free ref). The FSDP2 engine follows the same interface."""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from transformers import get_scheduler

from flowrl.algorithms.balance import (
    inverse_permutation,
    padded_budget_partitions,
    token_budget_partitions,
)
from flowrl.algorithms.logprobs import entropy_from_logits, linear_logprobs, token_logprobs
from flowrl.algorithms.masks import left_align, position_ids_from_mask, response_attention_mask
from flowrl.algorithms.packing import pack, packable, unpack
from flowrl.engines.base import LogprobOutput, LossFn
from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.guard import guarded_step
from flowrl.models.attention import (
    SDPA_FLEX,
    SDPA_VARLEN,
    Documents,
    checkpoint_kwargs,
    packed_attention,
    sdpa_without_cudnn,
    varlen_probe,
)

log = logging.getLogger(__name__)

# transformers schedulers that need no total step count
def _read_floats(values: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Floats of a dict of 0-dim tensors and floats, with one device → host copy per device."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for k, v in values.items():
        if isinstance(v, Tensor):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        tensors = [v.reshape(()) for k in keys if isinstance(v := values[k], Tensor)]
        out.update(zip(keys, torch.stack(tensors).tolist()))
    return out


def _module_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def _disable_dropout(model: nn.Module) -> None:
    """Zero dropout modules and the float ``*dropout*`` attributes attention layers read directly."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for name, v in list(vars(m).items()):
            if "dropout" in name and isinstance(v, float):
                setattr(m, name, 0.0)


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create Adam-family state now, as a first step would, but with ``step = 0``.

    ``get_state_dict`` fills an empty optimizer state by running a real zero-lr step, which leaves
    ``step = 1`` in the *live* optimizer and changes Adam's bias correction: a checkpoint taken before
    the first update would alter training. Eager state with step 0 is what a fresh optimizer uses.
    """
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    lrs = [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p.detach())
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for st in opt.state.values():
        if isinstance(st.get("step"), Tensor):
            st["step"].zero_()
        elif "step" in st:
            st["step"] = 0
    opt.zero_grad(set_to_none=True)


def _slice_batch(batch: Mapping[str, Any], start: int, end: int, B: int) -> dict[str, Any]:
    """Rows start:end of every tensor whose leading dim is the batch; other entries as they are."""
    return {k: (v[start:end] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == B else v)
            for k, v in batch.items()}


def _take_rows(batch: Mapping[str, Any], rows: list[int], B: int) -> dict[str, Any]:
    """``rows`` of every tensor whose leading dim is the batch (a contiguous run is a view)."""
    if rows and rows == list(range(rows[0], rows[-1] + 1)):
        return _slice_batch(batch, rows[0], rows[-1] + 1, B)
    idx = torch.tensor(rows, dtype=torch.long)
    on: dict[torch.device, Tensor] = {}  # the index on each device, copied once

    def index(device: torch.device) -> Tensor:
        if device not in on:  # pinned + non-blocking: a blocking H2D copy would sync the stream
            on[device] = idx if device.type == "cpu" else (
                idx.pin_memory().to(device, non_blocking=True) if device.type == "cuda"
                else idx.to(device))
        return on[device]

    return {k: (v[index(v.device)] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == B
                else v) for k, v in batch.items()}


_SEQ_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
_EXTRA_INPUT_KEYS = ("pixel_values", "image_grid_thw")


def _host_sequences(batch: Mapping[str, Any]) -> dict[str, Tensor]:
    """The token ids and masks of ``batch`` on the host: one device-to-host copy per call, so the
    micro-batch loop's index work (trimming, packing, picking valid labels) needs no per-micro-batch
    stream sync; the forward's inputs then go back through pinned, non-blocking copies."""
    host = {k: batch[k].cpu() for k in _SEQ_KEYS}
    # any other model input (a VLM's pixel_values / image_grid_thw) stays where it is
    host.update({k: v for k, v in batch.items() if k in _EXTRA_INPUT_KEYS})
    return host


# attention implementations that run a packed row without a dense (T, T) mask
# (sdpa_flex / sdpa_varlen: flowrl/models/attention.py, flex_attention / torch's varlen_attn for
# packed rows only)
_VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention",
                     SDPA_FLEX, SDPA_VARLEN)


def _output_head(model: nn.Module) -> Optional[tuple[nn.Module, nn.Linear]]:
    """(base model, LM head) of a transformers causal LM whose logits are
    ``head(base model's final hidden state)`` (checked at run time), or None: the fused chunked
    head then falls back to the plain path."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or model.base_model is model:
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return None
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None
    return model.base_model, head


def _resolve_padding_free(model: nn.Module, mode: str, device: torch.device) -> bool:
    """``TrainEngineConfig.padding_free`` for this model (see there).

    Raises:
        ValueError: ``true`` for a model that is not a transformers model (its attention would
            not see the sequence boundaries).
    """
    from transformers import PreTrainedModel

    if mode == "true":
        if not isinstance(model, PreTrainedModel):
            raise ValueError(f"padding_free=true needs a transformers model, got {type(model).__name__}")
        if device.type != "cuda" and model.config._attn_implementation in (SDPA_VARLEN, SDPA_FLEX):
            log.info("trainer.engine.padding_free=true on %s: packed micro-batches take SDPA's "
                     "dense block-diagonal mask (%s's kernel runs on CUDA only); same values",
                     device.type, model.config._attn_implementation)
        return True
    if mode == "false" or not isinstance(model, PreTrainedModel):
        return False
    attn = model.config._attn_implementation
    if device.type != "cuda" or attn not in _VARLEN_ATTENTION:
        return False
    if attn == SDPA_VARLEN:  # checked on this device once before it packs
        why = varlen_probe(device)
        if why is not None:
            log.warning("trainer.engine.padding_free=auto: packing off (%s); micro-batches run "
                        "padded under SDPA", why)
            return False
    return True


def _trim_padding(mb: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Drop prompt columns that are padding in every row (left) and response columns past the
    longest valid response (right), so a micro-batch of short sequences runs a short forward.
    Position ids come from the mask, so values are unchanged (up to float summation order)."""
    p_mask, r_mask = mb["prompt_mask"].bool(), mb["response_mask"].bool()
    P = p_mask.shape[1]
    p_keep = int(p_mask.any(0).nonzero().min()) if p_mask.any() else P - 1
    r_keep = int(r_mask.any(0).nonzero().max()) + 1 if r_mask.any() else 1
    out = dict(mb)
    for k in ("prompt_ids", "prompt_mask"):
        out[k] = mb[k][:, min(p_keep, P - 1):]
    for k in ("response_ids", "response_mask"):
        out[k] = mb[k][:, :r_keep]
    return out


class LocalTrainEngine:
    """:class:`flowrl.engines.base.TrainEngine` for one process.

    Args:
        model: causal LM called as ``model(input_ids=, attention_mask=, position_ids=[,
            logits_to_keep=, use_cache=False])`` returning an object with ``.logits`` (B, L, V).
            A transformers model may also be called packed (``TrainEngineConfig.padding_free``:
            one row, no ``attention_mask``) and read through its final hidden states
            (``logprob_chunk_size``).
        cfg: optimisation settings (ignored when frozen).
        trainable: False = frozen reference: no optimizer, ``requires_grad`` off, eval mode.

    Attributes:
        model: the module (share it with an :class:`HFRolloutEngine` for zero-copy colocation).
        last_timings: seconds of the last ``offload``/``onload`` (``offload_s``/``onload_s``).
    """

    def __init__(self, model: nn.Module, cfg: TrainEngineConfig | None = None,
                 trainable: bool = True) -> None:
        self.model = model
        self.cfg = cfg or TrainEngineConfig()
        self.trainable = trainable
        self.device = _module_device(model)
        self.last_timings: dict[str, float] = {}
        params = inspect.signature(model.forward).parameters
        self._logits_to_keep = "logits_to_keep" in params
        self._use_cache = "use_cache" in params  # passed False: a forward needs no KV cache
        self._head = _output_head(model) if self.cfg.logprob_chunk_size else None  # (base, head)
        self._head_checked = False
        self._padding_free = _resolve_padding_free(model, self.cfg.padding_free, self.device)
        self._budget_warned = False  # a row longer than max_tokens_per_micro_batch: said once
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None
        if not trainable:
            model.requires_grad_(False)
            model.eval()
            return
        model.train()
        if self.cfg.disable_dropout:
            _disable_dropout(model)
        if self.cfg.gradient_checkpointing:
            from transformers import PreTrainedModel

            if not isinstance(model, PreTrainedModel):
                raise ValueError("gradient_checkpointing=True needs a transformers model")
            # the recompute runs under the forward's attention state (packed row, SDPA kernels)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs())
        beta1, beta2 = self.cfg.betas
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=self.cfg.lr,
            betas=(beta1, beta2), eps=self.cfg.eps, weight_decay=self.cfg.weight_decay)
        _init_optimizer_state(self.optimizer)  # before the scheduler: it reads the live lr
        self.scheduler = get_scheduler(self.cfg.lr_scheduler, self.optimizer,
                                       num_warmup_steps=self.cfg.warmup_steps,
                                       num_training_steps=self.cfg.total_steps)

    # ------------------------------------------------------------------ forward
    def _model_inputs(self, mb: Mapping[str, Tensor]
                      ) -> tuple[dict[str, Any], Tensor, Optional[Documents]]:
        """Model kwargs of a (trimmed) micro-batch, the flat index (into the rows x length
        positions) of the output predicting each valid response token (row-major), and the
        document boundaries of a packed layout (one row, ``TrainEngineConfig.padding_free``;
        built on the host, copied without blocking) or None for a padded one (b rows)."""
        # the index work (packing, predictor positions) runs where the micro-batch is (the host,
        # as the stages hand it over): on the device its boolean indexing would sync the stream
        p_ids, p_mask = mb["prompt_ids"], mb["prompt_mask"].bool()
        r_ids, r_mask = mb["response_ids"], mb["response_mask"].bool()
        if "pixel_values" in mb:  # a vision-language model: images in the prompts
            return self._vision_inputs(mb, p_ids.to(self.device), p_mask.to(self.device),
                                       r_ids.to(self.device), r_mask.to(self.device))
        if self._padding_free and packable(p_mask, r_mask):
            pk = pack(p_ids, p_mask, r_ids, r_mask)
            # no attention_mask: transformers then reads the packing from the position ids
            kwargs: dict[str, Any] = dict(input_ids=pk.input_ids, position_ids=pk.position_ids)
            pred = pk.predictor_index
            docs: Optional[Documents] = Documents(self._to_device(pk.cu_seqlens), pk.max_seqlen)
        else:
            P, R = p_ids.shape[1], r_ids.shape[1]
            # environment tokens between policy turns (mask False) are context: attended
            attn = torch.cat([p_mask, response_attention_mask(r_mask)], dim=1)
            # the prompt's left padding moves to the row's end: a leading pad is a query that
            # attends to nothing, and cuDNN attention's backward gives it a NaN gradient when the
            # length is not a multiple of 128 (masks.left_align; issue 25, measured on the H200)
            shift = self._left_pad(p_mask)
            ids, attn = left_align(torch.cat([p_ids, r_ids], dim=1), attn, shift)
            kwargs = dict(input_ids=ids, attention_mask=attn.long(),
                          position_ids=position_ids_from_mask(attn))
            cols = torch.arange(P - 1, P + R - 1, device=r_mask.device)[None, :] - shift[:, None]
            rows = torch.arange(r_ids.shape[0], device=r_mask.device)[:, None] * (P + R)
            pred, docs = (rows + cols)[r_mask], None
        kwargs = {k: self._to_device(v) for k, v in kwargs.items()}
        if self._use_cache:
            kwargs["use_cache"] = False
        return kwargs, self._to_device(pred), docs

    def _to_device(self, t: Tensor) -> Tensor:
        """``t`` on the engine's device. A host tensor goes to a CUDA device through pinned memory
        without blocking: a pageable or blocking copy waits for the stream, i.e. for the previous
        micro-batch's backward, so the host could not queue the next forward ahead of the GPU."""
        if t.device == self.device:
            return t
        if t.device.type == "cpu" and self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _forward(self, kwargs: dict[str, Any], documents: Optional[Documents], **extra: Any) -> Any:
        """The model's forward; a packed row's (``documents`` given) under
        :func:`packed_attention`, so a ``sdpa_flex`` / ``sdpa_varlen`` model attends per document
        with flex_attention / varlen_attn (CUDA) instead of a dense mask; a padded one's under
        :meth:`_padded_attention` (autograd keeps the kernel chosen here for the backward)."""
        with packed_attention(documents=documents) if documents is not None \
                else self._padded_attention():
            return self.model(**kwargs, **extra)

    def _padded_attention(self) -> contextlib.AbstractContextManager[Any]:
        """SDPA's kernels allowed for a padded micro-batch: on CUDA without
        ``TrainEngineConfig.cudnn_attention``, the ones allowed now less cuDNN (a masked call then
        takes the memory-efficient kernel: no graph built per new shape); else no restriction."""
        return sdpa_without_cudnn(self.device, self.cfg.cudnn_attention)

    def _vision_inputs(self, mb: Mapping[str, Tensor], p_ids: Tensor, p_mask: Tensor,
                       r_ids: Tensor, r_mask: Tensor) -> tuple[dict[str, Any], Tensor, None]:
        """:meth:`_model_inputs` of a micro-batch with ``pixel_values`` (b, N, D) and
        ``image_grid_thw`` (b, K, 3) (``flowrl.data.images``): padded rows, the images flattened
        as the model takes them, and no ``position_ids``: a Qwen2-VL-family model derives its
        M-RoPE positions (text, and height/width inside each image) from the ids, the image
        grids and the attention mask, exactly as its ``generate`` did for the rollout."""
        from flowrl.data.images import vision_kwargs

        P, R = p_ids.shape[1], r_ids.shape[1]
        attn = torch.cat([p_mask, response_attention_mask(r_mask)], dim=1)
        kwargs: dict[str, Any] = dict(
            input_ids=torch.cat([p_ids, r_ids], dim=1), attention_mask=attn.long(),
            # image slots in the prompt only: a response never holds one (ops/vision.py)
            **vision_kwargs(self.model, mb["pixel_values"], mb["image_grid_thw"],
                            torch.cat([p_ids, torch.zeros_like(r_ids)], dim=1), self.device))
        if self._use_cache:
            kwargs["use_cache"] = False
        cols = torch.arange(P - 1, P + R - 1, device=self.device)
        rows = torch.arange(r_ids.shape[0], device=self.device)[:, None] * (P + R)
        return kwargs, (rows + cols)[r_mask], None

    def _response_logits(self, mb: Mapping[str, Tensor]) -> tuple[Tensor, bool]:
        """Logits predicting the response tokens (model output at the previous position) and
        whether the layout is packed: padded, (b, R, V) for every response column; packed,
        (N, V) for the valid response tokens (row-major)."""
        kwargs, pred, docs = self._model_inputs(mb)
        if docs is not None:
            if self._logits_to_keep:  # the LM head runs on the N predicting positions only
                return self._forward(kwargs, docs, logits_to_keep=pred).logits[0], True
            return self._forward(kwargs, docs).logits.flatten(0, 1)[pred], True
        P, R = mb["prompt_ids"].shape[1], mb["response_ids"].shape[1]
        # left-aligned rows (_model_inputs): row b's response predictors are at columns
        # P-1-s_b .. P+R-2-s_b, s_b its prompt padding; keep from the earliest of them (the LM
        # head runs on R + max_b s_b rows, not R: this is the fallback path, the fused
        # logprob_chunk_size path gathers the predicting rows before the head); the masks are
        # host tensors here (the stages hand them over there): no stream sync
        shift = self._left_pad(mb["prompt_mask"].bool())
        if "pixel_values" in mb:  # _vision_inputs keeps the left-padded layout (M-RoPE from it)
            shift = torch.zeros_like(shift)
        start = P - 1 - int(shift.max())
        if self._logits_to_keep:  # the LM head runs on the kept positions only
            logits = self._forward(kwargs, None, logits_to_keep=P + R - start).logits
        else:
            logits = self._forward(kwargs, None).logits[:, start:]
        idx = (torch.arange(R, device=logits.device)[None, :] + (P - 1 - start)
               - shift.to(logits.device)[:, None])
        return logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1])), False

    def _response_hidden(self, mb: Mapping[str, Tensor],
                         fused: tuple[nn.Module, nn.Linear]) -> Optional[Tensor]:
        """(N, H) final hidden states (after the last norm) predicting the valid response tokens,
        from the model's own forward (so FSDP's hooks run); the LM head runs on one position per
        row only. None when that position's logits show the head is not a plain linear map (the
        caller then takes the plain path, from now on)."""
        kwargs, pred, docs = self._model_inputs(mb)
        last = kwargs["input_ids"].shape[1] - 1
        captured: list[Tensor] = []
        # the base model's output[0] is its last_hidden_state (a ModelOutput or a tuple)
        base, head = fused
        handle = base.register_forward_hook(lambda m, a, out: captured.append(out[0]))
        try:
            logits = self._forward(kwargs, docs,
                                   logits_to_keep=self._to_device(torch.tensor([last]))).logits
        finally:
            handle.remove()
        hidden = captured[-1]
        if not self._head_checked:
            with torch.no_grad():
                # the same matmul on the same rows: equal up to a few roundings of its dtype
                ref, mine = logits[:, -1].float(), head(hidden[:, last]).float()
                tol = 4 * torch.finfo(logits.dtype).eps
                ok = torch.allclose(mine, ref, rtol=tol, atol=tol * float(ref.abs().max()))
            self._head_checked = True
            if not ok:
                log.warning("%s: logits are not lm_head(final hidden state) (softcapping or "
                            "scaling?); using the plain logprob path", type(self.model).__name__)
                self._head = None
                return None
        return hidden.flatten(0, 1)[pred]

    def _logprobs(self, mb: Mapping[str, Tensor], temperature: float,
                  with_entropy: bool, entropy_grad: bool = True) -> tuple[Tensor, Optional[Tensor]]:
        """(b, R) float32 logprobs (and entropy) of the response tokens at ``temperature``, 0 where
        the mask is False; differentiable when grad is enabled (entropy only if ``entropy_grad``)."""
        R = mb["response_ids"].shape[1]
        mb = _trim_padding(mb)
        # valid labels picked where the micro-batch is (host: no stream sync), then moved
        host_mask = mb["response_mask"].bool()
        valid_labels = self._to_device(mb["response_ids"][host_mask])
        mask, labels = self._to_device(host_mask), self._to_device(mb["response_ids"])
        pad = (0, R - mask.shape[1])  # trimmed response columns come back as 0
        # as a metric only, entropy needs no autograd graph (a (b, R, V) softmax saved for
        # backward otherwise)
        ent_grad = entropy_grad and torch.is_grad_enabled()
        fused, chunk = self._head, self.cfg.logprob_chunk_size
        hidden = self._response_hidden(mb, fused) if fused is not None else None
        if hidden is not None and fused is not None and chunk:
            head = fused[1]
            lp, ent = linear_logprobs(hidden, head.weight, valid_labels, temperature,
                                      bias=head.bias, chunk_size=chunk,
                                      with_entropy=with_entropy, entropy_grad=ent_grad,
                                      compile=self.cfg.logprob_compile)
            lp = unpack(lp, mask)
            ent = unpack(ent, mask) if ent is not None else None
            return F.pad(lp, pad), (F.pad(ent, pad) if ent is not None else None)
        logits, packed = self._response_logits(mb)
        y = valid_labels if packed else labels
        zero = torch.zeros((), device=logits.device)

        def to_rows(v: Tensor) -> Tensor:
            return F.pad(unpack(v, mask) if packed else torch.where(mask, v, zero), pad)

        lp = to_rows(token_logprobs(logits, y, temperature))
        ent = None
        if with_entropy:
            with torch.set_grad_enabled(ent_grad):
                ent = to_rows(entropy_from_logits(logits, temperature))
        return lp, ent

    @staticmethod
    def _left_pad(prompt_mask: Tensor) -> Tensor:
        """(b,) int64: the leading padding columns of each left-padded prompt row."""
        return prompt_mask.shape[1] - prompt_mask.bool().sum(-1)

    # ------------------------------------------------------------------ micro-batching
    # Hooks a data-parallel subclass overrides; here (one process) they are identities.
    lockstep = False  # True: every rank must run the same forwards/backwards (FSDP collectives)

    def _agree_num_micro(self, k: int) -> int:
        """The micro-batch count every rank uses (max over ranks); one process: ``k``."""
        return k

    def _all_true(self, flag: bool) -> bool:
        """``flag`` on every rank (logical and); one process: ``flag``."""
        return flag

    def _backward(self, loss: Tensor, last: bool) -> None:
        loss.backward()

    def _end_pass(self) -> None:
        """Called when every forward pass (``logprobs``, ``train_step``, a critic's ``values``)
        ends, even by an exception: the FSDP variant drops parameters it kept gathered."""

    def _partitions(self, batch: Mapping[str, Tensor]) -> list[list[int]]:
        """Row indices of each micro-batch.

        ``max_tokens_per_micro_batch`` set: packed (``padding_free``), Karmarkar–Karp bins of
        valid prompt + response tokens (``algorithms/balance.token_budget_partitions``); padded,
        bins of rows of similar length whose padded size (rows x (longest prompt + longest
        response)) fits the budget (``padded_budget_partitions``); else contiguous runs of
        ``micro_batch_size`` rows. The count is agreed across ranks; a rank with fewer rows than
        the agreed count gets empty lists (run as all-masked dummy micro-batches).
        """
        B = batch["response_ids"].shape[0]
        budget = self.cfg.max_tokens_per_micro_batch
        if budget is None:
            k_local = math.ceil(B / self.cfg.micro_batch_size)
            k = self._agree_num_micro(k_local)
            if k == k_local:
                step = self.cfg.micro_batch_size
                return [list(range(s, min(s + step, B))) for s in range(0, B, step)]
            return [c.tolist() for c in torch.arange(B).tensor_split(k)]
        p_lens = batch["prompt_mask"].bool().sum(-1).tolist()
        r_lens = response_attention_mask(batch["response_mask"]).sum(-1).tolist()
        longest = max((p + r for p, r in zip(p_lens, r_lens)), default=0)
        if longest > budget and not self._budget_warned:
            # correct (such a row is a micro-batch of its own), but a memory budget it overruns
            self._budget_warned = True
            log.warning("trainer.engine.max_tokens_per_micro_batch=%d is below the longest row "
                        "(%d tokens): each such row runs as a micro-batch of its own, over the "
                        "budget", budget, longest)
        if self._padding_free:  # packed: a micro-batch runs its valid tokens
            lengths = [p + r for p, r in zip(p_lens, r_lens)]

            def split(min_parts: int = 1) -> list[list[int]]:
                return token_budget_partitions(lengths, budget, min_parts=min_parts)
        else:  # padded: rows x (longest prompt + longest response) positions
            def split(min_parts: int = 1) -> list[list[int]]:
                return padded_budget_partitions(p_lens, r_lens, budget, min_parts=min_parts)
        parts = split()
        k = self._agree_num_micro(len(parts))
        if k > len(parts):
            parts = split(min(k, B))
        return parts + [[] for _ in range(k - len(parts))]

    @staticmethod
    def _micro_batch(batch: Mapping[str, Any], rows: list[int], B: int) -> dict[str, Any]:
        """Rows of one micro-batch; an empty one becomes row 0 with an all-False response mask
        (zero loss, zero gradient), so lockstep ranks still run the forward/backward."""
        if rows:
            return _take_rows(batch, rows, B)
        mb = _take_rows(batch, [0], B)
        mb["response_mask"] = torch.zeros_like(mb["response_mask"], dtype=torch.bool)
        return mb

    def logprobs(self, batch: Mapping[str, Tensor], temperature: float,
                 with_entropy: bool = False) -> LogprobOutput:
        """Log π(response token) at ``temperature`` (0 = greedy, scored at T=1), without grad.

        Args:
            batch: ``prompt_ids``/``prompt_mask`` (B, P) left-padded and ``response_ids``/
                ``response_mask`` (B, R) right-padded. Position ids come from the joint mask, so
                left padding does not shift absolute positions (case C09).
        Returns:
            :class:`LogprobOutput` with (B, R) float32 logprobs (and entropy), 0 where the mask is
            False, on the model's device. Computed in micro-batches of ``cfg.micro_batch_size``.
        """
        B = batch["response_ids"].shape[0]
        parts = self._partitions(batch)
        was_training = self.model.training
        self.model.eval()  # dropout off: old logprobs must be deterministic
        lps: list[Tensor] = []
        ents: list[Tensor] = []
        try:
            host = _host_sequences(batch)
            with torch.no_grad():
                for rows in parts:
                    lp, ent = self._logprobs(self._micro_batch(host, rows, B), temperature,
                                             with_entropy)
                    if rows:  # a dummy (empty) micro-batch's output is dropped
                        lps.append(lp)
                        if ent is not None:
                            ents.append(ent)
        finally:
            self.model.train(was_training)
            self._end_pass()
        # balanced bins reorder rows: put them back in the batch's order
        inv = torch.tensor(inverse_permutation([i for rows in parts for i in rows]), dtype=torch.long)
        inv = inv.to(lps[0].device)
        return LogprobOutput(torch.cat(lps)[inv], torch.cat(ents)[inv] if with_entropy else None)

    # ------------------------------------------------------------------ update
    def _optim(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """The optimizer and its scheduler (a trainable engine has both).

        Raises:
            RuntimeError: the engine is frozen (``trainable=False``).
        """
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError("train_step on a frozen engine (trainable=False)")
        return self.optimizer, self.scheduler

    def train_step(self, batch: Mapping[str, Tensor], loss_fn: LossFn, temperature: float,
                   with_entropy: bool = False, entropy_grad: bool = True) -> dict[str, float]:
        """One optimizer step over the mini-batch ``batch``.

        The batch is cut into micro-batches of ``cfg.micro_batch_size`` rows (every tensor whose
        leading dim is B is sliced); for each, ``loss_fn(micro_batch, logprobs (b, R), entropy)``
        gives a loss already normalised by global mini-batch denominators, so gradients are summed
        (never averaged). Then clip, AdamW step, scheduler step, zero grad.

        Returns:
            ``loss`` (sum of micro-batch losses), ``grad_norm`` (before clipping), ``lr`` (used for
            this step), ``skipped`` (0/1), plus loss_fn's metrics *summed* over micro-batches
            (they are globally normalised loss terms or token sums, so the sum is the
            mini-batch value however the batch was cut).
            ``perf/update/prepare_s``, ``fwd_bwd_s``, ``optimizer_s`` (wall seconds of the
            step's three parts) and ``perf/update/micro_batches``.
            When a loss or the grad norm is not finite, no parameter, optimizer or scheduler state
            changes, grads are zeroed, a warning is logged and ``skipped`` is 1.

        Raises:
            RuntimeError: the engine is frozen (``trainable=False``).
        """
        try:
            return self._train_step(batch, loss_fn, temperature, with_entropy, entropy_grad)
        finally:
            self._end_pass()

    def _train_step(self, batch: Mapping[str, Tensor], loss_fn: LossFn, temperature: float,
                    with_entropy: bool, entropy_grad: bool) -> dict[str, float]:
        optimizer, scheduler = self._optim()
        t0 = time.perf_counter()
        B = batch["response_ids"].shape[0]
        parts = self._partitions(batch)
        lr = float(optimizer.param_groups[0]["lr"])
        self.model.train()
        # loss terms and loss_fn metrics are summed as device tensors and read once at the end:
        # a .item() per micro-batch would stall the GPU stream each time
        sums: dict[str, Tensor | float] = {}
        losses: list[Tensor] = []
        host = _host_sequences(batch)
        t_loop = time.perf_counter()
        for j, rows in enumerate(parts):
            mb = self._micro_batch(batch, rows, B)
            lp, ent = self._logprobs(self._micro_batch(host, rows, B), temperature, with_entropy,
                                     entropy_grad)
            loss, metrics = loss_fn(mb, lp, ent)
            # every backward runs, even after a NaN: lockstep ranks must match collectives, and
            # checking finiteness here would sync the stream per micro-batch; a non-finite loss
            # skips the whole step below (its grads are zeroed, never applied)
            self._backward(loss, last=j == len(parts) - 1)
            losses.append(loss.detach().float().reshape(()))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v.detach().float() if isinstance(v, Tensor) else v)
        # the first read of the step: it waits for every queued forward/backward kernel, so
        # the loop's host time up to here is the micro-batches' GPU time too
        loss_values = torch.stack(losses).tolist() if losses else []
        t_optim = time.perf_counter()
        bad = [j for j, v in enumerate(loss_values) if not math.isfinite(v)]
        finite = not bad
        if bad:
            log.warning("train_step: non-finite loss (%s) in micro-batch %d; skipping the "
                        "optimizer step, weights unchanged", loss_values[bad[0]], bad[0])
        finite = self._all_true(finite)
        grad_norm = float("nan")
        if finite:
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
            norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.grad is not None], max_norm)
            # sharded (DTensor) grads: the norm already covers every shard; materialise it
            grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            if not math.isfinite(grad_norm):
                finite = False
                log.warning("train_step: non-finite grad norm (%s); skipping the optimizer step, "
                            "weights unchanged", grad_norm)
        if finite:
            with guarded_step(self, self.cfg.max_param_growth):  # diverged weights stop the run
                optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        out = _read_floats(sums)
        t_end = time.perf_counter()
        total_loss = sum(loss_values)
        out.update(loss=total_loss if finite else float("nan"), grad_norm=grad_norm, lr=lr,
                   skipped=0.0 if finite else 1.0)
        # where the step's wall time went (seconds; issue 24: the update's share of a GRPO step):
        # partitioning and the host copy of the token ids, every micro-batch's forward + backward
        # (through the loss readback, so the GPU's queue is drained), then grad clip + AdamW +
        # scheduler (grad_norm's readback and the metrics' one sync included)
        out.update({"perf/update/prepare_s": t_loop - t0, "perf/update/fwd_bwd_s": t_optim - t_loop,
                    "perf/update/optimizer_s": t_end - t_optim,
                    "perf/update/micro_batches": float(len(parts))})
        return out

    # ------------------------------------------------------------------ weights / memory / state
    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) of every parameter (tied ones once), detached, on the model device."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def _move(self, device: torch.device, *, weights: bool = True) -> None:
        if weights:
            self.model.to(device)  # moves .grad with the parameters
        else:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad = p.grad.to(device)
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                for k, v in st.items():
                    # Adam's scalar `step` lives on CPU unless capturable/fused; leave it there
                    if isinstance(v, Tensor) and not (k == "step" and v.dim() == 0):
                        st[k] = v.to(device)

    def close(self) -> None:
        """Nothing to release: the module and optimizer go with the engine (a process group is
        the job's, not the engine's)."""

    def offload(self, keep_weights: bool = False) -> None:
        """Move parameters, grads and optimizer state to CPU (CUDA only; on CPU a timed no-op).

        keep_weights: leave the parameters on the device (a colocated rollout engine that shares
        this module serves them next); only grads and optimizer state move.
        """
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            self._move(torch.device("cpu"), weights=not keep_weights)
            torch.cuda.empty_cache()
        self.last_timings = {"offload_s": time.perf_counter() - t0}

    def onload(self) -> None:
        """Inverse of :meth:`offload`."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            self._move(self.device)
        self.last_timings = {"onload_s": time.perf_counter() - t0}

    def state_dict(self) -> dict:
        """``{"model", "optimizer", "scheduler"}`` in ``torch.distributed.checkpoint`` form.

        Model/optimizer come from ``get_state_dict`` (FQN keys, works without a process group);
        the tensors are *live* references, so save (or deep-copy) before the next step. Frozen
        engines return only ``model``.
        """
        if self.optimizer is None:
            return {"model": self.model.state_dict()}
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optimizer": osd, "scheduler": self._optim()[1].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned: weights, AdamW moments/steps, scheduler position.

        Raises:
            KeyError: a trainable engine's state without ``optimizer``/``scheduler``.
        """
        if self.optimizer is None:
            self.model.load_state_dict(state["model"])
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self._optim()[1].load_state_dict(state["scheduler"])
