"""``visual``: a generated counting task with images and an exact answer (``data=visual``).

Each item is one small RGB image with a few filled squares and circles in three colours on a
white background, and the question "How many <colour> shapes are in the image?". The answer is
one integer, checked exactly by the graphs' ``gsm8k`` verifier (the number after the response's
last ``####``), so the pipeline of a vision-language policy runs offline with no download and a
reward that cannot be argued with. Shapes never overlap (each sits in its own cell of a grid), so
the count in the picture is the count in the metadata.

Every record also carries the row's metadata for reward functions (``fields``: ``color``,
``count``, ``num_shapes``, ``counts`` as ``"red=2,green=0,blue=1"``) and its image as PNG bytes
(``images``). The held-out split is fixed: ``test`` and ``train`` items come from their own
seeded streams (``random.Random`` seeded by a string: the same items on every machine) and a
train item whose layout equals a test item's is skipped, so the splits never share an image.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import random
from dataclasses import dataclass
from typing import Any, Optional

COLORS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}
SHAPES = ("square", "circle")
# the metadata columns a record offers reward functions (data.extra_keys)
VISUAL_COLUMNS = ("question", "answer", "ground_truth", "color", "count", "num_shapes", "counts")
INSTRUCTION = "Write the final answer on its own line as '#### <number>'."


@dataclass
class VisualConfig:
    """Size and difficulty of the ``visual`` task (``data.visual.*``).

    Attributes:
        image_size: side of the square image in pixels (56: a 4x4 grid of 14-pixel patches for a
            Qwen2-VL image processor, 4 image tokens after its 2x2 merge); >= 28.
        grid: shapes sit in the cells of a ``grid`` x ``grid`` layout, at most one per cell
            (``max_shapes <= grid**2``).
        max_shapes: shapes per image are drawn uniformly from 1..max_shapes.
        train_size: items of the ``train`` split. test_size: items of the held-out ``test`` split.
        seed: generator seed (both splits); another seed is another task instance.

    Raises:
        ValueError: a setting out of range.
    """

    image_size: int = 56
    grid: int = 3
    max_shapes: int = 5
    train_size: int = 2000
    test_size: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if self.image_size < 28:
            raise ValueError(f"data.visual.image_size must be >= 28, got {self.image_size}")
        if self.grid < 1 or not 1 <= self.max_shapes <= self.grid ** 2:
            raise ValueError(f"data.visual: need grid >= 1 and 1 <= max_shapes <= grid**2, got "
                             f"grid={self.grid}, max_shapes={self.max_shapes}")
        if self.train_size < 1 or self.test_size < 1:
            raise ValueError(f"data.visual.train_size and test_size must be >= 1, got "
                             f"{self.train_size} and {self.test_size}")


def _layout(rng: random.Random, cfg: VisualConfig) -> tuple[tuple[int, str, str], ...]:
    """(cell, shape, colour) of each shape, by cell."""
    k = rng.randint(1, cfg.max_shapes)
    cells = sorted(rng.sample(range(cfg.grid ** 2), k))
    return tuple((c, rng.choice(SHAPES), rng.choice(tuple(COLORS))) for c in cells)


def render(layout: tuple[tuple[int, str, str], ...], cfg: VisualConfig) -> bytes:
    """The PNG bytes of a layout: each shape fills 60% of its cell, centred."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (cfg.image_size, cfg.image_size), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    cell = cfg.image_size / cfg.grid
    for c, shape, colour in layout:
        cx, cy = (c % cfg.grid + 0.5) * cell, (c // cfg.grid + 0.5) * cell
        r = 0.3 * cell
        box = (round(cx - r), round(cy - r), round(cx + r), round(cy + r))
        (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLORS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _record(layout: tuple[tuple[int, str, str], ...], colour: str, cfg: VisualConfig) -> dict[str, Any]:
    counts = {name: sum(1 for _, _, c in layout if c == name) for name in COLORS}
    n = counts[colour]
    return {"question": f"How many {colour} shapes are in the image?",
            "answer": f"There are {n} {colour} shapes.\n#### {n}", "ground_truth": str(n),
            "color": colour, "count": n, "num_shapes": len(layout),
            "counts": ",".join(f"{k}={v}" for k, v in counts.items()),
            "images": [render(layout, cfg)]}


@functools.lru_cache(maxsize=4)
def _generate(key: tuple) -> dict[str, tuple[dict[str, Any], ...]]:
    cfg = VisualConfig(*key)
    seen: set[tuple] = set()
    out: dict[str, tuple[dict[str, Any], ...]] = {}
    # test first: a bigger train split keeps the same held-out items
    for split, size in (("test", cfg.test_size), ("train", cfg.train_size)):
        rng = random.Random(f"flowrl-visual-{cfg.seed}-{split}")
        records: list[dict[str, Any]] = []
        budget = 50 * size + 1000  # draws before settling for fewer (a small layout space)
        while len(records) < size and budget > 0:
            budget -= 1
            layout, colour = _layout(rng, cfg), rng.choice(tuple(COLORS))
            if (layout, colour) in seen:
                continue
            seen.add((layout, colour))
            records.append(_record(layout, colour, cfg))
        out[split] = tuple(records)
    return out


def load_visual(split: str = "train", limit: Optional[int] = None,
                cfg: Optional[VisualConfig] = None) -> list[dict[str, Any]]:
    """Records of a ``visual`` split in generation order: ``question``, ``answer``,
    ``ground_truth`` (the count, a string), the metadata columns of :data:`VISUAL_COLUMNS` and
    ``images`` (a list of one PNG ``bytes``).

    Raises:
        ValueError: unknown split or a limit < 1.
    """
    if split not in ("train", "test"):
        raise ValueError(f"data.split must be 'train' or 'test' for the bundled visual task, got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"visual limit must be >= 1 or None, got {limit}")
    cfg = cfg or VisualConfig()
    records = _generate(dataclasses.astuple(cfg))[split]
    return [dict(r) for r in (records if limit is None else records[:limit])]
