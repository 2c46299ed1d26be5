"""The ``teacher`` role's model (on-policy distillation: ``graphs/distill.yaml``,
``graphs/grpo_distill.yaml``) and the check that it can score the student's tokens.

The teacher is any causal LM loadable like the policy (a local HF directory, a ``flowrl export``
of a checkpoint, the bundled SmolLM2 GGUF, or a tiny random model for tests), frozen and never
synced. It reads the student's token ids as they are, so both must share one tokenizer: a
different vocabulary is refused before any model loads (:func:`check_teacher`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.models.bundled import SMOLLM2, bundled_tokenizer_dir, smollm2_dir
from flowrl.models.loading import TOKENIZER_FILES, ModelConfig


@dataclass
class TeacherConfig(ModelConfig):
    """``teacher``: the model of the ``teacher`` role, every field as in :class:`ModelConfig`
    (``teacher.path=<HF dir or flowrl export>``, ``teacher.tiny={...}``, ``teacher.dtype``, ...;
    ``teacher=tiny``: the tiny random teacher of ``conf/teacher/tiny.yaml``) except that ``path``
    defaults to ``""`` = no teacher: a graph with a ``teacher`` stage then stops before any model
    loads, naming ``teacher.path`` (``runtime/control/preflight.py``). ``lora`` must stay unset (the
    teacher trains nothing).

    Raises:
        ValueError: as :class:`ModelConfig`, with ``model.`` read as ``teacher.``; a ``lora``.
    """

    path: str = ""

    @property
    def is_set(self) -> bool:
        """A teacher was given (a path or a tiny config)."""
        return bool(self.path) or self.tiny is not None

    def __post_init__(self) -> None:
        if self.lora is not None:
            raise ValueError("teacher.lora: the teacher is frozen and trains nothing; drop it")
        if not self.is_set:
            return
        if not self.path:  # a tiny teacher takes the bundled tokenizer, as a tiny policy does
            self.path = SMOLLM2
        try:
            super().__post_init__()
        except ValueError as e:
            raise ValueError(str(e).replace("model.", "teacher.")) from e

    def describe(self) -> str:
        """One line for the plan: what the teacher is."""
        if self.tiny is not None:
            return f"tiny random {self.tiny.get('model_type')} (seed {self.seed})"
        return "SmolLM2-135M-Instruct (GGUF)" if self.path == SMOLLM2 else self.path


def vocab_size(cfg: ModelConfig) -> tuple[int, str]:
    """(vocabulary size of the model's embedding, where it was read), without loading weights:
    a local HF directory's ``config.json`` (``vocab_size``, or its ``text_config``'s), a GGUF's
    ``<arch>.vocab_size`` (else its token-embedding shape), a tiny model's ``tiny.vocab_size`` or else the bundled tokenizer's
    size (what ``build_tiny`` gives it).

    Raises:
        ValueError: a ``config.json`` without ``vocab_size``. FileNotFoundError: no such file.
    """
    if cfg.tiny is not None:
        if "vocab_size" in cfg.tiny:
            return int(cfg.tiny["vocab_size"]), "tiny.vocab_size"
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(bundled_tokenizer_dir() / "tokenizer.json"))
        return tok.get_vocab_size(with_added_tokens=True), "the bundled SmolLM2 tokenizer"
    folder = smollm2_dir() if cfg.path == SMOLLM2 else Path(cfg.path)
    if cfg.gguf_file is not None:
        from flowrl.models.gguf_header import read_gguf_header
        from flowrl.models.size import gguf_vocab_size

        path = str(folder / cfg.gguf_file)
        return gguf_vocab_size(read_gguf_header(path), path), f"{cfg.gguf_file} (its header)"
    conf = json.loads((folder / "config.json").read_text())
    text = conf.get("text_config") or {}
    size = conf.get("vocab_size", text.get("vocab_size"))
    if size is None:
        raise ValueError(f"{folder / 'config.json'} has no vocab_size")
    return int(size), str(folder / "config.json")


def _tokenizer_source(cfg: ModelConfig) -> Path:
    """The folder whose tokenizer a model uses (``load_tokenizer``'s rule)."""
    return bundled_tokenizer_dir() if cfg.uses_bundled_tokenizer else Path(cfg.path)


def _vocab(folder: Path) -> dict[str, int]:
    """token → id of the tokenizer in ``folder`` (its ``tokenizer.json`` when there is one: the
    ``tokenizers`` library reads it in milliseconds; else transformers' AutoTokenizer)."""
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(with_added_tokens=True)
    from transformers import AutoTokenizer

    vocab: dict[str, int] = AutoTokenizer.from_pretrained(str(folder)).get_vocab()
    return vocab


def check_teacher(student: ModelConfig, teacher: TeacherConfig) -> None:
    """The teacher scores the student's sampled token ids as they are, so it must have the
    student's vocabulary: the same embedding size (``vocab_size`` of each ``config.json``, or
    what :func:`vocab_size` reads for a GGUF or tiny model) and, when the teacher folder brings a
    tokenizer of its own, the same token → id table. Reads configs and tokenizer files only.

    Raises:
        ValueError: one line naming ``teacher.path`` and the field that differs
            (``vocab_size``, or the first token whose id differs).
    """
    t_size, t_where = vocab_size(teacher)
    s_size, s_where = vocab_size(student)
    if t_size != s_size:
        raise ValueError(
            f"teacher.path: vocab_size {t_size} ({t_where}) differs from the student's "
            f"{s_size} ({s_where}): on-policy distillation scores the student's token ids under "
            "the teacher, so both must share one tokenizer and vocabulary")
    t_src, s_src = _tokenizer_source(teacher), _tokenizer_source(student)
    if t_src.resolve() == s_src.resolve() or \
            not any((t_src / f).is_file() for f in TOKENIZER_FILES):
        return  # one tokenizer, or a teacher folder without one of its own
    t_vocab, s_vocab = _vocab(t_src), _vocab(s_src)
    if t_vocab != s_vocab:
        diff = sorted(set(t_vocab.items()) ^ set(s_vocab.items()), key=lambda kv: (kv[1], kv[0]))
        tok, _ = diff[0]
        raise ValueError(
            f"teacher.path: the tokenizer of {t_src} differs from the student's ({s_src}): token "
            f"{tok!r} has id {t_vocab.get(tok)} there and {s_vocab.get(tok)} in the student's; "
            "on-policy distillation needs one tokenizer for both")


def teacher_summary(teacher: Any, sampler: str | None = None) -> str:
    """What ``flowrl plan`` says serves the teacher role (``sampler``: the rollout backend of
    the ``teacher_rollout`` role, the teacher as a generation engine)."""
    if not teacher.is_set:
        return ("no model yet: flowrl train needs teacher.path=<HF dir or flowrl export> "
                "(teacher=tiny: a tiny random one); the predictions size it as the policy")
    if sampler is not None:
        return (f"a {sampler} generation engine on its own frozen copy of {teacher.describe()} "
                "(samples the SFT targets; never synced)")
    return f"its own frozen copy of {teacher.describe()} (no optimizer, never synced)"


__all__ = ["TeacherConfig", "check_teacher", "teacher_summary", "vocab_size"]
