"""GSM8K (Cobbe et al. 2021, MIT licence), bundled as package data under ``flowrl/data/gsm8k/``.

Each record is ``{"question": str, "answer": str (full worked solution), "ground_truth": str}``
where ``ground_truth`` is the number after the solution's ``####`` with commas stripped.
"""
from __future__ import annotations

import functools
import json
from importlib.resources import files
from typing import Optional

SPLITS = ("train", "test")


def parse_ground_truth(answer: str) -> str:
    """``"...\\n#### 1,000"`` -> ``"1000"``.

    Raises:
        ValueError: the solution has no ``####`` or nothing after it.
    """
    head, marker, tail = answer.rpartition("####")
    value = tail.strip().replace(",", "")
    if not marker or not value:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return value


@functools.lru_cache(maxsize=None)
def _read_split(split: str) -> tuple[dict[str, str], ...]:
    path = files("flowrl.data") / "gsm8k" / f"{split}.jsonl"
    records = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                truth = parse_ground_truth(row["answer"])
            except ValueError as e:
                raise ValueError(f"gsm8k/{split}.jsonl line {lineno}: {e}") from None
            records.append({"question": row["question"], "answer": row["answer"],
                            "ground_truth": truth})
    return tuple(records)


def load_gsm8k(split: str = "train", limit: Optional[int] = None) -> list[dict[str, str]]:
    """Records of a bundled GSM8K split, in file order (train: 7473, test: 1319).

    Args:
        split: ``"train"`` or ``"test"``.
        limit: keep only the first ``limit`` records (None = all).

    Raises:
        ValueError: unknown split or a negative/zero limit.
    """
    if split not in SPLITS:
        raise ValueError(f"data.split must be 'train' or 'test', got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"gsm8k limit must be >= 1 or None, got {limit}")
    records = _read_split(split)
    return [dict(r) for r in (records if limit is None else records[:limit])]

