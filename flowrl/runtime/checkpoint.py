"""Checkpoints with torch.distributed.checkpoint (DCP): atomic directories, newest-complete resume.

Layout: ``<root>/step_000004/`` holds the DCP shards of the tensor state (model, optimizer,
scheduler, RNG) and ``trainer_state.json`` (step, data position: plain JSON, so nothing is ever
unpickled on load). A save is written to ``step_000004.tmp`` and renamed only when complete, so a
save killed half-way is never picked up by resume.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_META = "trainer_state.json"


class CheckpointManager:
    """Args: root: checkpoint folder; keep_last: complete checkpoints kept (older ones deleted)."""

    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write ``tensors`` (nested dict of tensors, DCP) and ``meta`` (JSON-able) for ``step``."""
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        dcp.save(tensors, checkpoint_id=str(tmp))
        (tmp / _META).write_text(json.dumps({"step": step, **meta}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

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
        dcp.load(tensors, checkpoint_id=str(path))
        return json.loads((path / _META).read_text())

    def _prune(self) -> None:
        for p in self.complete()[: -self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)
