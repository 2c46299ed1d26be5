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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class PatchLayout:
    """How a Qwen2-VL-family image processor turned an image into rows of ``pixel_values``: what
    :func:`images_of_patches` needs to undo it (a picklable copy of the processor's settings, which
    a vLLM engine process receives).

    Attributes:
        patch_size, merge_size, temporal_patch_size: the processor's patching (14, 2, 2 for
            Qwen2-VL / Qwen2.5-VL).
        image_mean, image_std: per-channel normalisation (None: ``do_normalize`` off).
        rescale_factor: the uint8-to-float factor (None: ``do_rescale`` off), 1/255.
    """

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: Optional[tuple[float, ...]]
    image_std: Optional[tuple[float, ...]]
    rescale_factor: Optional[float]

    @classmethod
    def of(cls, image_processor: Any) -> "PatchLayout":
        """The layout of a transformers Qwen2-VL-family image processor."""
        p = image_processor
        norm = bool(getattr(p, "do_normalize", True))
        as_tuple = lambda v: tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))  # noqa: E731
        return cls(patch_size=int(p.patch_size), merge_size=int(p.merge_size),
                   temporal_patch_size=int(p.temporal_patch_size),
                   image_mean=as_tuple(p.image_mean) if norm else None,
                   image_std=as_tuple(p.image_std) if norm else None,
                   rescale_factor=float(p.rescale_factor) if getattr(p, "do_rescale", True) else None)


def images_of_patches(pixel_values: Tensor, grids: Tensor, layout: PatchLayout,
                      at: str = "prompt") -> list[Any]:
    """The RGB PIL images whose processing gave ``pixel_values``: the inverse of a Qwen2-VL-family
    processor's rescale, normalisation and patching (its resize already happened: each image
    comes back at its processed size, which the processor's resize leaves as it is).

    A vLLM engine takes a prompt's images as pictures and runs the model's processor itself
    (``multi_modal_data``); undoing the patching here keeps the batch's vision inputs tensors (the
    store, micro-batches and the partitioned transport carry them like any other), and the engine
    re-derives the very ``pixel_values`` the trainer reads: uint8 pixels survive the float round
    trip exactly.

    Args:
        pixel_values: (N, D) float, one row's patches (``flatten_images`` of one row, or the row
            itself with its zero padding: only the first sum(t*h*w) rows are read).
        grids: (k, 3) int64 (t, h, w) per image; zero rows (padding) are skipped.
        layout: the processor's :class:`PatchLayout`.

    Returns:
        one ``PIL.Image`` (mode RGB, width w*patch, height h*patch) per image, in order.

    Raises:
        ImageError: a grid with t != 1 (a video), or a width D that is not C x T x patch².
    """
    import numpy as np
    import torch
    from PIL import Image

    p, m, T = layout.patch_size, layout.merge_size, layout.temporal_patch_size
    if pixel_values.shape[-1] % (T * p * p):
        raise ImageError(f"{at}: pixel_values rows of width {pixel_values.shape[-1]} are not "
                         f"channels x {T} x {p}x{p} patches")
    C = pixel_values.shape[-1] // (T * p * p)
    out, start = [], 0
    for t, h, w in grids.tolist():
        if t * h * w == 0:
            continue
        if t != 1:
            raise ImageError(f"{at}: an image grid has t={t}: only still images (t=1) are images")
        x = pixel_values[start:start + h * w].double().reshape(h // m, w // m, m, m, C, T, p, p)
        start += h * w
        # rows are (block row, block col, row in block, col in block), columns (C, T, py, px);
        # every temporal copy of a still image is the same picture: take the first
        x = x[:, :, :, :, :, 0].permute(4, 0, 2, 5, 1, 3, 6).reshape(C, h * p, w * p)
        if layout.image_std is not None and layout.image_mean is not None:
            x = x * torch.tensor(layout.image_std, dtype=x.dtype)[:, None, None] \
                + torch.tensor(layout.image_mean, dtype=x.dtype)[:, None, None]
        if layout.rescale_factor is not None:
            x = x / layout.rescale_factor
        pixels = x.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        out.append(Image.fromarray(np.ascontiguousarray(pixels)))  # (H, W, 3) uint8: RGB
    return out


def collapse_image_tokens(token_ids: Sequence[int], grids: Tensor, image_token_id: int,
                          merge_size: int, at: str = "prompt") -> list[int]:
    """The inverse of :meth:`ImageEncoder.expand`: each image's run of ``t*h*w / merge_size²``
    image tokens back to one.

    vLLM's Qwen2-VL processor expands every ``<|image_pad|>`` of a token prompt itself (its
    prompt update replaces each one with the image's feature count); handed the expanded prompt
    it would expand the first token of the run again and leave the rest as text tokens.

    Args:
        token_ids: one prompt's real tokens (no padding), images already expanded.
        grids: (k, 3) the row's image grids; zero rows (padding) are skipped.

    Raises:
        ImageError: the prompt's image-token runs do not match the images' feature counts.
    """
    counts = [t * h * w // merge_size ** 2 for t, h, w in grids.tolist() if t * h * w > 0]
    out: list[int] = []
    k = i = 0
    ids = list(token_ids)
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(ids[i])
            i += 1
            continue
        # the run at i: longer than image k's count only when image k+1 follows at once
        found = next((j for j in range(i, len(ids)) if ids[j] != image_token_id), len(ids)) - i
        if k >= len(counts):
            raise ImageError(f"{at}: {len(counts)} image(s) but the prompt has more image-token "
                             f"runs (another at position {i})")
        run = counts[k]
        if found < run:
            raise ImageError(f"{at}: image {k} needs {run} image tokens, the prompt's run at "
                             f"position {i} has {found}")
        out.append(image_token_id)
        i += run
        k += 1
    if k != len(counts):
        raise ImageError(f"{at}: {len(counts)} image(s) but the prompt holds {k} image-token run(s)")
    return out
