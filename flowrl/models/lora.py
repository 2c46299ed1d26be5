"""LoRA RL (``model.lora``): the actor trains ``peft`` adapters; the reference is the same weights
with the adapters disabled; the rollout engine gets the merged weights after every update.

LoRA: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3:
``h = W0 x + (alpha / r) · B A x`` with ``A`` (r, in) random, ``B`` (out, r) zero at the start, so
the initial policy is exactly the base model.

How the roles share one model (``build_lora_actor``, called by ``flowrl.train.build_engines``):

- actor: the HF model with LoRA layers injected in place by ``peft.get_peft_model`` (the engine
  holds the transformers model, not the ``PeftModel`` wrapper, so the chunked LM head, packing and
  ``logits_to_keep`` paths of the train engine still apply); the optimizer holds only the
  trainable tensors (adapters and ``modules_to_save``).
- ref: :class:`AdapterDisabledReference`, the actor engine's forward inside peft's
  ``disable_adapter()``: no second copy of the weights.
- rollout: the HF engine shares the actor's module on one process (it samples with the live
  adapters, nothing to sync); any other rollout engine (HF with its own copy under FSDP, vLLM)
  holds a plain base-model copy and receives ``W0 + (alpha / r) · B A`` of every adapted module
  (and the fully trained modules) under the base model's HF names after each update, with their
  bytes in ``perf/weight_sync_bytes``: an HF copy only the tensors that changed; vLLM the whole
  merged set (its in-place ``reload_weights`` re-processes whole layers and checks completeness),
  or, with ``rollout.vllm.lora_sync`` resolved to "adapter", only the adapters' A and B tensors
  (PEFT naming, :func:`adapter_weights`), which vLLM serves as a ``LoRARequest`` on base weights
  it never receives again (:class:`LoraAdapterSpec` tells the engine what to expect).
- checkpoints: only trainable tensors + optimizer + scheduler (the frozen base is the model
  config's); ``flowrl export`` merges them (or ``--adapter-only`` writes the PEFT directory).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from flowrl.models.size import ALL_LINEAR, hf_config


@dataclass
class LoraConfig:
    """``model.lora``: train LoRA adapters instead of every weight (null = full fine-tuning).

    Attributes:
        rank: r, the adapters' inner dimension (>= 1).
        alpha: scaling numerator: the update is ``(alpha / rank) · B A``.
        dropout: dropout on the adapters' input (peft ``lora_dropout``). The train engine zeroes
            every dropout while ``trainer.engine.disable_dropout`` is true (the default: the PPO
            ratio must be 1 at step 0), so this applies only with that switched off.
        target_modules: module names (the last dotted part, e.g. ``q_proj``, or ``c_attn`` for
            GPT-2) that get adapters; ``["all-linear"]`` = every linear layer but the LM head.
            Checked against the model's module names before any weights load.
        modules_to_save: modules trained in full next to the adapters (e.g. ``lm_head``); their
            full weights are saved in checkpoints and synced to the rollout engine.
        init_seed: seed of the adapters' random ``A`` init (same on every rank, global RNG
            untouched).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    modules_to_save: list[str] = field(default_factory=list)
    init_seed: int = 0

    def __post_init__(self) -> None:
        for name, kind in (("rank", int), ("alpha", float), ("dropout", float), ("init_seed", int)):
            value = getattr(self, name)  # a YAML/CLI value of the wrong type: named, not a '<' error
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (kind is int and not float(value).is_integer()):
                raise ValueError(f"model.lora.{name} takes {'an integer' if kind is int else 'a number'}"
                                 f", got {value!r}")
            setattr(self, name, kind(value))
        if self.rank < 1:
            raise ValueError(f"model.lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        self.target_modules = [str(t) for t in self.target_modules]
        self.modules_to_save = [str(t) for t in self.modules_to_save]
        if not self.target_modules:
            raise ValueError("model.lora.target_modules must name at least one module "
                             "(or be [all-linear])")

    def peft_config(self):
        """The ``peft.LoraConfig`` of this section (causal LM task)."""
        import peft

        targets = ALL_LINEAR if self.target_modules == [ALL_LINEAR] else list(self.target_modules)
        return peft.LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                               target_modules=targets,
                               modules_to_save=list(self.modules_to_save) or None,
                               task_type="CAUSAL_LM")


def as_lora_config(value: Any) -> Optional[LoraConfig]:
    """None, a LoraConfig or a mapping of its fields (``model.lora={rank: 8}``) → LoraConfig.

    Raises:
        ValueError: anything else, or an unknown field, naming ``model.lora``.
    """
    if value is None or isinstance(value, LoraConfig):
        return value
    from omegaconf import DictConfig, OmegaConf

    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        import dataclasses
        import difflib

        fields = [f.name for f in dataclasses.fields(LoraConfig)]
        for key in value:
            if key not in fields:  # a typo: the field it meant (was TypeError's own words)
                close = difflib.get_close_matches(str(key), fields, n=1)
                raise ValueError(f"model.lora.{key}: LoRA has no such field"
                                 + (f" (did you mean model.lora.{close[0]}?)" if close else "")
                                 + f"; its fields: {', '.join(fields)}")
        return LoraConfig(**value)
    raise ValueError(f"model.lora must be null or a section (rank, alpha, dropout, "
                     f"target_modules, modules_to_save), got {value!r}")


# ------------------------------------------------------------------ validation (no weights)
def module_names(model_cfg: Any) -> set[str]:
    """Dotted names of every module of the model (one layer is enough), from a ``meta``-device
    instance: no weights are read or allocated."""
    from flowrl.models.size import meta_model, text_config

    config = hf_config(model_cfg)
    text_config(config).num_hidden_layers = 1
    return {n for n, _ in meta_model(config).named_modules() if n}


def check_lora(cfg: Any, roles: set[str], single_pool: bool = True) -> None:
    """Reject a ``model.lora`` run that could not train as asked, before any model loads.

    Args:
        cfg: the run's ``TrainConfig``. roles: the plan's roles.
        single_pool: the placement keeps every role on every rank
            (``flowrl.compiler.modes.PlacementMode.single_pool``: colocated).

    Raises:
        ValueError: one line naming the field: a critic graph (the value head shares nothing with
            the adapters and would not train), a placement other than ``colocated``, or a
            ``target_modules`` / ``modules_to_save`` name the model does not have.
    """
    lora = cfg.model.lora
    if lora is None:
        return
    if "critic" in roles:
        raise ValueError("model.lora: the graph has a critic (PPO); a LoRA actor leaves the "
                         "critic's value head untrained; use a critic-free graph (grpo, rloo, ...)")
    if not single_pool:
        raise ValueError(f"model.lora: placement.mode={cfg.placement.mode} is not supported with "
                         "LoRA yet (colocated only)")
    names = module_names(cfg.model)
    leaves = {n.rsplit(".", 1)[-1] for n in names}
    for fld, wanted in (("target_modules", lora.target_modules),
                        ("modules_to_save", lora.modules_to_save)):
        for t in wanted:
            if fld == "target_modules" and t == ALL_LINEAR:
                continue
            if t not in leaves and t not in names:
                linear = sorted({n.rsplit(".", 1)[-1] for n in names
                                 if ".layers.0." in n or ".h.0." in n})
                raise ValueError(f"model.lora.{fld}: the model has no module {t!r} "
                                 f"(modules of a layer: {', '.join(linear)})")


# ------------------------------------------------------------------ building
def inject_lora(model: nn.Module, lora: LoraConfig):
    """Add adapters to ``model`` in place (``peft.get_peft_model``); returns the ``PeftModel``
    wrapper (``disable_adapter``, ``save_pretrained``). ``model`` itself stays the transformers
    model the engines run; only adapters and ``modules_to_save`` keep ``requires_grad``."""
    import peft

    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(lora.init_seed)
        return peft.get_peft_model(model, lora.peft_config())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Context: every peft adapter layer and ``modules_to_save`` wrapper of ``model`` forwards its
    base module, and nothing else changes.

    Not peft's ``PeftModel.disable_adapter()``: that also flips the adapters' ``requires_grad``
    off and back on. Under FSDP2 the first forward (lazy init) then sees the adapters frozen and
    never gives them the fp32 reduce dtype of ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``; the next backward fails with "attempting to assign a gradient with
    dtype BFloat16 to a tensor with grad_dtype Float" (the GPU tier's LoRA rows with
    ``kl_coef>0``, where the reference forward comes first). Only the flag that the layers'
    ``forward`` reads (peft's ``disable_adapters`` property) is set here.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper))]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


class LoraEngineMixin:
    """The LoRA actor engine over any train engine class (``lora_variant(cls)``): checkpoints hold
    the trainable tensors only, and ``named_weights`` serves merged weights to the rollout engine.

    Extra keyword args: ``peft_model`` (the wrapper of ``model``), ``sync`` (what
    ``named_weights`` hands the rollout engine): ``changed`` (default: the merged tensors the
    adapters change; an HF engine with its own copy), ``full`` (every tensor, merged: vLLM reloads
    whole layers), ``adapter`` (the adapters' own A and B tensors in PEFT naming: a vLLM engine
    with ``rollout.vllm.lora_sync=adapter``), ``shared`` (nothing: the rollout engine runs this
    very module).
    """

    # set by the train engine class behind this mixin in the MRO (``LocalTrainEngine.__init__``)
    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer]
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler]
    last_timings: dict[str, float]

    def __init__(self, model: nn.Module, cfg=None, trainable: bool = True, *,
                 peft_model: Any, sync: str = "changed", **kw: Any) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        self.peft_model = peft_model
        self.sync = sync
        # cooperative mixin: the next class in the MRO is the train engine ``lora_variant`` puts
        # behind it, which mypy cannot see (it checks this call against ``object.__init__``)
        super().__init__(model, cfg, trainable=trainable, **kw)  # type: ignore[call-arg]

    def _optimizer_state(self) -> tuple[torch.optim.Optimizer,
                                        torch.optim.lr_scheduler.LRScheduler]:
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError("a LoRA actor engine is trainable: it has no optimizer/scheduler "
                               "(built with trainable=False?)")
        return self.optimizer, self.scheduler

    def disable_adapter(self) -> contextlib.AbstractContextManager[None]:
        """Context: forwards of this engine run the base weights (see :func:`adapters_disabled`)."""
        return adapters_disabled(self.model)

    def named_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, Tensor]]:
        """(base HF name, full tensor) of every tensor the adapters change: ``W0 + (alpha/r) B A``
        of each adapted module, the full weights of ``modules_to_save`` (``sync="full"``: every
        other tensor too; ``"adapter"``: instead the adapters' A (r, in) and B (out, r) tensors
        under PEFT's file names, :func:`adapter_weights`; ``"shared"``: nothing, the rollout
        engine runs this module). Every rank iterates it to the end (FSDP: gathers). Records
        ``gather_bytes`` / ``gather_s`` in ``last_timings``."""
        t0, total = time.perf_counter(), 0
        dtype = dtype or getattr(self, "gather_dtype", None)
        if self.sync != "shared":
            named = adapter_weights(self.model) if self.sync == "adapter" else \
                merged_weights(self.model, full=self.sync == "full")
            for name, t in named:
                t = t if dtype is None else t.to(dtype)
                total += t.numel() * t.element_size()
                yield name, t
        self.last_timings = {"gather_s": time.perf_counter() - t0, "gather_bytes": float(total)}

    def state_dict(self) -> dict:
        """``{"model", "optimizer", "scheduler"}`` with ``model`` holding only the trainable
        tensors (adapters, ``modules_to_save``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        optimizer, scheduler = self._optimizer_state()
        msd, osd = get_state_dict(self.model, optimizer,
                                  options=StateDictOptions(ignore_frozen_params=True))
        return {"model": msd, "optimizer": osd, "scheduler": scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore adapters, optimizer and scheduler (the frozen base comes from the model config).

        Raises:
            RuntimeError: the checkpoint lacks a trainable tensor of this model."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        optimizer, scheduler = self._optimizer_state()
        want = {n for n, p in self.model.named_parameters() if p.requires_grad}
        missing = want - set(state["model"])
        if missing:
            raise RuntimeError(f"LoRA checkpoint lacks {sorted(missing)[:3]} ...")
        set_state_dict(self.model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"],
                       options=StateDictOptions(strict=False))
        scheduler.load_state_dict(state["scheduler"])


SYNC_MODES = ("changed", "full", "adapter", "shared")
_VARIANTS: dict[type, type] = {}


def lora_variant(engine_cls: type) -> type:
    """The LoRA version of a train engine class (cached): ``LoraEngineMixin`` in front."""
    if engine_cls not in _VARIANTS:
        _VARIANTS[engine_cls] = type(f"Lora{engine_cls.__name__}", (LoraEngineMixin, engine_cls), {})
    return _VARIANTS[engine_cls]


def _full(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t  # FSDP2 DTensor: all-gather


def _weight(m: nn.Module) -> Tensor:
    """``m.weight`` (full), typed: ``nn.Module.__getattr__`` may also answer a submodule."""
    w = m.weight
    if not isinstance(w, Tensor):
        raise TypeError(f"{type(m).__name__}.weight is a {type(w).__name__}, not a tensor")
    return _full(w)


@torch.no_grad()
def merged_weights(model: nn.Module, adapter: str = "default", *,
                   full: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(base model name, merged full tensor) of what the adapters change, without touching the
    module (an in-place merge and unmerge would round the frozen base weights):
    ``weight = W0 + scaling · B A`` (transposed for GPT-2's ``Conv1D``, ``fan_in_fan_out``) of every
    LoRA layer, the trained copy of every ``modules_to_save`` module. Names drop peft's
    ``base_layer.`` / ``modules_to_save.<adapter>.`` parts, so they are the base model's HF names.
    ``full``: also every unchanged parameter (tied ones once): the complete set an engine that
    reloads whole layers needs (vLLM's ``reload_weights``).
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    wrapped = [n for n, m in model.named_modules()
               if isinstance(m, (LoraLayer, ModulesToSaveWrapper))]
    if full:
        for name, p in model.named_parameters():
            if not any(name.startswith(w + ".") for w in wrapped):
                yield name, _full(p)
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and adapter in m.lora_A:
            base = m.get_base_layer()
            delta = _weight(m.lora_B[adapter]) @ _weight(m.lora_A[adapter])
            delta = delta * m.scaling[adapter]
            if getattr(m, "fan_in_fan_out", False):
                delta = delta.T
            w = _weight(base)
            yield f"{name}.weight", w + delta.to(w.dtype)
        elif isinstance(m, ModulesToSaveWrapper):
            for pname, p in m.modules_to_save[adapter].named_parameters():
                yield f"{name}.{pname}", _full(p)


@dataclass(frozen=True)
class LoraAdapterSpec:
    """A LoRA policy's adapters as the rollout engine receives them (``lora_sync="adapter"``):
    picklable, so an engine process of ``vllm_proc.py`` gets it with the export.

    Attributes:
        rank: r (``model.lora.rank``). alpha: ``model.lora.alpha`` (vLLM scales by alpha / r).
        target_modules: the module names (last dotted part) that got adapters, resolved
            (``all-linear`` expanded), sorted.
        modules_to_save: ``model.lora.modules_to_save`` (vLLM's adapter path cannot load them).
        tensor_names: every adapter tensor a sync must deliver, in PEFT's file naming
            (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``).
        adapter_config: the ``adapter_config.json`` content (``peft.LoraConfig.to_dict``).
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    modules_to_save: tuple[str, ...]
    tensor_names: frozenset
    adapter_config: dict


PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the module names


@torch.no_grad()
def adapter_weights(model: nn.Module, adapter: str = "default") -> Iterator[tuple[str, Tensor]]:
    """(PEFT file name, full tensor) of every adapter of ``model`` (the HF model peft injected
    into): ``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r),
    the names and layout ``PeftModel.save_pretrained`` writes to ``adapter_model.safetensors``
    (what vLLM's ``LoRARequest`` loads). FSDP2 shards are gathered."""
    from peft.tuners.lora import LoraLayer

    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and adapter in m.lora_A:
            yield f"{PEFT_PREFIX}{name}.lora_A.weight", _weight(m.lora_A[adapter])
            yield f"{PEFT_PREFIX}{name}.lora_B.weight", _weight(m.lora_B[adapter])


def adapter_spec(lora: LoraConfig, hf_config: Any):
    """The :class:`LoraAdapterSpec` of ``lora`` on a model of
    ``hf_config``: the adapters peft injects into a ``meta``-device instance (no weights
    allocated), their resolved target modules, tensor names and ``adapter_config.json``."""

    import peft
    from peft.tuners.lora import LoraLayer

    from flowrl.models.size import meta_model

    model = meta_model(copy.deepcopy(hf_config))
    peft_cfg = lora.peft_config()
    peft.inject_adapter_in_model(peft_cfg, model)
    layers = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    targets = tuple(sorted({n.rsplit(".", 1)[-1] for n in layers}))
    names = frozenset(f"{PEFT_PREFIX}{n}.lora_{ab}.weight" for n in layers for ab in "AB")
    # the resolved names, not "all-linear": a loader without peft's resolution reads the file
    config = dataclasses.replace(peft_cfg, target_modules=list(targets), lora_dropout=0.0).to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return LoraAdapterSpec(rank=lora.rank, alpha=float(lora.alpha), target_modules=targets,
                           modules_to_save=tuple(lora.modules_to_save), tensor_names=names,
                           adapter_config=config)


class AdapterDisabledReference:
    """The ``ref`` role of a LoRA run: the actor engine's logprobs with the adapters disabled
    (the frozen base model), so no second copy of the weights exists.

    Shares the actor's device and memory moves (a swap of ``ref`` moves the actor's state)."""

    trainable = False

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.model = actor.model
        self.cfg = actor.cfg  # micro-batching and balance_across_ranks: the actor's
        self.device = actor.device
        self.lockstep = actor.lockstep  # an FSDP actor's forwards are collectives
        self.last_timings: dict[str, float] = {}

    def logprobs(self, batch, temperature: float, with_entropy: bool = False):
        """:meth:`LocalTrainEngine.logprobs` of the base weights ((B, R) float32, no grad)."""
        with self.actor.disable_adapter():
            return self.actor.logprobs(batch, temperature, with_entropy=with_entropy)

    def offload(self, keep_weights: bool = False) -> None:
        self.actor.offload(keep_weights=keep_weights)
        self.last_timings = self.actor.last_timings

    def onload(self) -> None:
        self.actor.onload()
        self.last_timings = self.actor.last_timings

    def state_dict(self) -> dict:
        return {}

    def close(self) -> None:
        """Nothing of its own to release: the actor's engine holds the module."""


def build_lora_actor(engine_cls: type, model: nn.Module, lora: LoraConfig, engine_cfg: Any, *,
                     sync: str = "changed", **kw: Any):
    """The LoRA actor engine over ``engine_cls`` (local or FSDP) on ``model`` (adapters injected in
    place before any sharding, with the same init on every rank); ``sync``: see
    :class:`LoraEngineMixin`."""
    peft_model = inject_lora(model, lora)
    # said on the console: that LoRA is on, and what an update trains (only plan.txt said it)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logging.getLogger("flowrl").info(
        "start-up: LoRA rank %d (alpha %g) on %s%s: %s of %s parameters train (%.2f%%)",
        lora.rank, lora.alpha, ", ".join(lora.target_modules),
        f" + {', '.join(lora.modules_to_save)} in full" if lora.modules_to_save else "",
        f"{trained:,}", f"{total:,}", 100 * trained / max(total, 1))
    return lora_variant(engine_cls)(model, engine_cfg, trainable=True, peft_model=peft_model,
                                    sync=sync, **kw)
