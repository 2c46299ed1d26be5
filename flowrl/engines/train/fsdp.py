"""FSDP2 train engine: :class:`LocalTrainEngine` semantics with parameters sharded over ranks.

Sharding is ``torch.distributed.fsdp.fully_shard`` on every decoder layer and then on the root
(embeddings, final norm, LM head; tied weights stay one parameter). Everything the engine computes
is the single-process engine's code: this class only overrides the data-parallel hooks
(micro-batch count agreed across ranks, lockstep NaN handling, gradient sync on the last
micro-batch), weight gathering and memory moves.

Gradients are *summed* across ranks (divide factor 1): ops hand the engine a loss already
normalised by global (all-reduced) denominators, so a sum over ranks and micro-batches is exactly
the gradient of the whole global mini-batch (case C02 across ranks).

Padding: each micro-batch is trimmed to its longest valid prompt/response (left/right padding
columns that are padding in every row are dropped), and token-budget micro-batches group sequences
of similar total length. Padding-free packing and the chunked LM head are the local engine's
forward (``TrainEngineConfig.padding_free`` / ``logprob_chunk_size``), so they apply here too:
the forward is the model's own, so FSDP's hooks gather the root (embeddings, norm, LM head) as
usual, and the LM-head weight the chunked head reads is the gathered one.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional, Type, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from flowrl.engines.config import TrainEngineConfig
from flowrl.engines.train.local import LocalTrainEngine

if TYPE_CHECKING:  # the mixin always sits in front of a LocalTrainEngine (fsdp_variant)
    _EngineBase = LocalTrainEngine
else:
    _EngineBase = object

log = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a causal LM (``model.model.layers`` for Llama/Qwen2/Mistral,
    ``transformer.h`` for GPT-2), each of which becomes one FSDP unit; for a vision-language model
    (Qwen2-VL / Qwen2.5-VL in transformers 5: ``model.language_model.layers``) the language
    model's blocks and then the vision tower's (``model.visual.blocks``, frozen by default: a unit
    of its own keeps its all-frozen parameters out of the root unit's gradient reduction).

    Raises:
        ValueError: no known block container (name the model type so a rule can be added).
    """
    def blocks(path: str) -> list[nn.Module]:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return []
        return list(obj) if isinstance(obj, nn.ModuleList) else []

    if language := blocks("model.language_model.layers"):
        return language + blocks("model.visual.blocks")
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        if found := blocks(path):
            return found
    raise ValueError(f"FSDP: cannot find decoder layers of {type(model).__name__}; "
                     "expected model.layers, model.language_model.layers or transformer.h")


def mixed_precision(cfg: TrainEngineConfig, device: torch.device):
    """``MixedPrecisionPolicy``: bf16 compute with fp32 gradient reduction on CUDA (``auto`` or
    ``bf16``), plain fp32 otherwise (CPU gloo: fp32 keeps the world-size-1 == 2 test exact)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and device.type == "cuda")
    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def broadcast_module(model: nn.Module, src: int = 0, group: Any = None) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (before sharding), so a
    randomly initialised model is the same model on every rank.

    Args:
        src: rank *within* ``group`` (default: the world) that holds the reference copy.
        group: process group of the ranks that will shard the model (a partitioned train pool);
            collective over it only, so ranks outside it (the rollout pool) need not call this.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    src = dist.get_global_rank(group, src) if group is not None else src
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def pool_mesh(group: Any, device: torch.device | str) -> Any:
    """A 1-D ``DeviceMesh`` over an existing process group (e.g. a partitioned train pool's,
    created by every rank of the job in :func:`flowrl.runtime.control.partitioned.pool_context`);
    wrapping a group is local, no collective. ``None`` → ``None`` (FSDP then shards over the world)."""
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, torch.device(device).type)


class FSDPMixin(_EngineBase):
    """FSDP2 sharding for any :class:`LocalTrainEngine` subclass (``class X(FSDPMixin, Engine)``):
    actor/ref (:class:`FSDPTrainEngine`) and critic (``fsdp_variant(ValueTrainEngine)``).
    Needs an initialised process group.

    Args:
        model: causal LM with full (unsharded), identical weights on every rank, on the target
            device, in fp32 (master weights; bf16 compute comes from the mixed-precision policy).
        cfg: as :class:`LocalTrainEngine`; ``mixed_precision`` and ``weight_bucket_mb`` apply here.
        trainable: False = frozen reference (sharded too, no optimizer).
        mesh: ``DeviceMesh`` (or a ``ProcessGroup``, wrapped by :func:`pool_mesh`) of the ranks
            that shard this model, e.g. a partitioned placement's train pool. Every collective of
            the engine (sharding, micro-batch agreement, NaN lockstep, grad-norm, weight gathers)
            then runs on it; the ranks outside it never take part. None = the whole world.

    Attributes:
        last_timings: ``offload_s``/``onload_s`` of the last move; ``gather_s``/``gather_bytes`` of
            the last complete ``named_weights`` pass.

    Raises:
        RuntimeError: no process group. ValueError: no decoder layers found.
    """

    lockstep = True

    def __init__(self, model: nn.Module, cfg: TrainEngineConfig | None = None,
                 trainable: bool = True, *, mesh: Any = None) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("FSDPTrainEngine needs torch.distributed initialised "
                               "(run under torchrun; see flowrl/runtime/io/distributed.py)")
        cfg = cfg or TrainEngineConfig()
        device = next(model.parameters()).device
        mp = mixed_precision(cfg, device)
        if isinstance(mesh, dist.ProcessGroup):
            mesh = pool_mesh(mesh, device)
        self.mesh = mesh
        # the engine's own collectives run on the mesh's group (None: the default group)
        self.group = mesh.get_group() if mesh is not None else None
        self.world_size = dist.get_world_size(self.group)
        # the rollout engine computes in the trainer's compute dtype: gather in it (half the bytes)
        self.gather_dtype: Optional[torch.dtype] = mp.param_dtype
        # one rank: the "shard" is the whole parameter, so resharding after forward would only
        # drop the bf16 compute copy and cast it again in backward (per layer, per micro-batch)
        keep = cfg.reshard_after_forward
        self.reshard_after_forward = self.world_size > 1 if keep is None else keep
        if keep is None and trainable:
            log.info("resolved trainer.engine.reshard_after_forward=%s (%s)",
                     str(self.reshard_after_forward).lower(),
                     f"{self.world_size} ranks shard each layer" if self.world_size > 1 else
                     "one rank: each layer's compute copy is kept through a pass")
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=self.reshard_after_forward)
        # the root keeps fully_shard's default when resharding: it stays gathered after forward
        # (the LM head's weight is read again right after, by the chunked logprob head)
        if self.reshard_after_forward:
            self._root: FSDPModule = fully_shard(model, mesh=mesh, mp_policy=mp)
        else:
            self._root = fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        self._units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum, not mean: losses are globally normalised
                # plain SUM collectives (gloo has no PREMUL_SUM; with factor 1 nothing is scaled);
                # a version probe: the method exists from torch 2.9 (pyproject allows 2.6)
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)
        # the parent builds the optimizer over the (now sharded, DTensor) parameters
        super().__init__(model, cfg, trainable=trainable)

    # ------------------------------------------------------------------ data-parallel hooks
    def _agree_num_micro(self, k: int) -> int:
        t = torch.tensor([k], dtype=torch.int64, device=self._coll_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def _all_true(self, flag: bool) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self._coll_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def _backward(self, loss: Tensor, last: bool) -> None:
        # reduce-scatter gradients once, after the last micro-batch (no sync while accumulating)
        self._root.set_requires_gradient_sync(last)
        if not self.reshard_after_forward:
            # the gathered copies serve every micro-batch of the step: cast once per optimizer
            # step; the last backward drops them, before the optimizer changes the shards
            self._root.set_reshard_after_backward(last)
        loss.backward()

    def _end_pass(self) -> None:
        # a no-grad pass (logprobs, values) leaves gathered copies in place: every unit without
        # reshard after forward, and the root either way (FSDP keeps it gathered after forward
        # for the backward that would follow); they would hold device memory until the next
        # backward or offload. A no-op for units already resharded. (A unit whose own forward
        # raised stays in FSDP's forward state and keeps its copy: flowrl does not go on after
        # such an exception.)
        for unit in self._units:
            unit.reshard()

    def _coll_device(self) -> torch.device:
        return self.device if str(dist.get_backend(self.group)) == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ weights / memory
    def named_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, Tensor]]:
        """(FQN, full tensor) of every parameter, gathered from the shards bucket by bucket.

        Every rank must iterate to the end (each tensor is an all-gather). A bucket holds about
        ``cfg.weight_bucket_mb`` MiB; its tensors are gathered together, handed out, and dropped
        before the next bucket, so the full model never sits in memory twice. ``dtype`` casts the
        local shard before gathering (default :attr:`gather_dtype`: the mixed-precision compute
        dtype, bf16 on GPU, so a bf16 rollout engine receives half the bytes; None on CPU).
        Records ``gather_s`` / ``gather_bytes`` in :attr:`last_timings` when the pass completes.
        """
        dtype = dtype or self.gather_dtype
        limit = self.cfg.weight_bucket_mb * 2**20
        t0 = time.perf_counter()
        total = 0
        bucket: list[tuple[str, Tensor]] = []
        size = 0

        def flush() -> list[tuple[str, Tensor]]:
            out = []
            for name, p in bucket:
                local = p.detach()
                if dtype is not None:
                    local = local.to(dtype)
                out.append((name, local.full_tensor() if isinstance(local, DTensor) else local))
            return out

        for name, p in self.model.named_parameters():
            bucket.append((name, p))
            size += p.numel() * (dtype or p.dtype).itemsize
            if size >= limit:
                for item in flush():
                    total += item[1].numel() * item[1].element_size()
                    yield item
                bucket, size = [], 0
        for item in flush():
            total += item[1].numel() * item[1].element_size()
            yield item
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.last_timings = {"gather_s": time.perf_counter() - t0, "gather_bytes": float(total)}

    def offload(self, keep_weights: bool = False) -> None:
        """Move sharded parameters, gradients and optimizer state to CPU (CUDA only).

        ``keep_weights`` is ignored: under FSDP the rollout engine owns a full copy and never reads
        these shards, so nothing needs to stay on the device.
        """
        super().offload(keep_weights=False)

    def full_state_dict(self) -> dict[str, Tensor]:
        """Full (unsharded) model weights on CPU on every rank (for export; collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=True))
        return cast(dict[str, Tensor], full)  # full_state_dict=True: plain tensors, no shards


class FSDPTrainEngine(FSDPMixin, LocalTrainEngine):
    """The FSDP2 actor / reference engine (:class:`FSDPMixin` over :class:`LocalTrainEngine`)."""


_VARIANTS: dict[type, type] = {LocalTrainEngine: FSDPTrainEngine}


def fsdp_variant(engine_cls: Type[LocalTrainEngine]) -> type:
    """The FSDP2 version of a :class:`LocalTrainEngine` subclass (cached), e.g. the critic's."""
    if engine_cls not in _VARIANTS:
        _VARIANTS[engine_cls] = type(f"FSDP{engine_cls.__name__}", (FSDPMixin, engine_cls), {})
    return _VARIANTS[engine_cls]
