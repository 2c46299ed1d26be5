"""Single-process train engine (actor, critic-free ref). The FSDP2 engine follows the same interface."""
from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import get_scheduler

from flowrl.algorithms.balance import inverse_permutation, token_budget_partitions
from flowrl.algorithms.logprobs import entropy_from_logits, linear_logprobs, token_logprobs
from flowrl.algorithms.masks import position_ids_from_mask
from flowrl.algorithms.packing import pack, packable, unpack
from flowrl.engines.base import LogprobOutput, LossFn
from flowrl.engines.train.guard import guarded_step

log = logging.getLogger(__name__)

# transformers schedulers that need no total step count
_NO_TOTAL = ("constant", "constant_with_warmup", "reduce_lr_on_plateau", "inverse_sqrt")


@dataclass
class TrainEngineConfig:
    """Optimisation settings of :class:`LocalTrainEngine` (AdamW + a transformers scheduler).

    Attributes:
        lr, weight_decay, betas, eps: torch AdamW arguments (``betas`` a list for OmegaConf).
        max_grad_norm: global grad-norm clip; <= 0 disables clipping (the norm is still reported).
        micro_batch_size: sequences per forward/backward; a mini-batch is cut into these.
        lr_scheduler: any name ``transformers.get_scheduler`` takes ("constant", "cosine", ...).
        warmup_steps: scheduler warm-up steps (needs a scheduler with warm-up, not "constant").
        total_steps: optimizer steps of the run; required by decaying schedulers.
        gradient_checkpointing: recompute activations in backward (HF models only).
        disable_dropout: zero every dropout probability of a trainable model. The policy-gradient
            ratio compares two forwards of the same weights; dropout would make it != 1 at step 0.
        strategy: ``auto`` (FSDP2 when the world size is > 1, else local), ``local`` or ``fsdp``
            (:class:`flowrl.engines.train.fsdp.FSDPTrainEngine`, also at world size 1).
        max_tokens_per_micro_batch: dynamic micro-batching: cut a mini-batch into the fewest
            micro-batches of at most this many valid (prompt + response) tokens, balanced by
            Karmarkar–Karp (``algorithms/balance.py``); replaces ``micro_batch_size``. None = off.
        mixed_precision: FSDP only. ``auto`` = bf16 parameters with fp32 gradient reduction on
            CUDA, fp32 on CPU; ``bf16`` / ``fp32`` force it.
        weight_bucket_mb: FSDP only. ``named_weights`` gathers full tensors in buckets of about this
            many MiB, so the rollout hand-off never materialises the whole model at once.
        balance_across_ranks: before each forward stage (logprobs, values, updates) the pool's
            ranks swap rows so each holds as many rows with nearly equal tokens
            (``ops/rebalance.py``); outputs return to their rows' owners in order. No-op at
            world size 1.
        logprob_chunk_size: tokens per chunk of the fused LM head + fp32 log-softmax
            (``algorithms/logprobs.linear_logprobs``): logprobs and entropy of the valid response
            tokens come from the final hidden states without materialising (B, R, V) logits, in
            forward or backward; peak extra memory is a few (chunk, V) fp32 buffers. Used for
            transformers causal LMs whose LM head is a plain ``nn.Linear`` (checked once against
            the model's own logits: a softcapped or scaled head falls back); None = the plain
            path (full logits, then ``token_logprobs``).
        logprob_compile: run the chunked head's per-chunk softmax math through ``torch.compile``
            (fewer memory passes over the (chunk, V) logits; compiles on first use, tens of
            seconds). Off by default until ``benchmarks/logprobs.py`` (``chunked+compile``) shows
            it faster on the GPU.
        padding_free: pack each micro-batch's valid tokens into one row with per-sequence position
            ids and document-masked attention (``algorithms/packing.py``), so no padding token is
            computed. ``auto`` = on for transformers models on CUDA whose attention implementation
            handles packed rows without a dense mask (``flash_attention_*``, ``flex_attention``;
            under ``sdpa``/``eager`` transformers builds a dense (T, T) mask over the packed row
            and attention cost grows with the square of the micro-batch's tokens); ``true`` /
            ``false`` force it (``true`` needs a transformers model). A micro-batch whose rows are
            not one contiguous run of valid tokens runs padded.
        max_param_growth: the post-step guard (``engines/train/guard.py``): the run stops
            with a clear error when a step leaves non-finite parameters or multiplies the
            largest |parameter| by more than this (an AdamW step moves a weight by about lr);
            <= 0 keeps only the finiteness check.
    """

    # 1e-6: TRL's GRPO default and the low end of the 1e-6..3e-6 used for full fine-tuning of
    # 0.1-0.5B models with GRPO; short CPU recipes raise it in their conf/trainer file
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    total_steps: Optional[int] = None
    gradient_checkpointing: bool = False
    disable_dropout: bool = True
    strategy: str = "auto"
    max_tokens_per_micro_batch: Optional[int] = None
    mixed_precision: str = "auto"
    weight_bucket_mb: int = 512
    balance_across_ranks: bool = True
    logprob_chunk_size: Optional[int] = 1024
    logprob_compile: bool = False
    padding_free: str = "auto"
    max_param_growth: float = 10.0

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two values in [0, 1), got {list(self.betas)}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps > 0 and self.lr_scheduler == "constant":
            raise ValueError("warmup_steps > 0 is ignored by lr_scheduler='constant'; "
                             "use 'constant_with_warmup'")
        if self.lr_scheduler not in _NO_TOTAL and self.total_steps is None:
            raise ValueError(f"total_steps is required by lr_scheduler={self.lr_scheduler!r}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.strategy not in ("auto", "local", "fsdp"):
            raise ValueError(f"strategy must be auto, local or fsdp, got {self.strategy!r}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1 or None, "
                             f"got {self.max_tokens_per_micro_batch}")
        if self.mixed_precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"mixed_precision must be auto, bf16 or fp32, got {self.mixed_precision!r}")
        if self.weight_bucket_mb < 1:
            raise ValueError(f"weight_bucket_mb must be >= 1, got {self.weight_bucket_mb}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1 or None, got {self.logprob_chunk_size}")
        # YAML `true`/`false` reach a str field as "True"/"False" (OmegaConf) or as bools
        self.padding_free = str(self.padding_free).lower()
        if self.padding_free not in ("auto", "true", "false"):
            raise ValueError(f"padding_free must be auto, true or false, got {self.padding_free!r}")


def _read_floats(values: Mapping[str, Tensor | float]) -> dict[str, float]:
    """Floats of a dict of 0-dim tensors and floats, with one device → host copy per device."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for k, v in values.items():
        if isinstance(v, Tensor):
            by_device.setdefault(v.device, []).append(k)
    for keys in by_device.values():
        out.update(zip(keys, torch.stack([values[k].reshape(()) for k in keys]).tolist()))
    return out


def _module_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
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
        p.grad = torch.zeros_like(p)
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
    return {k: (v[idx.to(v.device)] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == B
                else v) for k, v in batch.items()}


_SEQ_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
# attention implementations that run a packed row without a dense (T, T) mask
_VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")


def _output_head(model: nn.Module) -> Optional[nn.Linear]:
    """The LM head of a transformers causal LM whose logits are ``head(final hidden state)``
    (checked at run time), or None: the fused chunked head then falls back to the plain path."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or model.base_model is model:
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return None
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None
    return head


def _resolve_padding_free(model: nn.Module, mode: str, device: torch.device) -> bool:
    """``TrainEngineConfig.padding_free`` for this model (see there).

    Raises:
        ValueError: ``true`` for a model that is not a transformers model (its attention would
            not see the sequence boundaries).
    """
    from transformers import PreTrainedModel

    is_hf = isinstance(model, PreTrainedModel)
    if mode == "true":
        if not is_hf:
            raise ValueError(f"padding_free=true needs a transformers model, got {type(model).__name__}")
        return True
    if mode == "false" or not is_hf:
        return False
    return device.type == "cuda" and model.config._attn_implementation in _VARLEN_ATTENTION


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
        self._head = _output_head(model) if self.cfg.logprob_chunk_size else None
        self._head_checked = False
        self._padding_free = _resolve_padding_free(model, self.cfg.padding_free, self.device)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scheduler = None
        if not trainable:
            model.requires_grad_(False)
            model.eval()
            return
        model.train()
        if self.cfg.disable_dropout:
            _disable_dropout(model)
        if self.cfg.gradient_checkpointing:
            if not hasattr(model, "gradient_checkpointing_enable"):
                raise ValueError("gradient_checkpointing=True needs a transformers model")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=self.cfg.lr,
            betas=tuple(self.cfg.betas), eps=self.cfg.eps, weight_decay=self.cfg.weight_decay)
        _init_optimizer_state(self.optimizer)  # before the scheduler: it reads the live lr
        self.scheduler = get_scheduler(self.cfg.lr_scheduler, self.optimizer,
                                       num_warmup_steps=self.cfg.warmup_steps,
                                       num_training_steps=self.cfg.total_steps)

    # ------------------------------------------------------------------ forward
    def _model_inputs(self, mb: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Tensor, bool]:
        """Model kwargs of a (trimmed) micro-batch, the flat index (into the rows x length
        positions) of the output predicting each valid response token (row-major), and whether
        the layout is packed (one row, ``TrainEngineConfig.padding_free``) or padded (b rows)."""
        p_ids, p_mask = mb["prompt_ids"].to(self.device), mb["prompt_mask"].bool().to(self.device)
        r_ids, r_mask = mb["response_ids"].to(self.device), mb["response_mask"].bool().to(self.device)
        if self._padding_free and packable(p_mask, r_mask):
            pk = pack(p_ids, p_mask, r_ids, r_mask)
            # no attention_mask: transformers then reads the packing from the position ids
            kwargs = dict(input_ids=pk.input_ids, position_ids=pk.position_ids)
            pred, packed = pk.predictor_index, True
        else:
            P, R = p_ids.shape[1], r_ids.shape[1]
            attn = torch.cat([p_mask, r_mask], dim=1)
            kwargs = dict(input_ids=torch.cat([p_ids, r_ids], dim=1), attention_mask=attn.long(),
                          position_ids=position_ids_from_mask(attn))
            cols = torch.arange(P - 1, P + R - 1, device=self.device)
            rows = torch.arange(r_ids.shape[0], device=self.device)[:, None] * (P + R)
            pred, packed = (rows + cols)[r_mask], False
        if self._use_cache:
            kwargs["use_cache"] = False
        return kwargs, pred, packed

    def _response_logits(self, mb: Mapping[str, Tensor]) -> tuple[Tensor, bool]:
        """Logits predicting the response tokens (model output at the previous position) and
        whether the layout is packed: padded, (b, R, V) for every response column; packed,
        (N, V) for the valid response tokens (row-major)."""
        kwargs, pred, packed = self._model_inputs(mb)
        if packed:
            if self._logits_to_keep:  # the LM head runs on the N predicting positions only
                return self.model(**kwargs, logits_to_keep=pred).logits[0], True
            return self.model(**kwargs).logits.flatten(0, 1)[pred], True
        P, R = mb["prompt_ids"].shape[1], mb["response_ids"].shape[1]
        if self._logits_to_keep:
            # positions P-1 .. P+R-1 (the last predicts past the end and is dropped): the LM head
            # runs on R+1 rows instead of P+R
            return self.model(**kwargs, logits_to_keep=R + 1).logits[:, :R], False
        return self.model(**kwargs).logits[:, P - 1:P + R - 1], False

    def _response_hidden(self, mb: Mapping[str, Tensor]) -> Optional[Tensor]:
        """(N, H) final hidden states (after the last norm) predicting the valid response tokens,
        from the model's own forward (so FSDP's hooks run); the LM head runs on one position per
        row only. None when that position's logits show the head is not a plain linear map (the
        caller then takes the plain path, from now on)."""
        kwargs, pred, _ = self._model_inputs(mb)
        last = kwargs["input_ids"].shape[1] - 1
        captured: list[Tensor] = []
        # the base model's output[0] is its last_hidden_state (a ModelOutput or a tuple)
        handle = self.model.base_model.register_forward_hook(lambda m, a, out: captured.append(out[0]))
        try:
            logits = self.model(**kwargs, logits_to_keep=torch.tensor([last], device=self.device)).logits
        finally:
            handle.remove()
        hidden = captured[-1]
        if not self._head_checked:
            with torch.no_grad():
                # the same matmul on the same rows: equal up to a few roundings of its dtype
                ref, mine = logits[:, -1].float(), self._head(hidden[:, last]).float()
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
        mb.update({k: mb[k].to(self.device) for k in _SEQ_KEYS})  # once; later .to() are no-ops
        mask, labels = mb["response_mask"].bool(), mb["response_ids"]
        pad = (0, R - mask.shape[1])  # trimmed response columns come back as 0
        # as a metric only, entropy needs no autograd graph (a (b, R, V) softmax saved for
        # backward otherwise)
        ent_grad = entropy_grad and torch.is_grad_enabled()
        hidden = self._response_hidden(mb) if self._head is not None else None
        if hidden is not None:
            lp, ent = linear_logprobs(hidden, self._head.weight, labels[mask], temperature,
                                      bias=self._head.bias, chunk_size=self.cfg.logprob_chunk_size,
                                      with_entropy=with_entropy, entropy_grad=ent_grad,
                                      compile=self.cfg.logprob_compile)
            lp = unpack(lp, mask)
            ent = unpack(ent, mask) if ent is not None else None
            return F.pad(lp, pad), (F.pad(ent, pad) if ent is not None else None)
        logits, packed = self._response_logits(mb)
        y = labels[mask] if packed else labels
        zero = torch.zeros((), device=logits.device)

        def to_rows(v: Tensor) -> Tensor:
            return F.pad(unpack(v, mask) if packed else torch.where(mask, v, zero), pad)

        lp = to_rows(token_logprobs(logits, y, temperature))
        ent = None
        if with_entropy:
            with torch.set_grad_enabled(ent_grad):
                ent = to_rows(entropy_from_logits(logits, temperature))
        return lp, ent

    # ------------------------------------------------------------------ micro-batching
    # Hooks a data-parallel subclass overrides; here (one process) they are identities.
    _lockstep = False  # True: every rank must run the same forwards/backwards (FSDP collectives)

    def _agree_num_micro(self, k: int) -> int:
        """The micro-batch count every rank uses (max over ranks); one process: ``k``."""
        return k

    def _all_true(self, flag: bool) -> bool:
        """``flag`` on every rank (logical and); one process: ``flag``."""
        return flag

    def _backward(self, loss: Tensor, last: bool) -> None:
        loss.backward()

    def _partitions(self, batch: Mapping[str, Tensor]) -> list[list[int]]:
        """Row indices of each micro-batch.

        ``max_tokens_per_micro_batch`` set: Karmarkar–Karp bins of valid prompt + response tokens
        (``algorithms/balance.token_budget_partitions``); else contiguous runs of
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
        lengths = (batch["prompt_mask"].bool().sum(-1) + batch["response_mask"].bool().sum(-1)).tolist()
        parts = token_budget_partitions(lengths, budget)
        k = self._agree_num_micro(len(parts))
        if k > len(parts):
            parts = token_budget_partitions(lengths, budget, min_parts=min(k, B))
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
        lps, ents = [], []
        try:
            with torch.no_grad():
                for rows in parts:
                    lp, ent = self._logprobs(self._micro_batch(batch, rows, B), temperature,
                                             with_entropy)
                    if rows:  # a dummy (empty) micro-batch's output is dropped
                        lps.append(lp)
                        ents.append(ent)
        finally:
            self.model.train(was_training)
        # balanced bins reorder rows: put them back in the batch's order
        inv = torch.tensor(inverse_permutation([i for rows in parts for i in rows]), dtype=torch.long)
        inv = inv.to(lps[0].device)
        return LogprobOutput(torch.cat(lps)[inv], torch.cat(ents)[inv] if with_entropy else None)

    # ------------------------------------------------------------------ update
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
            When a loss or the grad norm is not finite, no parameter, optimizer or scheduler state
            changes, grads are zeroed, a warning is logged and ``skipped`` is 1.

        Raises:
            RuntimeError: the engine is frozen (``trainable=False``).
        """
        if self.optimizer is None:
            raise RuntimeError("train_step on a frozen engine (trainable=False)")
        B = batch["response_ids"].shape[0]
        parts = self._partitions(batch)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.model.train()
        # loss terms and loss_fn metrics are summed as device tensors and read once at the end:
        # a .item() per micro-batch would stall the GPU stream each time
        sums: dict[str, Tensor | float] = {}
        losses: list[Tensor] = []
        for j, rows in enumerate(parts):
            mb = self._micro_batch(batch, rows, B)
            lp, ent = self._logprobs(mb, temperature, with_entropy, entropy_grad)
            loss, metrics = loss_fn(mb, lp, ent)
            # every backward runs, even after a NaN: lockstep ranks must match collectives, and
            # checking finiteness here would sync the stream per micro-batch; a non-finite loss
            # skips the whole step below (its grads are zeroed, never applied)
            self._backward(loss, last=j == len(parts) - 1)
            losses.append(loss.detach().float().reshape(()))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v.detach().float() if isinstance(v, Tensor) else v)
        loss_values = torch.stack(losses).tolist() if losses else []
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
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if not math.isfinite(grad_norm):
                finite = False
                log.warning("train_step: non-finite grad norm (%s); skipping the optimizer step, "
                            "weights unchanged", grad_norm)
        if finite:
            with guarded_step(self, self.cfg.max_param_growth):  # diverged weights stop the run
                self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = _read_floats(sums)
        total_loss = sum(loss_values)
        out.update(loss=total_loss if finite else float("nan"), grad_norm=grad_norm, lr=lr,
                   skipped=0.0 if finite else 1.0)
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
        return {"model": msd, "optimizer": osd, "scheduler": self.scheduler.state_dict()}

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
        self.scheduler.load_state_dict(state["scheduler"])
