"""Prompts: chat-template rendering, the over-length guard, left-padded collation, and the
stateful ``PromptSource`` that hands each rank its groups with explicit group ids.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from flowrl.data.gsm8k import DATASETS, SPLITS
from flowrl.data.sampler import PromptSampler

log = logging.getLogger(__name__)

DEFAULT_INSTRUCTION = ("Let's reason step by step, then write the final answer on its own line "
                       "as '#### <number>'.")


@dataclass
class DataConfig:
    """Which prompts to train on and how they are rendered.

    Attributes:
        name: dataset name, a key of ``flowrl.data.gsm8k.DATASETS`` (``"gsm8k"``).
        split: ``"train"`` or ``"test"``.
        limit: use only the first ``limit`` examples of the split (None = all).
        system_prompt: system message; None keeps the chat template's default (SmolLM2's
            template then inserts its own "You are a helpful AI assistant named SmolLM..." line).
        instruction: appended to the question on a new line ("" = question only).
        max_prompt_tokens: prompts longer than this are skipped and counted, never cut.
        shuffle: reshuffle prompts every epoch.
        seed: sampler seed (with the epoch it fixes the order).
    """

    name: str = "gsm8k"
    split: str = "train"
    limit: Optional[int] = None
    system_prompt: Optional[str] = None
    instruction: str = DEFAULT_INSTRUCTION
    max_prompt_tokens: int = 256
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"data.name must be one of {tuple(DATASETS)}, got {self.name!r}")
        if self.split not in SPLITS:
            raise ValueError(f"data.split must be 'train' or 'test', got {self.split!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"data.limit must be >= 1 or None, got {self.limit}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if not isinstance(self.instruction, str):
            raise ValueError(f"data.instruction must be a string, got {self.instruction!r}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"data.system_prompt must be a string or None, got {self.system_prompt!r}")


def build_messages(question: str, cfg: DataConfig) -> list[dict[str, str]]:
    """Chat messages of one question: optional system message, then the user turn
    ``question + "\\n" + instruction``."""
    content = f"{question}\n{cfg.instruction}" if cfg.instruction else question
    messages = [{"role": "user", "content": content}]
    if cfg.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return messages


def render_prompts(questions: Sequence[str], tokenizer: Any,
                   cfg: DataConfig) -> tuple[list[str], list[list[int]]]:
    """Apply the tokenizer's chat template (with the assistant generation prefix) and encode.

    Returns ``(texts, token_lists)``; tokens are encoded without extra special tokens, so they
    equal ``apply_chat_template(..., tokenize=True)``.
    """
    texts = [tokenizer.apply_chat_template(build_messages(q, cfg), tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    tokens = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return texts, [list(t) for t in tokens]


def collate_prompts(token_lists: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad prompts into a batch.

    The mask comes from the lengths, never from comparing ids with ``pad_id``: a prompt that
    contains the pad/eos id in its text keeps mask 1 there (case C04).

    Returns:
        prompt_ids: (B, P) int64, P = longest prompt, left-padded with ``pad_id``.
        prompt_mask: (B, P) bool, True on real tokens.

    Raises:
        ValueError: empty batch or an empty prompt.
    """
    if len(token_lists) == 0:
        raise ValueError("collate_prompts needs at least one prompt")
    lengths = [len(t) for t in token_lists]
    if min(lengths) == 0:
        raise ValueError(f"collate_prompts got an empty prompt at row {lengths.index(0)}")
    width = max(lengths)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(token_lists), width), dtype=torch.bool)
    for row, (toks, n) in enumerate(zip(token_lists, lengths)):
        ids[row, width - n:] = torch.as_tensor(list(toks), dtype=torch.int64)
        mask[row, width - n:] = True
    return ids, mask


@dataclass
class PromptBatch:
    """One rank's prompts for a step, tiled per prompt: rows ``[k*n, (k+1)*n)`` are the ``n``
    samples of prompt ``k``. B = num_prompts * n.

    Attributes:
        prompt_ids: (B, P) int64, left-padded. prompt_mask: (B, P) bool.
        group_id: (B,) int64, identity of the prompt instance (see ``PromptSource.sample``).
        prompt_index: (B,) int64, index of the record in the loaded split.
        ground_truth: B reference answers. prompt_text: B rendered prompts (chat template applied).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    group_id: Tensor
    prompt_index: Tensor
    ground_truth: list[str]
    prompt_text: list[str]

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def as_dict(self) -> dict[str, Any]:
        """The batch as a name -> value mapping (DESIGN.md data names)."""
        return dict(self.__dict__)


class PromptSource:
    """Dataset + tokenizer + sampler: the stateful prompt provider of one data-parallel rank.

    All prompts of the split are rendered and encoded once at construction; those longer than
    ``cfg.max_prompt_tokens`` are dropped and counted in ``num_skipped`` (logged as a warning).

    Raises:
        ValueError: every prompt is too long, or fewer usable prompts than ranks.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, rank: int = 0, world_size: int = 1):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.rank, self.world_size = rank, world_size
        self.records = DATASETS[cfg.name](cfg.split, cfg.limit)
        self._texts, self._tokens, self._kept, self.num_skipped = self._encode(self.records)
        if not self._kept:
            raise ValueError(f"all {len(self.records)} prompts exceed data.max_prompt_tokens="
                             f"{cfg.max_prompt_tokens}")
        self.sampler = PromptSampler(len(self._kept), seed=cfg.seed, shuffle=cfg.shuffle,
                                     rank=rank, world_size=world_size)
        self.step = 0  # sample() calls so far
        self.eval_skipped = 0  # over-long prompts of the last eval_batches slice
        self._group_offset = 0

    def _encode(self, records: list[dict[str, str]]):
        texts, tokens = render_prompts([r["question"] for r in records], self.tokenizer, self.cfg)
        kept = [i for i, t in enumerate(tokens) if len(t) <= self.cfg.max_prompt_tokens]
        skipped = len(records) - len(kept)
        if skipped:
            log.warning("skipped %d of %d %s/%s prompts longer than data.max_prompt_tokens=%d",
                        skipped, len(records), self.cfg.name, self.cfg.split,
                        self.cfg.max_prompt_tokens)
        return texts, tokens, kept, skipped

    def __len__(self) -> int:
        """Number of usable prompts (after the length guard)."""
        return len(self._kept)

    def _batch(self, indices: list[int], n: int, group_ids: list[int], records, texts,
               tokens) -> PromptBatch:
        rows = [i for i in indices for _ in range(n)]
        ids, mask = collate_prompts([tokens[i] for i in rows], self.tokenizer.pad_token_id)
        return PromptBatch(
            prompt_ids=ids, prompt_mask=mask,
            group_id=torch.tensor(group_ids, dtype=torch.int64).repeat_interleave(n),
            prompt_index=torch.tensor(rows, dtype=torch.int64),
            ground_truth=[records[i]["ground_truth"] for i in rows],
            prompt_text=[texts[i] for i in rows])

    def sample(self, num_prompts: int, n: int) -> PromptBatch:
        """Draw this rank's next ``num_prompts`` prompts, each repeated ``n`` times (tiled).

        Group ids are globally unique and increase from step to step:
        ``group_id = offset + rank * num_prompts + k`` for the ``k``-th prompt of this rank, where
        ``offset`` is the sum of ``num_prompts * world_size`` over earlier ``sample`` calls, i.e.
        ``step * num_prompts * world_size`` when ``num_prompts`` is constant. All ranks must call
        ``sample`` with the same ``num_prompts`` at a step (SPMD).

        Raises:
            ValueError: ``num_prompts < 1`` or ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        picks = [self._kept[j] for j in self.sampler.next_batch(num_prompts)]
        base = self._group_offset + self.rank * num_prompts
        batch = self._batch(picks, n, list(range(base, base + num_prompts)), self.records,
                            self._texts, self._tokens)
        self._group_offset += num_prompts * self.world_size
        self.step += 1
        return batch

    def eval_batches(self, limit: Optional[int], batch_size: int,
                     split: Optional[str] = None, shard: bool = True) -> Iterator[PromptBatch]:
        """Greedy-evaluation batches over a FIXED slice: the first ``limit`` records of ``split``
        (default: this source's split), in file order, never shuffled, one sample per prompt.

        Over-long prompts are skipped (count in ``eval_skipped``). With ``shard`` the slice is
        sharded by rank (``kept[rank::world_size]``, sizes may differ by one); ``shard=False``
        yields the whole slice (an evaluation that runs on one rank). ``group_id`` and
        ``prompt_index`` are the record's index in the split. Independent of the training state.

        Raises:
            ValueError: bad split, ``limit < 1`` or ``batch_size < 1``.
        """
        if batch_size < 1:
            raise ValueError(f"eval batch_size must be >= 1, got {batch_size}")
        split = self.cfg.split if split is None else split
        records = DATASETS[self.cfg.name](split, limit)
        texts, tokens, kept, self.eval_skipped = self._encode(records)
        mine = kept[self.rank::self.world_size] if shard else kept
        for start in range(0, len(mine), batch_size):
            chunk = mine[start:start + batch_size]
            yield self._batch(chunk, 1, chunk, records, texts, tokens)

    def state_dict(self) -> dict[str, Any]:
        """Sampler position, step counter and group-id offset (all a resume needs)."""
        return {"sampler": self.sampler.state_dict(), "step": self.step,
                "group_offset": self._group_offset, "num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``sample`` returns what an uninterrupted source would have.

        Raises:
            ValueError: the saved source skipped a different number of prompts (other
                tokenizer or max_prompt_tokens), or the sampler state does not match.
        """
        if state.get("num_skipped", self.num_skipped) != self.num_skipped:
            raise ValueError(f"prompt source state skipped {state['num_skipped']} prompts, this one "
                             f"skips {self.num_skipped}: data.max_prompt_tokens or tokenizer changed")
        self.sampler.load_state_dict(state["sampler"])
        self.step, self._group_offset = int(state["step"]), int(state["group_offset"])
