"""Checkpoints with torch.distributed.checkpoint (DCP): atomic directories, newest-complete resume.

Layout: ``<root>/step_000004/`` holds the DCP shards of the tensor state (model, optimizer,
scheduler, RNG) and ``trainer_state.json`` (step, data position: plain JSON, so nothing is ever
unpickled on load). A save is written to ``step_000004.tmp`` and renamed only when complete, so a
save killed half-way is never picked up by resume.

Under ``torchrun`` every rank calls ``save``/``load`` (DCP writes each rank's shards; the folder must
be on a file system all ranks see) and rank 0 alone writes the JSON and renames. DCP re-shards on
load, so a checkpoint saved at world size 2 loads at world size 1 (or 4). ``async_save=True`` only
copies the state to host memory before returning; the write runs in a background thread and is
made visible (renamed) by :meth:`CheckpointManager.wait`, the next ``save``, or :meth:`poll`.
Loading never unpickles arbitrary objects: non-tensor values go through
``torch.load(weights_only=True)`` and the DCP ``.metadata`` index through the same restricted
unpickler (:class:`WeightsOnlyReader`).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from flowrl.runtime import distributed as fdist

log = logging.getLogger(__name__)
# a one-process run saves and loads DCP checkpoints without a process group on purpose: DCP's
# warning about it would print at every checkpoint
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_META = "trainer_state.json"


class CheckpointManager:
    """Args: root: checkpoint folder; keep_last: complete checkpoints kept (older ones deleted)."""

    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last
        self._pending: Optional[tuple[Any, Path, Path, str]] = None  # (future, tmp, final, json)

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any], *,
             async_save: bool = False) -> Path:
        """Write ``tensors`` (nested dict of tensors, DCP) and ``meta`` (JSON-able) for ``step``.

        Collective under torchrun (every rank calls it with its shards). ``async_save``: return as
        soon as the tensors are copied to host memory (``dcp.async_save``); the directory appears
        under its final name only once the write has finished. One async save is in flight at a
        time: a new ``save`` first waits for the previous one.

        Returns: the final directory (which may not exist yet when ``async_save``).
        """
        self.wait()
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        meta_json = json.dumps({"step": step, **meta}, indent=1)  # frozen now, not at finalize
        if fdist.is_rank0():
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        fdist.barrier()
        if async_save:
            fut = dcp.async_save(tensors, checkpoint_id=str(tmp),
                                 process_group=fdist.checkpoint_group())
            self._pending = (fut, tmp, final, meta_json)
            return final
        dcp.save(tensors, checkpoint_id=str(tmp))
        self._finalize(tmp, final, meta_json)
        fdist.barrier()  # no rank reads the checkpoint before it is complete
        return final

    def _finalize(self, tmp: Path, final: Path, meta_json: str) -> None:
        if not fdist.is_rank0():
            return
        (tmp / _META).write_text(meta_json)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()

    def wait(self) -> Optional[Path]:
        """Block until the in-flight async save is written, then publish it (rename).

        Returns: its final directory, or None when nothing was in flight.
        Raises: whatever the background write raised (the ``.tmp`` directory is left behind).
        """
        if self._pending is None:
            return None
        fut, tmp, final, meta_json = self._pending
        self._pending = None
        fut.result()
        self._finalize(tmp, final, meta_json)
        return final

    def poll(self) -> Optional[Path]:
        """Publish the in-flight async save if its write has finished; never blocks."""
        if self._pending is not None and self._pending[0].done():
            return self.wait()
        return None

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (``.tmp`` leftovers and dirs without metadata are ignored)."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / _META).is_file() and (p / ".metadata").is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Optional[Path]:
        c = self.complete()
        return c[-1] if c else None

    def load(self, path: str | Path, tensors: dict[str, Any]) -> dict[str, Any]:
        """Load in place into ``tensors`` (same structure as saved); return the JSON metadata."""
        path = Path(path)
        dcp.load(tensors, storage_reader=WeightsOnlyReader(path))
        return json.loads((path / _META).read_text())

    def _prune(self) -> None:
        for p in self.complete()[: -self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a DCP index is made of (Python docs,
    "Restricting Globals"): DCP metadata classes, ``torch.Size``, dtypes/layouts/memory formats,
    paths and a few builtin containers."""

    _BUILTINS = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("builtins", "slice"), ("builtins", "complex"), ("pathlib", "PosixPath"),
                 ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module.startswith("torch.distributed.checkpoint."):
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type):
                return obj
        if module == "torch" and (name == "Size" or isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # name string -> torch.layout
            return torch.serialization._get_layout
        if (module, name) in self._BUILTINS:
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which a "
                                     "weights-only load does not allow")


class WeightsOnlyReader(FileSystemReader):
    """DCP reader whose ``.metadata`` index is read by a restricted unpickler (DCP's own reader uses
    plain ``pickle.load``): a tampered checkpoint cannot run code on load. Tensor payloads and
    non-tensor values are already read by DCP with ``torch.load(weights_only=True)``."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _RestrictedUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
