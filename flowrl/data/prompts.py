"""Prompts: chat-template rendering, the over-length guard, left-padded collation, and the
stateful ``PromptSource`` that hands each rank its groups with explicit group ids.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

from flowrl.data.arith import ArithConfig, load_arith
from flowrl.data.gsm8k import SPLITS, load_gsm8k
from flowrl.data.sampler import PromptSampler
from flowrl.data.visual import INSTRUCTION as VISUAL_INSTRUCTION
from flowrl.data.visual import VISUAL_COLUMNS, VisualConfig, load_visual

if TYPE_CHECKING:  # DataConfig is read by the run config, before torch loads
    from torch import Tensor

    from flowrl.data.images import ImageEncoder

log = logging.getLogger(__name__)

# group id -> record entries kept for reward functions (a few steps of any batch size)
_RECENT_GROUPS = 1 << 16
# records rendered at construction: the chat template tried before any model loads, and the
# ids of record 0 fingerprint the tokenizer for a resume (~10 ms)
_PROBE = 64

DEFAULT_INSTRUCTION = ("Let's reason step by step, then write the final answer on its own line "
                       "as '#### <number>'.")
# arith's: the same answer line (the gsm8k verifier reads it); see flowrl/data/arith.py
ARITH_INSTRUCTION = "Write the final answer on its own line as '#### <number>'."


@dataclass
class DataConfig:
    """Which prompts to train (and evaluate) on and how they are rendered.

    Attributes:
        name: bundled dataset, a key of :data:`DATASETS`: ``"gsm8k"`` (GSM8K, bundled) or
            ``"arith"`` (generated integer arithmetic, difficulty in ``arith``), ``"visual"`` (generated
            images, "how many red shapes?", ``flowrl.data.visual``; needs a vision-language model
            and ``graph=grpo_vl``); used when
            ``path`` is null. On the command line ``data=<name>`` (``conf/train.yaml`` picks
            ``arith``).
        arith: the ``arith`` task's difficulty and split sizes (``flowrl.data.arith``).
        visual: the ``visual`` task's image size, shapes and split sizes.
        image_column: ``path``'s column of each prompt's image(s) (a path relative to the data
            file's folder, image bytes, a ``datasets`` ``Image`` value, or a list of them;
            ``flowrl.data.images``); every image is opened and checked before any model loads.
            null = text prompts. The images go into the user turn before its text, rendered by
            the model's chat template and image processor.
        path: your own prompts instead: a local ``.jsonl`` / ``.json`` (array of objects) /
            ``.parquet`` / ``.csv`` file, or a directory ``datasets`` can load (``save_to_disk``
            output, or data files named by split: ``train.jsonl``, ``test.jsonl``).
            Relative paths start in the working directory. See ``flowrl.data.files``.
        eval_path: the prompts of ``trainer.eval`` (same forms as ``path``); null = ``path``
            (its ``trainer.eval.split``), or the bundled dataset's. A single ``path`` file has no
            held-out split: set ``eval_path`` (to ``path`` itself to evaluate on the training
            prompts) or ``trainer.eval.limit=0``.
        split: training split: ``"train"`` or ``"test"`` of the bundled dataset, a split name
            of a ``path`` directory; a file is one split (its rows, whatever this says).
        prompt_key: ``path``'s column holding the prompt: a string (the user turn, followed by
            ``instruction``, after ``system_prompt``) or a list of chat messages
            ``[{"role", "content"}, ...]`` rendered as they are.
        ground_truth_key: column of the reference answer (string or number) the graph's reward
            verifier compares with; null = none (e.g. a reward model scores the answers).
        extra_keys: more columns handed to reward functions in their ``fields`` argument
            (``flowrl.rewards.function``); for the bundled GSM8K: ``answer`` (the worked solution).
        limit: use only the first ``limit`` examples of the split (None = all).
        system_prompt: system message; None keeps the chat template's default (SmolLM2's
            template then inserts its own "You are a helpful AI assistant named SmolLM..." line).
        instruction: appended to a string prompt on a new line ("" = the prompt only); null =
            the dataset's own (:data:`INSTRUCTIONS`: both bundled ones ask for the
            ``#### <number>`` answer line), a ``path`` has none.
        response_prefix: text every response starts with, pre-filled after the chat
            template's assistant header before sampling (e.g. ``"<think>\n"``: the policy
            continues an opened reasoning block). It belongs to the prompt: ``prompt_ids`` end
            with its tokens (encoded on their own, so every prompt ends with the same ids), it
            counts towards ``max_prompt_tokens``, and no response token, ``response_mask`` or
            loss ever covers it. Rule rewards, reward functions and the evaluation score
            ``prefix + response`` (the answer as it reads), so a format reward such as
            ``format_think`` sees the ``<think>`` it opened. A template whose generation prompt
            already ends with it (a thinking template that opens ``<think>`` itself) gets
            nothing appended; the rewards still see it. ``""`` = none.
        max_prompt_tokens: prompts longer than this are skipped and counted, never cut: in
            training when drawn (the next draw takes the place; ``data/skipped_prompts``), in an
            evaluation's slice up front (``PromptSource``).
        shuffle: reshuffle prompts every epoch.
        seed: sampler seed (with the epoch it fixes the order).
        tools: JSON schemas of the tools every prompt offers, rendered by the chat template
            (``flowrl.data.chat.apply_chat_template_with_tools``). Filled in by the run from the
            graph's ``rollout.multi_turn`` stage (its ``params.tools``); leave it empty.
    """

    name: str = "gsm8k"
    arith: ArithConfig = field(default_factory=ArithConfig)
    visual: VisualConfig = field(default_factory=VisualConfig)
    image_column: Optional[str] = None
    path: Optional[str] = None
    eval_path: Optional[str] = None
    split: str = "train"
    prompt_key: str = "prompt"
    ground_truth_key: Optional[str] = "ground_truth"
    extra_keys: list[str] = field(default_factory=list)
    limit: Optional[int] = None
    system_prompt: Optional[str] = None
    instruction: Optional[str] = None
    response_prefix: str = ""
    max_prompt_tokens: int = 256
    shuffle: bool = True
    seed: int = 0
    tools: list = field(default_factory=list)

    def __post_init__(self) -> None:
        from flowrl.data.files import check_path

        self.extra_keys = [str(k) for k in self.extra_keys]
        if self.path is None:
            if self.name not in DATASETS:
                raise ValueError(f"data.name must be one of {tuple(DATASETS)}, got {self.name!r}")
            if self.split not in SPLITS:
                raise ValueError(f"data.split must be 'train' or 'test', got {self.split!r}")
            columns = DATASET_COLUMNS.get(self.name, BUNDLED_COLUMNS)
            unknown = sorted(set(self.extra_keys) - set(columns))
            if unknown:
                raise ValueError(f"data.extra_keys: the bundled {self.name} has no column(s) "
                                 f"{unknown}; it has {list(columns)}")
            if self.image_column is not None:
                raise ValueError("data.image_column names a column of data.path; the bundled "
                                 f"{self.name} has none (data=visual brings its own images)")
        else:
            check_path(self.path, "data.path")
        if self.eval_path is not None:
            check_path(self.eval_path, "data.eval_path")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"data.limit must be >= 1 or None, got {self.limit}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.instruction is None:  # the dataset's own: one home for the GSM8K line
            self.instruction = INSTRUCTIONS.get(self.name, "") if self.path is None else ""
        if not isinstance(self.instruction, str):
            raise ValueError(f"data.instruction must be a string, got {self.instruction!r}")
        if not isinstance(self.response_prefix, str):
            raise ValueError(f"data.response_prefix must be a string (e.g. '<think>\\n'), got "
                             f"{self.response_prefix!r}")
        # a command line cannot easily carry a newline: `\n` / `\t` written there mean one
        self.response_prefix = self.response_prefix.replace("\\n", "\n").replace("\\t", "\t")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"data.system_prompt must be a string or None, got {self.system_prompt!r}")

    @property
    def has_images(self) -> bool:
        """True when the prompts carry images: ``image_column`` set, or the bundled ``visual``."""
        return self.image_column is not None or (self.path is None and self.name == "visual")

    @property
    def source_name(self) -> str:
        """The training prompts in messages: the bundled name and split, or the path."""
        return f"{self.name}/{self.split}" if self.path is None else str(self.path)


# columns of the bundled datasets' records (flowrl.data.gsm8k, flowrl.data.arith)
BUNDLED_COLUMNS = ("question", "answer", "ground_truth")

# bundled dataset name (data.name, data=<name>) -> loader(split, limit, data config) -> records
# with its columns (and "images" for a visual task); each is scored by the graphs' `#### n` verifier
DATASETS: dict[str, Callable[[str, Optional[int], DataConfig], list[dict[str, Any]]]] = {
    "gsm8k": lambda split, limit, cfg: load_gsm8k(split, limit),
    "arith": lambda split, limit, cfg: load_arith(split, limit, cfg.arith),
    "visual": lambda split, limit, cfg: load_visual(split, limit, cfg.visual),
}
DATASET_COLUMNS = {"gsm8k": BUNDLED_COLUMNS, "arith": BUNDLED_COLUMNS, "visual": VISUAL_COLUMNS}
INSTRUCTIONS = {"gsm8k": DEFAULT_INSTRUCTION, "arith": ARITH_INSTRUCTION,
                "visual": VISUAL_INSTRUCTION}


def _bundled_records(cfg: DataConfig, split: str, limit: Optional[int]) -> tuple[dict, ...]:
    out = []
    for r in DATASETS[cfg.name](split, limit, cfg):
        rec = {"prompt": r["question"], "question": r["question"],
               "ground_truth": r["ground_truth"], "fields": {k: r[k] for k in cfg.extra_keys}}
        if "images" in r:
            rec["images"] = r["images"]
        out.append(rec)
    return tuple(out)


def load_records(cfg: DataConfig, split: Optional[str] = None, limit: Optional[int] = None, *,
                 for_eval: bool = False) -> tuple[dict, ...]:
    """The records (``flowrl.data.files``) of the training source (``for_eval=False``: ``path``
    or the bundled ``name``) or of the evaluation source (``eval_path``, else the training one),
    split ``split`` (default ``cfg.split``), the first ``limit`` (None = all).

    Raises:
        DataError (a ValueError): a bad file, column or row, in one line naming it; a single
            ``path`` file asked for evaluation prompts with no ``eval_path``.
        ValueError: a bundled split that does not exist.
    """
    from flowrl.data.files import DataError, is_single_file, load_file_records

    split = cfg.split if split is None else split
    path = (cfg.eval_path or cfg.path) if for_eval else cfg.path
    if path is None:
        if split not in SPLITS:
            raise ValueError(f"{'trainer.eval' if for_eval else 'data'}.split must be 'train' or "
                             f"'test' for the bundled {cfg.name}, got {split!r}")
        return _bundled_records(cfg, split, limit)
    if for_eval and cfg.eval_path is None and is_single_file(path):
        raise DataError(f"trainer.eval: data.path {path} is a single file, so it has no held-out "
                        f"split to evaluate on: set data.eval_path=FILE (data.eval_path={path} "
                        "evaluates on the training prompts) or trainer.eval.limit=0")
    records, _ = load_file_records(path, split, prompt_key=cfg.prompt_key,
                                   ground_truth_key=cfg.ground_truth_key,
                                   extra_keys=tuple(cfg.extra_keys),
                                   split_field="trainer.eval.split" if for_eval else "data.split",
                                   image_key=cfg.image_column)
    return records if limit is None else records[:limit]


def longest_prompt_tokens(cfg: DataConfig, tokenizer: Any, limit: int = 256) -> tuple[Optional[int], int]:
    """(P, rows read): the longest of the first ``limit`` training prompts as ``tokenizer``
    renders them (:func:`render_prompts`), among those within ``cfg.max_prompt_tokens`` (longer
    ones are skipped in training). A step's batch is left-padded to its longest prompt
    (:func:`collate_prompts`), so this is the prompt length a step pays for, where
    ``max_prompt_tokens`` is only the skip limit (arith with SmolLM2's template: 56 vs 256).
    P is None for image prompts (their length is the processor's) or when every prompt is longer.

    Raises:
        DataError / ValueError: as :func:`load_records`.
    """
    records = load_records(cfg, limit=limit)
    if not records or any("images" in r for r in records):
        return None, len(records)
    _, tokens = render_prompts([r["prompt"] for r in records], tokenizer, cfg)
    fits = [len(t) for t in tokens if len(t) <= cfg.max_prompt_tokens]
    return (max(fits) if fits else None), len(records)


def record_messages(record: dict, cfg: DataConfig) -> list[dict[str, str]]:
    """Chat messages of a record: its own when its prompt is a list, else :func:`build_messages`."""
    prompt = record["prompt"]
    return [dict(m) for m in prompt] if isinstance(prompt, list) else build_messages(prompt, cfg)


def build_messages(question: str, cfg: DataConfig) -> list[dict[str, str]]:
    """Chat messages of one question: optional system message, then the user turn
    ``question + "\\n" + instruction``."""
    content = f"{question}\n{cfg.instruction}" if cfg.instruction else question
    messages = [{"role": "user", "content": content}]
    if cfg.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return messages


def render_prompts(prompts: Sequence[str | list[dict[str, str]]], tokenizer: Any,
                   cfg: DataConfig) -> tuple[list[str], list[list[int]]]:
    """Apply the tokenizer's chat template (with the assistant generation prefix) and encode,
    then append ``cfg.response_prefix`` (unless the rendered text already ends with it).

    Each prompt is a question (rendered by :func:`build_messages`) or a list of chat messages
    (rendered as they are); ``cfg.tools`` (schemas) are offered through the template.

    Returns ``(texts, token_lists)``; tokens are encoded without extra special tokens, so
    without a prefix they equal ``apply_chat_template(..., tokenize=True)``; an appended prefix
    is encoded on its own and its ids end every token list (the same ids in every prompt).
    """
    if cfg.tools:  # tools offered in the prompt (a multi-turn graph)
        from flowrl.data.chat import apply_chat_template_with_tools

        texts = [apply_chat_template_with_tools(tokenizer, record_messages({"prompt": q}, cfg),
                                                list(cfg.tools)) for q in prompts]
    else:
        texts = [tokenizer.apply_chat_template(record_messages({"prompt": q}, cfg), tokenize=False,
                                               add_generation_prompt=True) for q in prompts]
    tokens = [list(t) for t in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    prefix = cfg.response_prefix
    if prefix:
        ids = list(tokenizer(prefix, add_special_tokens=False)["input_ids"])
        for i, text in enumerate(texts):
            if not text.endswith(prefix):  # a template may open the block itself
                texts[i], tokens[i] = text + prefix, tokens[i] + ids
    return texts, tokens


def with_images(messages: list[dict], num_images: int) -> list[dict]:
    """``messages`` with ``num_images`` image entries before the text of the first user turn
    (content as a list of ``{"type": "image"}`` / ``{"type": "text"}`` parts, the form
    multimodal chat templates read); messages that already hold image parts are kept as they are."""
    if any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
           for m in messages):
        return messages
    out = [dict(m) for m in messages]
    for m in out:
        if m["role"] == "user":
            text = m["content"]
            m["content"] = [{"type": "image"} for _ in range(num_images)] + \
                [{"type": "text", "text": text}]
            break
    return out


def render_image_prompts(records: Sequence[dict], tokenizer: Any, cfg: DataConfig,
                         encoder: "ImageEncoder", labels: Sequence[str]) -> tuple[list[str], list[list[int]]]:
    """:func:`render_prompts` for records with ``images``: the images go into the user turn,
    the chat template writes one image token per image, and each is repeated as many times as
    the vision tower gives it features (:meth:`ImageEncoder.expand`), as the model's processor
    does. ``labels[i]`` names record i in errors."""
    texts, tokens = [], []
    prefix_ids = list(tokenizer(cfg.response_prefix, add_special_tokens=False)["input_ids"]) \
        if cfg.response_prefix else []
    for rec, label in zip(records, labels):
        msgs = with_images(record_messages(rec, cfg), len(rec["images"]))
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        _, grids = encoder.encode(rec["images"])
        ids = encoder.expand(ids, grids, label)
        if cfg.response_prefix and not text.endswith(cfg.response_prefix):
            text, ids = text + cfg.response_prefix, ids + prefix_ids
        texts.append(text)
        tokens.append(ids)
    return texts, tokens


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
    import torch

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
        fields: B dicts for reward functions: ``question`` and the ``data.extra_keys`` columns.
        pixel_values / image_grid_thw: the rows' vision inputs, (B, N, D) float32 / (B, K, 3)
            int64 (``flowrl.data.images``), or None for text prompts.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    group_id: Tensor
    prompt_index: Tensor
    ground_truth: list[str]
    prompt_text: list[str]
    fields: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    pixel_values: Optional[Tensor] = None
    image_grid_thw: Optional[Tensor] = None

    def images(self) -> Optional[dict[str, Tensor]]:
        """``{"pixel_values", "image_grid_thw"}`` of an image batch, else None."""
        if self.pixel_values is None or self.image_grid_thw is None:
            return None
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def as_dict(self) -> dict[str, Any]:
        """The batch as a name -> value mapping (DESIGN.md data names)."""
        return dict(self.__dict__)


class PromptSource:
    """Dataset + tokenizer + sampler: the stateful prompt provider of one data-parallel rank.

    The records are read and checked at construction (a malformed file, row or field is a
    ``DataError`` before any model loads, ``flowrl.data.files``), but a prompt is rendered
    (chat template) and encoded only when it is first drawn (then cached): a run of 20 steps
    of 8 prompts renders about 160 of GSM8K's 7,473. At construction only the first
    ``_PROBE`` records are rendered: the chat template is tried on real prompts before any
    model loads, and their ids fingerprint the tokenizer for a resume.

    The sampler permutes all ``len(records)`` records. A drawn prompt longer than
    ``cfg.max_prompt_tokens`` is skipped (never cut) and the next draw takes its place, so a
    batch still holds ``num_prompts`` prompts; ``num_skipped`` counts these skips over the run
    (each time one is drawn, logged as a warning the first time a record is found over-long,
    and in the ``data/skipped_prompts`` metric). When no prompt is over-long the order is the
    one an up-front filter gives; with over-long prompts it is the permutation of all records
    with those left out where they fall (an up-front filter permuted only the kept ones).

    Prompts with images (``data.image_column``, ``data=visual``) need ``image_encoder`` (the
    model's image processor, ``flowrl.models.vision.image_encoder``); their batches carry
    ``pixel_values`` / ``image_grid_thw``, encoded when a batch is drawn.

    Raises:
        ValueError: every prompt is too long (checked in full only when all probed ones
            are), fewer records than ranks, images without an ``image_encoder`` (a text-only
            model), a chat template that fails on a record (naming it); at ``sample``, a
            rank whose draws of two epochs of its shard were all over-long.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, rank: int = 0, world_size: int = 1,
                 image_encoder: Optional["ImageEncoder"] = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.rank, self.world_size = rank, world_size
        self.image_encoder = image_encoder
        self.records = load_records(cfg, cfg.split, cfg.limit)
        if self.records and "images" in self.records[0] and image_encoder is None:
            raise ValueError(f"the prompts of {cfg.source_name} hold images, but the model has no "
                             "image processor: use a vision-language model (model=tiny_vl, or "
                             "model.path=<a Qwen2-VL / Qwen2.5-VL directory>)")
        # record index -> (rendered text, token ids): filled as records are drawn
        self._rendered: dict[int, tuple[str, list[int]]] = {}
        self._overlong: set[int] = set()  # records found longer than max_prompt_tokens
        self._warned: set[int] = set()  # over-long records drawn (and warned of) at least once
        self.num_skipped = 0  # over-long draws skipped so far (resumed from the checkpoint)
        probe = range(min(len(self.records), _PROBE))
        self._render(probe)
        if probe and all(i in self._overlong for i in probe):  # all of them? (rare: pay in full)
            self._render(range(len(self.records)))
            if len(self._overlong) == len(self.records):
                raise ValueError(f"all {len(self.records)} prompts of {cfg.source_name} exceed "
                                 f"data.max_prompt_tokens={cfg.max_prompt_tokens}")
        self.sampler = PromptSampler(len(self.records), seed=cfg.seed, shuffle=cfg.shuffle,
                                     rank=rank, world_size=world_size)
        self.step = 0  # sample() calls so far
        self.eval_skipped = 0  # over-long prompts of the last eval_batches slice
        self._group_offset = 0
        self._group_records: OrderedDict[int, int] = OrderedDict()  # recent group id -> record

    def _encode(self, records: Sequence[dict[str, Any]], labels: Sequence[str]
                ) -> tuple[list[str], list[list[int]]]:
        """Render and encode ``records`` (one batched tokenizer call); a template error names
        the record (``labels[i]``)."""
        if records and "images" in records[0] and self.image_encoder is not None:
            return render_image_prompts(records, self.tokenizer, self.cfg, self.image_encoder,
                                        labels)
        try:
            return render_prompts([r["prompt"] for r in records], self.tokenizer, self.cfg)
        except Exception as batch_error:  # find the record: render one by one
            for r, label in zip(records, labels):
                try:
                    render_prompts([r["prompt"]], self.tokenizer, self.cfg)
                except Exception as e:
                    raise ValueError(f"{label}: the chat template failed on this prompt: "
                                     f"{type(e).__name__}: {e}") from e
            raise batch_error

    def _render(self, indices: Iterable[int]) -> None:
        """Render the records of ``indices`` not rendered yet; note the over-long ones."""
        todo = sorted({i for i in indices if i not in self._rendered})
        if not todo:
            return
        texts, tokens = self._encode([self.records[i] for i in todo],
                                     [f"{self.cfg.source_name} record {i}" for i in todo])
        for i, text, ids in zip(todo, texts, tokens):
            self._rendered[i] = (text, ids)
            if len(ids) > self.cfg.max_prompt_tokens:
                self._overlong.add(i)

    def render(self, index: int) -> tuple[str, list[int]]:
        """Record ``index`` of the split as the policy sees it: (rendered text, prompt token
        ids), with the chat template, tools and ``response_prefix`` applied
        (:func:`render_prompts`); cached. Over-long prompts are returned too."""
        self._render([index])
        return self._rendered[index]

    def _draw(self, num_prompts: int) -> list[int]:
        """The next ``num_prompts`` records of this rank that fit ``max_prompt_tokens``:
        over-long draws are skipped (counted) and replaced by the next ones."""
        picks: list[int] = []
        misses = 0  # consecutive over-long draws
        new: list[int] = []
        while len(picks) < num_prompts:
            drawn = self.sampler.next_batch(num_prompts - len(picks))
            self._render(drawn)
            for i in drawn:
                if i in self._overlong:
                    self.num_skipped, misses = self.num_skipped + 1, misses + 1
                    if i not in self._warned:
                        new.append(i)
                        self._warned.add(i)
                else:
                    picks.append(i)
                    misses = 0
            if misses > 2 * self.sampler.shard_size:
                raise ValueError(
                    f"data: rank {self.rank} drew {misses} prompts in a row (two epochs of its "
                    f"shard) longer than data.max_prompt_tokens={self.cfg.max_prompt_tokens}; "
                    f"raise it or filter {self.cfg.source_name}")
        if new:
            log.warning("skipped %d more %s prompt%s longer than data.max_prompt_tokens=%d "
                        "(%d over-long draws skipped so far; rows %s, counting from 1)", len(new),
                        self.cfg.source_name, "s" * (len(new) > 1), self.cfg.max_prompt_tokens,
                        self.num_skipped, [i + 1 for i in new[:8]])
        return picks

    def __len__(self) -> int:
        """Number of records of the split (over-long ones included: they are found, and
        skipped, only when drawn; ``num_skipped`` counts them)."""
        return len(self.records)

    @property
    def response_prefix(self) -> str:
        """``data.response_prefix``: the pre-filled start of every response, already in the
        prompt ids; rule rewards and the evaluation score ``response_prefix + response``."""
        return self.cfg.response_prefix

    def _batch(self, indices: list[int], n: int, group_ids: list[int], records,
               rendered: Callable[[int], tuple[str, list[int]]]) -> PromptBatch:
        import torch

        rows = [i for i in indices for _ in range(n)]
        ids, mask = collate_prompts([rendered(i)[1] for i in rows], self.tokenizer.pad_token_id)
        vision: dict[str, Any] = {}
        if self.image_encoder is not None and rows and "images" in records[rows[0]]:
            from flowrl.data.images import collate_images

            encoded = {i: self.image_encoder.encode(records[i]["images"]) for i in indices}
            vision = collate_images([encoded[i] for i in rows])
        return PromptBatch(**vision,
            prompt_ids=ids, prompt_mask=mask,
            group_id=torch.tensor(group_ids, dtype=torch.int64).repeat_interleave(n),
            prompt_index=torch.tensor(rows, dtype=torch.int64),
            ground_truth=[records[i]["ground_truth"] for i in rows],
            prompt_text=[rendered(i)[0] for i in rows],
            fields=[{"question": records[i]["question"], **records[i]["fields"]} for i in rows])

    def sample(self, num_prompts: int, n: int) -> PromptBatch:
        """Draw this rank's next ``num_prompts`` prompts, each repeated ``n`` times (tiled).

        Over-long prompts met on the way are skipped and counted (see the class docstring).
        Group ids are globally unique and increase from step to step:
        ``group_id = offset + rank * num_prompts + k`` for the ``k``-th prompt of this rank, where
        ``offset`` is the sum of ``num_prompts * world_size`` over earlier ``sample`` calls, i.e.
        ``step * num_prompts * world_size`` when ``num_prompts`` is constant. All ranks must call
        ``sample`` with the same ``num_prompts`` at a step (SPMD).

        Raises:
            ValueError: ``num_prompts < 1`` or ``n < 1``; two epochs of over-long draws.
        """
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        picks = self._draw(num_prompts)
        base = self._group_offset + self.rank * num_prompts
        batch = self._batch(picks, n, list(range(base, base + num_prompts)), self.records,
                            self._rendered.__getitem__)
        self._group_offset += num_prompts * self.world_size
        self.step += 1
        for gid, idx in zip(range(base, base + num_prompts), picks):
            self._group_records[gid] = idx
        while len(self._group_records) > _RECENT_GROUPS:
            self._group_records.popitem(last=False)
        return batch

    def record_for_group(self, group_id: int) -> Optional[dict[str, Any]]:
        """The record a recent ``sample`` drew for ``group_id`` (None when it is older than the
        last ``_RECENT_GROUPS`` groups or was never drawn here): what reward functions see."""
        idx = self._group_records.get(int(group_id))
        return None if idx is None else self.records[idx]

    def eval_batches(self, limit: Optional[int], batch_size: int,
                     split: Optional[str] = None, shard: bool = True) -> Iterator[PromptBatch]:
        """Greedy-evaluation batches over a FIXED slice: the first ``limit`` records of ``split``
        (default: this source's split) of the evaluation source (``data.eval_path``, else the
        training one; ``load_records``), in file order, never shuffled, one sample per prompt.

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
        records = load_records(self.cfg, split, limit, for_eval=True)
        # the slice is small (trainer.eval.limit) and read whole: rendered up front
        texts, tokens = self._encode(records, [f"eval {split} record {i}" for i in range(len(records))])
        kept = [i for i, t in enumerate(tokens) if len(t) <= self.cfg.max_prompt_tokens]
        self.eval_skipped = len(records) - len(kept)
        if self.eval_skipped:
            log.warning("evaluation: skipped %d of %d prompts longer than data.max_prompt_tokens=%d",
                        self.eval_skipped, len(records), self.cfg.max_prompt_tokens)
        mine = kept[self.rank::self.world_size] if shard else kept
        for start in range(0, len(mine), batch_size):
            chunk = mine[start:start + batch_size]
            yield self._batch(chunk, 1, chunk, records, lambda i: (texts[i], tokens[i]))

    def _fingerprint(self) -> str:
        """Digest of record 0's prompt ids: another tokenizer, chat template, instruction or
        system prompt gives another one (a resume check)."""
        import hashlib

        return hashlib.sha256(repr(self.render(0)[1]).encode()).hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """Sampler position, step counter, group-id offset and skip count (all a resume
        needs), with the length limit and the tokenizer's fingerprint a resume must match."""
        return {"sampler": self.sampler.state_dict(), "step": self.step,
                "group_offset": self._group_offset, "num_skipped": self.num_skipped,
                "max_prompt_tokens": self.cfg.max_prompt_tokens,
                "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next ``sample`` returns what an uninterrupted source would have.

        A state saved before prompts were rendered lazily (no ``fingerprint``) loads when
        it had skipped no prompt (its sampler permuted all records, as this one does).

        Raises:
            ValueError: the saved source used another ``data.max_prompt_tokens`` or tokenizer
                / prompt rendering (which prompts are skipped would differ), an older state
                that had filtered out over-long prompts, or the sampler state does not match.
        """
        self.check_state(state)
        self.sampler.load_state_dict(state["sampler"])
        self.step, self._group_offset = int(state["step"]), int(state["group_offset"])
        self.num_skipped = int(state.get("num_skipped", 0))

    def check_state(self, state: dict[str, Any]) -> None:
        """What :meth:`load_state_dict` refuses, checked without loading it: the job asks before
        any model loads, so a resume with other data settings is one line, not a traceback after
        the model load (fresh-user report). The sampler's world size is not compared (a resume on
        another world size restarts the sampler at the next epoch).

        Raises:
            ValueError: as :meth:`load_state_dict`.
        """
        if "fingerprint" not in state:
            if state.get("num_skipped", 0):
                raise ValueError(f"prompt source state from a run that filtered out "
                                 f"{state['num_skipped']} over-long prompts before sampling: its "
                                 "order cannot be continued by this version (start the run afresh)")
        else:
            if state["max_prompt_tokens"] != self.cfg.max_prompt_tokens:
                raise ValueError(f"prompt source state has data.max_prompt_tokens="
                                 f"{state['max_prompt_tokens']}, this run "
                                 f"{self.cfg.max_prompt_tokens}: the skipped prompts would differ")
            if state["fingerprint"] != self._fingerprint():
                raise ValueError("its first prompts render to other token ids here: other "
                                 "data, tokenizer, chat template or data.instruction/"
                                 "system_prompt/response_prefix")
        self.sampler.check_state(state["sampler"], world_size=False)  # another world restarts
