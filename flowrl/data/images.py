"""Images in prompts (``data.image_column``, the bundled ``visual`` task): checking every row's
images before any model loads, and turning a prompt's images into the vision inputs of a
Qwen2-VL-family model.

An image source is a local file path (relative paths start at the data file's folder), PNG/JPEG
``bytes``, a ``{"bytes": ..., "path": ...}`` dict (a ``datasets`` ``Image`` column or its
parquet form) or a PIL image; a row holds one source or a list of them.

Vision inputs, per batch row (batch-first, so micro-batching, rebalancing and the store slice
them like any other tensor; DESIGN.md "Data that flows"):

- ``pixel_values`` (B, N, D) float32: the row's image patches (all its images, in prompt
  order), zero-padded to the batch's longest N; D = channels x temporal patch x patch².
- ``image_grid_thw`` (B, K, 3) int64: (t, h, w) patch grid of each of the row's images, zero
  rows after its last image. A row's N = sum of t*h*w over its images.

:func:`flatten_images` turns them into the flat ``(sum N, D)`` / ``(images, 3)`` the model takes.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from torch import Tensor

VISION_KEYS = ("pixel_values", "image_grid_thw")


class ImageError(ValueError):
    """A row's image flowrl cannot use, in one line naming the row and field
    (``flowrl.data.files`` reports it as its ``DataError``)."""
IMAGE_PLACEHOLDER = "<|image_pad|>"  # the Qwen2-VL family's image token (one per image in the text)


def _open(src: Any):
    from PIL import Image

    if isinstance(src, Image.Image):
        return src
    if isinstance(src, (bytes, bytearray)):
        return Image.open(io.BytesIO(src))
    return Image.open(src)


def open_image(src: Any):
    """The RGB PIL image of one checked source (:func:`check_images`)."""
    img = _open(src)
    img.load()
    return img.convert("RGB")


def check_images(value: Any, at: str, key: str, base: Optional[Path] = None) -> list[Any]:
    """The sources of one row's ``key`` field, each opened and decoded once to prove it is an
    image (a truncated file fails here, not in a rollout).

    Returns:
        a list of sources: absolute path strings, ``bytes`` or PIL images.

    Raises:
        ImageError: ``"<at>: field 'image': ..."`` for a missing file, bytes or a file that is no
            image, a wrong type, or an empty list.
    """
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ImageError(f"{at}: field {key!r}: no image (an empty list)")
    out = []
    for j, item in enumerate(items):
        which = f"field {key!r}" + (f" image {j}" if len(items) > 1 else "")
        if isinstance(item, dict):  # datasets' Image feature: {"bytes": b"..." | None, "path": str}
            item = item.get("bytes") or item.get("path")
        if isinstance(item, str):
            p = Path(item).expanduser()
            if not p.is_absolute() and base is not None:
                p = base / p
            if not p.is_file():
                raise ImageError(f"{at}: {which}: no image file {str(p)!r}")
            item = str(p.resolve())
        elif not isinstance(item, (bytes, bytearray)) and type(item).__module__.split(".")[0] != "PIL":
            got = "null" if item is None else type(item).__name__
            raise ImageError(f"{at}: {which} must be an image path, image bytes or a "
                            f"{{'bytes', 'path'}} dict, got {got}")
        try:
            open_image(item)
        except Exception as e:  # PIL raises UnidentifiedImageError, OSError (truncated), ...
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ImageError(f"{at}: {which}: not a readable image ({msg})") from None
        out.append(item)
    return out


class ImageEncoder:
    """A model's image processor plus its tokenizer's image token: what a prompt with images
    needs (the text expansion a Qwen2-VL ``processor`` does, without its video half, which
    needs torchvision).

    Args:
        image_processor: a transformers Qwen2-VL-family image processor (``patch_size``,
            ``merge_size``; returns ``pixel_values`` (N, D) and ``image_grid_thw`` (k, 3)).
        image_token_id: the tokenizer's ``<|image_pad|>`` id.

    Raises:
        ValueError: the tokenizer has no image token.
    """

    def __init__(self, image_processor: Any, image_token_id: Optional[int]) -> None:
        if image_token_id is None:
            raise ValueError(f"the tokenizer has no {IMAGE_PLACEHOLDER} token: a model with images "
                             "needs a Qwen2-VL-family tokenizer")
        self.image_processor = image_processor
        self.image_token_id = int(image_token_id)
        self.merge_size = int(getattr(image_processor, "merge_size", 2))

    @classmethod
    def for_model(cls, image_processor: Any, tokenizer: Any) -> "ImageEncoder":
        """The encoder of a model's image processor and tokenizer (its ``<|image_pad|>`` id)."""
        tid = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
        return cls(image_processor, None if tid == tokenizer.unk_token_id else tid)

    def encode(self, sources: Sequence[Any]) -> tuple[Tensor, Tensor]:
        """``(pixel_values (N, D) float32, image_grid_thw (k, 3) int64)`` of one row's images."""
        import torch

        out = self.image_processor(images=[open_image(s) for s in sources], return_tensors="pt")
        return (torch.as_tensor(out["pixel_values"], dtype=torch.float32),
                torch.as_tensor(out["image_grid_thw"], dtype=torch.int64))

    def expand(self, token_ids: Sequence[int], grids: Tensor, at: str = "prompt") -> list[int]:
        """``token_ids`` with the i-th image token repeated ``t*h*w / merge_size²`` times (the
        features the vision tower gives image i).

        Raises:
            ImageError: the text holds another number of image tokens than there are images.
        """
        found = sum(1 for t in token_ids if t == self.image_token_id)
        if found != grids.shape[0]:
            raise ImageError(f"{at}: {grids.shape[0]} image(s) but the rendered prompt has {found} "
                            f"{IMAGE_PLACEHOLDER} token(s) (a chat template without image support?)")
        counts = (grids.prod(-1) // self.merge_size ** 2).tolist()
        out: list[int] = []
        k = 0
        for t in token_ids:
            if t == self.image_token_id:
                out.extend([t] * int(counts[k]))
                k += 1
            else:
                out.append(t)
        return out


def collate_images(rows: Sequence[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """Batch-first vision inputs (module docstring) of per-row ``(pixel_values, grids)``."""
    import torch

    n = max(pv.shape[0] for pv, _ in rows)
    k = max(g.shape[0] for _, g in rows)
    D = rows[0][0].shape[1]
    pixel_values = torch.zeros(len(rows), n, D, dtype=torch.float32)
    grids = torch.zeros(len(rows), k, 3, dtype=torch.int64)
    for i, (pv, g) in enumerate(rows):
        pixel_values[i, :pv.shape[0]] = pv
        grids[i, :g.shape[0]] = g
    return {"pixel_values": pixel_values, "image_grid_thw": grids}


def mm_token_type_ids(input_ids: Tensor, image_token_id: int) -> Tensor:
    """(B, L) int32: 1 at image tokens, 0 elsewhere (text): what a Qwen2-VL-family model reads
    (with the grids) to place its M-RoPE height/width positions; its processor returns it."""
    return (input_ids == image_token_id).int()


def vision_kwargs(model: Any, pixel_values: Tensor, image_grid_thw: Tensor, input_ids: Tensor,
                  device: Any) -> dict[str, Tensor]:
    """The image kwargs of a forward/``generate`` of ``model`` over ``input_ids`` (B, L):
    flattened patches and grids, and ``mm_token_type_ids`` (image tokens of ``input_ids``) when
    the model's forward takes it (transformers >= 5.2x reads M-RoPE placement from it; earlier
    ones find the image tokens in the ids themselves)."""
    import inspect

    pv, grid = flatten_images(pixel_values, image_grid_thw)
    out = {"pixel_values": pv.to(device), "image_grid_thw": grid.to(device)}
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        out["mm_token_type_ids"] = mm_token_type_ids(input_ids, model_image_token_id(model)).to(device)
    return out


def model_image_token_id(model: Any) -> int:
    """The ``image_token_id`` of a vision-language model's config.

    Raises:
        ValueError: the model's config has none (not a Qwen2-VL-family model).
    """
    tid = getattr(getattr(model, "config", None), "image_token_id", None)
    if tid is None:
        raise ValueError(f"{type(model).__name__} has no config.image_token_id: images need a "
                         "Qwen2-VL-family model")
    return int(tid)


def flatten_images(pixel_values: Tensor, image_grid_thw: Tensor) -> tuple[Tensor, Tensor]:
    """The model's inputs of batch-first vision inputs: ``(sum N, D)`` patches of every row's
    images in row order and their ``(images, 3)`` grids (rows without images give none)."""
    import torch

    grids = image_grid_thw.reshape(-1, 3)
    valid = grids.prod(-1) > 0
    per_row = (image_grid_thw.prod(-1)).sum(-1).tolist()
    patches = [pixel_values[i, :int(n)] for i, n in enumerate(per_row)]
    return torch.cat(patches, dim=0), grids[valid]
