"""Checkpoints with torch.distributed.checkpoint (DCP): atomic directories, newest-loadable resume.

Layout: ``<root>/step_000004/`` holds the DCP shards of the tensor state (model, optimizer,
scheduler, RNG), ``checksums.json`` (the CRC-32 of every other file, checked by
:func:`verify_checkpoint`) and ``trainer_state.json`` (step, data position: plain JSON, so nothing
is ever unpickled on load). A save is written to ``step_000004.tmp`` and renamed only when complete
(``trainer_state.json``, the folder and its parent fsynced first), so a save killed half-way is
never picked up by resume; :meth:`CheckpointManager.resume_point` removes such leftovers at
start-up and falls back past a corrupt newest checkpoint to the previous loadable one.

Under ``torchrun`` every rank calls ``save``/``load`` (DCP writes each rank's shards; the folder must
be on a file system all ranks see) and rank 0 alone writes the JSON and renames. DCP re-shards on
load, so a checkpoint saved at world size 2 loads at world size 1 (or 4). ``async_save=True`` only
copies the state to host memory before returning; the write runs in a background thread and is
made visible (renamed) by :meth:`CheckpointManager.wait`, the next ``save``, or :meth:`poll`.

A full disk: ``save`` first checks the free space against the state's bytes, and any write
failure becomes a :class:`CheckpointWriteError` naming the file system, its free bytes and the
bytes needed, after the partial ``.tmp`` folder is removed.

Loading never unpickles arbitrary objects: non-tensor values go through
``torch.load(weights_only=True)`` and the DCP ``.metadata`` index through a restricted unpickler
with an explicit allow-list (:data:`ALLOWED_GLOBALS`, :class:`WeightsOnlyReader`).
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
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from flowrl.ops.collectives import all_reduce
from flowrl.runtime.io import distributed as fdist

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)
# a one-process run saves and loads DCP checkpoints without a process group on purpose: DCP's
# warning about it would print at every checkpoint
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_META = "trainer_state.json"
# CRC-32 of every other file of the checkpoint, taken by rank 0 before publishing: a shard whose
# bytes change after the save (damaged in place, its length kept) is caught at verify, where a
# length check cannot see it (a fresh user's resume then trained on NaN weights)
_SUMS = "checksums.json"
_SUM_CHUNK = 16 << 20
# headroom over the tensor bytes: DCP's per-file zip framing, the index, trainer_state.json
_SPACE_MARGIN = 1.05
_SPACE_SLACK_BYTES = 1 << 20


def _has_cuda_tensor(tree: Any) -> bool:
    import torch

    if isinstance(tree, dict):
        return any(_has_cuda_tensor(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_cuda_tensor(v) for v in tree)
    return isinstance(tree, torch.Tensor) and tree.is_cuda


def storage_writer(path: Path, tensors: Any, file_per_tensor: Optional[bool] = None):
    """The DCP ``FileSystemWriter`` of a synchronous save.

    ``file_per_tensor`` (default: when the state holds CUDA tensors): one file per tensor instead
    of one per rank. DCP's writer keeps every tensor it copied to the host alive until the file it
    belongs to is closed (``torch/distributed/checkpoint/filesystem.py``, ``_write_files_from_queue``),
    so one file per rank stages the rank's whole state (weights, gradients' optimizer moments) in
    host RAM at once: +4.2 GiB of peak RSS at the final checkpoint of the 0.5B H200 run
    (``benchmarks/results/e2e_vs_trl_h200.md``). Per tensor, the host holds one tensor at a time.
    CPU states are written from their own storage (nothing is staged), so they keep one file.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    per_tensor = _has_cuda_tensor(tensors) if file_per_tensor is None else file_per_tensor
    return FileSystemWriter(str(path), single_file_per_rank=not per_tensor)


class _PendingSave(NamedTuple):
    """An async save in flight: published by :meth:`CheckpointManager.wait` once written."""

    future: Any  # what dcp.async_save returns (a Future; its type varies across torch versions)
    step: int
    tmp: Path
    final: Path
    meta_json: str
    needed: int  # bytes the checkpoint needs (for the error message of a failed write)


class CheckpointManager:
    """Args: root: checkpoint folder; keep_last: complete checkpoints kept (older ones deleted)."""

    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last
        self._pending: Optional[_PendingSave] = None

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any], *,
             async_save: bool = False) -> Path:
        """Write ``tensors`` (nested dict of tensors, DCP) and ``meta`` (JSON-able) for ``step``.

        Collective under torchrun (every rank calls it with its shards). ``async_save``: return as
        soon as the tensors are copied to host memory (``dcp.async_save``); the directory appears
        under its final name only once the write has finished. One async save is in flight at a
        time: a new ``save`` first waits for the previous one.

        Returns: the final directory (which may not exist yet when ``async_save``).

        Raises:
            CheckpointWriteError: not enough free space for the state (checked before anything
                is written), or the write failed; no ``.tmp`` folder is left behind.
        """
        self.wait()
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        meta_json = json.dumps({"step": step, **meta}, indent=1)  # frozen now, not at finalize
        needed = self._check_space(step, tensors, len(meta_json))
        if fdist.is_rank0():
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        fdist.barrier()
        try:
            if async_save:
                fut = dcp.async_save(tensors, checkpoint_id=str(tmp),
                                     process_group=fdist.checkpoint_group())
                self._pending = _PendingSave(fut, step, tmp, final, meta_json, needed)
                return final
            dcp.save(tensors, storage_writer=storage_writer(tmp, tensors))
            self._finalize(tmp, final, meta_json)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            if any(isinstance(c, KeyboardInterrupt) for c in _causes(e)):
                # Ctrl-C inside DCP's write (it wraps it): an interrupt, not a file-system fault
                if fdist.is_rank0():
                    shutil.rmtree(tmp, ignore_errors=True)
                raise KeyboardInterrupt from e
            raise self._write_error(step, tmp, needed, e) from e
        fdist.barrier()  # no rank reads the checkpoint before it is complete
        return final

    def _check_space(self, step: int, tensors: dict[str, Any], extra: int) -> int:
        """Bytes the checkpoint needs (all ranks' shards); raise before writing when the file
        system has less free. Every rank takes the same decision (two scalar all-reduces)."""
        needed = int(all_reduce(float(_tensor_bytes(tensors)), "sum") * _SPACE_MARGIN) \
            + extra + _SPACE_SLACK_BYTES
        free = free_bytes(self.root)
        short = all_reduce(1.0 if free < needed else 0.0, "max")
        if short:
            raise CheckpointWriteError(
                f"checkpoint step {step} not saved: {describe_fs(self.root)} has {_human(free)} "
                f"free, this checkpoint needs about {_human(needed)}. Nothing was written; "
                f"{self._kept()} Free space and continue with trainer.resume=true.")
        return needed

    def _kept(self) -> str:
        done = self.complete()
        return (f"complete checkpoints are untouched ({', '.join(p.name for p in done)})."
                if done else "no complete checkpoint exists yet.")

    def _write_error(self, step: int, tmp: Path, needed: int, e: BaseException) -> CheckpointWriteError:
        """The partial folder removed (rank 0), the failure as one clear message."""
        if fdist.is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        free = free_bytes(self.root)
        causes = _causes(e)
        full = any(_is_disk_full(c) for c in causes) or free < needed
        what = "; ".join(f"{type(c).__name__}: {(str(c).strip().splitlines() or [''])[0][:200]}"
                         for c in causes[:2])
        return CheckpointWriteError(
            f"checkpoint step {step} not saved: writing {tmp} failed ({what}); "
            f"{describe_fs(self.root)} has {_human(free)} free, this checkpoint needs about "
            f"{_human(needed)}{': no space left on device' if full else ''}. The partial folder "
            f"was removed; {self._kept()} {'Free space' if full else 'Fix the cause'} and "
            "continue with trainer.resume=true.")

    def _finalize(self, tmp: Path, final: Path, meta_json: str) -> None:
        if not fdist.is_rank0():
            return
        sums = json.dumps(file_checksums(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file()
                                                     and p.name not in (_META, _SUMS))), indent=1)
        with open(tmp / _SUMS, "w") as f:
            f.write(sums)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp / _META, "w") as f:
            f.write(meta_json)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)  # the shards' and the JSON's directory entries, before publishing
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)  # the rename itself
        self._prune()

    def wait(self) -> Optional[Path]:
        """Block until the in-flight async save is written, then publish it (rename).

        Returns: its final directory, or None when nothing was in flight.
        Raises: CheckpointWriteError when the background write failed (its ``.tmp`` folder is
            removed).
        """
        if self._pending is None:
            return None
        fut, step, tmp, final, meta_json, needed = self._pending
        self._pending = None
        try:
            fut.result()
            self._finalize(tmp, final, meta_json)
        except (Exception, CheckpointException) as e:
            raise self._write_error(step, tmp, needed, e) from e
        return final

    def poll(self) -> Optional[Path]:
        """Publish the in-flight async save if its write has finished; never blocks."""
        if self._pending is not None and self._pending.future.done():
            return self.wait()
        return None

    def complete(self) -> list[Path]:
        """Published checkpoints (``step_N`` folders), oldest first; ``.tmp`` leftovers and
        ``.corrupt`` ones are ignored. A save is published by renaming its complete ``.tmp``
        folder, so a ``step_N`` folder missing its index or ``trainer_state.json`` was damaged
        after the save: it is listed, and :func:`verify_checkpoint` refuses it (resume sets it
        aside, saying so), rather than passed over in silence and later overwritten."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint that passes :func:`verify_checkpoint`; a corrupt newer
        one is skipped with a warning (once per folder).

        Raises:
            UnsafeCheckpointError: a tampered index in a checkpoint that would be chosen: the run
                must not silently train on from an older one.
        """
        return self._newest_loadable(before=None)

    def _newest_loadable(self, before: Optional[str]) -> Optional[Path]:
        """The newest complete checkpoint (named below ``before``, if given) that passes
        :func:`verify_checkpoint`; a corrupt one is skipped with a warning (once per process)."""
        for p in reversed(self.complete()):
            if before is not None and p.name >= before:
                continue
            try:
                verify_checkpoint(p)
                return p
            except CorruptCheckpointError as e:
                if p not in _WARNED:
                    log.warning("checkpoint %s is not loadable (%s); trying the previous one", p, e)
                    _WARNED.add(p)
        return None

    def remove_stale(self) -> None:
        """Rank 0 removes ``step_*.tmp`` leftovers of interrupted saves (never complete, never
        loaded): call at start-up, before anything else writes to the disk, so a run stopped by
        a full disk gets that space back first."""
        if fdist.is_rank0() and self._pending is None and self.root.is_dir():
            for p in self.root.glob("step_*.tmp"):
                log.warning("removing %s, the leftover of an interrupted checkpoint save", p)
                shutil.rmtree(p, ignore_errors=True)
        fdist.barrier()

    def resume_point(self) -> Optional[Path]:
        """The checkpoint a resumed run starts from, chosen by rank 0 and given to every rank:
        the newest loadable one (:meth:`latest`). Corrupt checkpoints newer than it are renamed
        ``step_N.corrupt`` (kept for inspection, never loaded or pruned).

        Returns: the checkpoint, or None when the folder holds none.
        Raises:
            UnsafeCheckpointError: see :meth:`latest`.
            CorruptCheckpointError: checkpoints exist but none is loadable (nothing is moved:
                starting fresh over them is the operator's decision).
        """
        choice: Optional[str] = None
        error: Optional[tuple[str, str]] = None  # (kind, message), raised on every rank
        if fdist.is_rank0():
            try:
                choice = self._choose_resume()
            except (UnsafeCheckpointError, CorruptCheckpointError) as e:
                error = (type(e).__name__, str(e))
        choice, error = fdist.broadcast_object((choice, error))
        if error:
            raise (UnsafeCheckpointError if error[0] == "UnsafeCheckpointError"
                   else CorruptCheckpointError)(error[1])
        return None if choice is None else Path(choice)

    def _choose_resume(self) -> Optional[str]:
        latest, done = self.latest(), self.complete()
        if latest is None:
            if done:
                raise CorruptCheckpointError(f"no loadable checkpoint in {self.root}: " + "; ".join(
                    f"{p.name}: {_why_corrupt(p)}" for p in done) + ". Move them away to start fresh.")
            return None
        for p in done:
            if p.name > latest.name:
                why, bad = _why_corrupt(p), _rename_corrupt(p)
                log.warning("resume: %s is not loadable (%s); moved to %s, resuming from %s",
                            p, why, bad.name, latest.name)
        return str(latest)

    def load(self, path: str | Path, tensors: dict[str, Any]) -> dict[str, Any]:
        """Load in place into ``tensors`` (same structure as saved); return the JSON metadata.

        Raises: UnsafeCheckpointError / CorruptCheckpointError (see :func:`verify_checkpoint`;
            also a load that fails on the files' content, naming the checkpoint and the cause).
        """
        path = Path(path)
        meta = verify_checkpoint(path)
        load_tensors(path, tensors)
        return meta

    def previous(self, path: str | Path) -> Optional[Path]:
        """The newest complete checkpoint older than ``path`` that passes
        :func:`verify_checkpoint`, or None."""
        return self._newest_loadable(before=Path(path).name)

    def set_aside(self, path: str | Path, why: str) -> Path:
        """Rename ``path`` to ``step_N.corrupt`` (``.corrupt.K`` when that name is taken; kept
        for inspection, never loaded or pruned): a checkpoint whose tensors did not load while
        an older one did. Rank 0 renames; every
        rank calls it (a barrier). Returns the new path."""
        path = Path(path)
        bad: Optional[Path] = None
        if fdist.is_rank0():
            bad = _rename_corrupt(path)
            log.warning("resume: %s did not load (%s); moved to %s", path, why, bad.name)
        return Path(fdist.broadcast_object(bad))  # the name rank 0 chose (a barrier too)

    def _prune(self) -> None:
        for p in self.complete()[: -self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)



def load_tensors(path: str | Path, tensors: dict[str, Any]) -> None:
    """DCP load of checkpoint ``path`` into ``tensors`` (in place, the saved structure), through
    :class:`WeightsOnlyReader`; call :func:`verify_checkpoint` first.

    Raises:
        CorruptCheckpointError: the files' content does not load (a damaged shard of the right
            length: a zip or pickle error), naming the checkpoint and the cause.
        UnsafeCheckpointError: a tampered index. KeyboardInterrupt: Ctrl-C inside the load.
    """
    path = Path(path)
    try:
        dcp.load(tensors, storage_reader=WeightsOnlyReader(path))
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        causes = _causes(e)
        if any(isinstance(c, KeyboardInterrupt) for c in causes):
            raise KeyboardInterrupt from e
        unsafe = [c for c in causes if isinstance(c, UnsafeCheckpointError)]
        if unsafe:
            raise unsafe[0] from e
        # a shard of the right length whose bytes are damaged passes verify_checkpoint and
        # fails here (a zip or pickle error from torch.load), as would a checkpoint of
        # another model: the caller tells them apart by trying an older checkpoint
        c = causes[0]
        text = " ".join(str(c).split())
        raise CorruptCheckpointError(
            f"{path}: its tensors did not load ({type(c).__name__}: "
            f"{text[:300] + ' ...' if len(text) > 300 else text})") from e


# checkpoints already warned about as not loadable, in this process: the run's start-up asks
# several managers of one folder (the finished-run check, the resume point, the hint), and the
# warning was printed four times (fresh-user report)
_WARNED: set[Path] = set()


class UnsafeCheckpointError(ValueError):
    """A checkpoint's ``.metadata`` index refers to something a DCP index never holds (a class
    outside :data:`ALLOWED_GLOBALS`): the file was tampered with or is not a flowrl/DCP checkpoint.
    Nothing in it was constructed or called."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. the disk is full); the partial ``.tmp`` directory
    was removed and every complete checkpoint is untouched. The message names the file system,
    its free bytes and the bytes the checkpoint needs."""


def _dcp_metadata_names() -> set[tuple[str, str]]:
    names = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}
    return names | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


# Every global a DCP ``.metadata`` pickle is made of (what DCP's ``FileSystemWriter.finish``
# pickles: the index dataclasses, torch.Size, dtypes, layouts via ``_get_layout``, the
# checkpoint id as a path) and nothing else. Each is a plain value or a dataclass whose
# construction runs no code of consequence; anything else, even a class importable from a
# ``torch.distributed.checkpoint`` module (TCPStore, Connection, ThreadPoolExecutor are), is refused.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(_dcp_metadata_names() | {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    *{(mod, cls) for mod in ("pathlib", "pathlib._local")
      for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")},
})


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only :data:`ALLOWED_GLOBALS` and torch's dtype / layout /
    memory-format constants (Python docs, "Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None),
                                            (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in ALLOWED_GLOBALS:
            return getattr(importlib.import_module(module), name)
        raise UnsafeCheckpointError(
            f"checkpoint index refers to {module}.{name}, which a DCP index never holds; refusing "
            "to load it (tampered, or not a checkpoint written by flowrl)")


def read_metadata(path: str | os.PathLike[str],
                  index_file: str | os.PathLike[str] | None = None) -> Metadata:
    """The DCP index (``Metadata``) of the checkpoint folder ``path`` (or the file
    ``index_file``), read by the restricted unpickler: nothing outside :data:`ALLOWED_GLOBALS` is
    ever constructed or called.

    Raises:
        UnsafeCheckpointError: the index refers to a class or function outside the allow-list.
        CorruptCheckpointError: the file is missing, truncated or not a DCP index.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    f_path = Path(index_file) if index_file is not None else Path(path) / ".metadata"
    try:
        with open(f_path, "rb") as f:
            md = _RestrictedUnpickler(f).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # EOFError, UnpicklingError, OSError...: unreadable, not dangerous
        raise CorruptCheckpointError(f"{f_path}: unreadable DCP index ({e!r})") from e
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{f_path}: holds a {type(md).__name__}, not a DCP Metadata")
    return md


class CorruptCheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded (truncated, empty or missing files)."""


def _rename_corrupt(path: Path) -> Path:
    """Rename ``path`` to ``step_N.corrupt``, or ``step_N.corrupt.K`` (the first K free) when a
    checkpoint of that step was set aside before: kept for inspection, never replaced (an older
    one was deleted without a word; fresh-user report). Returns the new path."""
    bad, k = path.with_name(path.name + ".corrupt"), 0
    while bad.exists():
        k += 1
        bad = path.with_name(f"{path.name}.corrupt.{k}")
    os.replace(path, bad)
    return bad


def _why_corrupt(path: Path) -> str:
    try:
        verify_checkpoint(path)
        return "loadable"
    except CorruptCheckpointError as e:
        return str(e)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check that ``path`` is a loadable checkpoint without loading any tensor: its
    ``trainer_state.json`` parses, its index passes the restricted unpickler, and every data
    file the index names exists and is long enough for the bytes it should hold.

    Returns: the ``trainer_state.json`` mapping.

    Raises:
        UnsafeCheckpointError: a tampered index (see :func:`read_metadata`).
        CorruptCheckpointError: anything that would make the load fail, naming the file.
    """
    path = Path(path)
    try:
        meta = json.loads((path / _META).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path / _META}: {e}") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CorruptCheckpointError(f"{path / _META}: no integer 'step'")
    md = read_metadata(path)
    ends: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in ends.items():
        f = path / rel
        size = f.stat().st_size if f.is_file() else -1
        if size < end:
            raise CorruptCheckpointError(f"{f}: {'missing' if size < 0 else f'{size} bytes'}, "
                                         f"the index needs {end}")
    _check_sums(path)
    return meta


def file_checksums(folder: Path, names: list[str]) -> dict[str, str]:
    """``{name: CRC-32 as 8 hex digits}`` of the files ``names`` in ``folder``, read in 16 MiB
    chunks, the files side by side in threads (zlib releases the GIL while it sums)."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    def crc(name: str) -> str:
        c = 0
        with open(folder / name, "rb") as f:
            while chunk := f.read(_SUM_CHUNK):
                c = zlib.crc32(chunk, c)
        return f"{c:08x}"

    with ThreadPoolExecutor(max_workers=min(8, max(len(names), 1))) as pool:
        return dict(zip(names, pool.map(crc, names)))


# (checkpoint path, its checksums file's mtime) already summed and found intact in this process:
# start-up verifies the chosen checkpoint several times (latest, previous, load)
_SUMS_OK: set[tuple[str, int]] = set()


def _check_sums(path: Path) -> None:
    """Compare ``path``'s files with the CRC-32 recorded at save (``checksums.json``; a checkpoint
    written before flowrl recorded them has none: nothing to compare).

    Raises:
        CorruptCheckpointError: a recorded file missing or changed since the save, naming it.
    """
    sums_file = path / _SUMS
    if not sums_file.is_file():
        return
    key = (str(path.resolve()), sums_file.stat().st_mtime_ns)
    if key in _SUMS_OK:
        return
    try:
        recorded = json.loads(sums_file.read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{sums_file}: {e}") from e
    if not isinstance(recorded, dict):
        raise CorruptCheckpointError(f"{sums_file}: not a JSON object")
    missing = [n for n in recorded if not (path / n).is_file()]
    if missing:
        raise CorruptCheckpointError(f"{path / missing[0]}: missing (recorded at save)")
    now = file_checksums(path, sorted(recorded))
    changed = [n for n in sorted(recorded) if now[n] != recorded[n]]
    if changed:
        raise CorruptCheckpointError(
            f"{path / changed[0]}: its bytes changed since the save (CRC-32 {now[changed[0]]}, "
            f"recorded {recorded[changed[0]]})" + (f"; {len(changed) - 1} more file(s) too"
                                                   if len(changed) > 1 else ""))
    _SUMS_OK.add(key)


class WeightsOnlyReader(FileSystemReader):
    """DCP reader whose ``.metadata`` index is read by :func:`read_metadata` (DCP's own reader
    uses plain ``pickle.load``): a tampered checkpoint cannot run code or open a connection on
    load. Tensor payloads and non-tensor values are already read by DCP with
    ``torch.load(weights_only=True)``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata(self.path, self._get_metadata_path(kwargs.get("rank")))
        # None, or absent from an index an older torch pickled
        storage: Optional[StorageMeta] = getattr(metadata, "storage_meta", None)
        if storage is None:
            storage = metadata.storage_meta = StorageMeta()
        storage.load_id = self.load_id
        return metadata


# --------------------------------------------------------------------------- disk space
def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested dict/list (a DTensor: this rank's shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def free_bytes(path: Path) -> int:
    """Bytes available to this user on the file system holding ``path`` (its nearest existing
    ancestor)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def describe_fs(path: Path) -> str:
    """``the file system at <mount point> (<device>)`` holding ``path``."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    dev = ""
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) > 2 and parts[1] == str(mount):
                dev = f" ({parts[0]}, {parts[2]})"
    except OSError:
        pass
    return f"the file system at {mount}{dev}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _causes(e: BaseException) -> list[BaseException]:
    """The exceptions behind ``e``: each rank's for DCP's CheckpointException, else ``e``."""
    if isinstance(e, CheckpointException) and e.failures:
        return [exc for exc, _ in e.failures.values()]
    return [e]


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT anywhere in the exception chain, or torch's zip writer's short-write
    error (``unexpected pos``), which is how a full disk shows up inside ``torch.save``."""
    import errno

    seen = 0
    cur: Optional[BaseException] = e
    while cur is not None and seen < 10:
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(cur) or "unexpected pos" in str(cur):
            return True
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return False


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new file, a rename) durable (POSIX; no-op where a
    directory cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
