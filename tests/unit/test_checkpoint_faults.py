"""Checkpoints under faults (issue 15): a tampered index is refused with no side effect, a full
disk gives a clear error and leaves no partial folder, stale ``.tmp`` folders are removed at
start, a corrupt newest checkpoint falls back to the previous one, and publishing fsyncs."""
from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from flowrl.runtime.io import checkpoint as ck
from flowrl.runtime.io.checkpoint import (
    CheckpointManager,
    CheckpointWriteError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    verify_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


def state(v: float) -> dict:
    return {"actor": {"model": {"w": torch.full((4, 4), v), "b": torch.arange(3.0) + v}},
            "rng": {"torch": torch.get_rng_state()}}


def saved(root: Path, *steps: int, meta: dict | None = None) -> CheckpointManager:
    m = CheckpointManager(root, keep_last=10)
    for s in steps:
        m.save(s, state(float(s)), meta or {"history": []})
    return m


def loaded(m: CheckpointManager, path: Path) -> float:
    t = state(-1.0)
    m.load(path, t)
    return float(t["actor"]["model"]["w"][0, 0])


# ------------------------------------------------------------------ 1. tampered index
def _op_str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _op_int(i: int) -> bytes:
    return b"J" + struct.pack("<i", i)


def tcpstore_gadget(port: int) -> bytes:
    """Pickle opcodes for ``TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=3))``, each
    class re-labelled under a ``torch.distributed.checkpoint`` module that imports it."""
    td = (b"ctorch.distributed.checkpoint.staging\ntimedelta\n(" + _op_int(0) + _op_int(3)
          + b"tR")
    return (b"ctorch.distributed.checkpoint._async_process_executor\nTCPStore\n("
            + _op_str("127.0.0.1") + _op_int(port) + _op_int(1) + b"\x89" + td + b"tR")


def tamper(ckpt: Path, port: int) -> None:
    """Rewrite ``ckpt/.metadata`` with its ``planner_data`` replaced by the gadget."""
    md = ck.read_metadata(ckpt)
    md.planner_data = "__TAMPER__"
    raw = pickle.dumps(md, protocol=2)  # protocol 2: no frames, so ops can be spliced
    assert raw.count(_op_str("__TAMPER__")) == 1
    (ckpt / ".metadata").write_bytes(raw.replace(_op_str("__TAMPER__"), tcpstore_gadget(port)))


@contextmanager
def listener():
    """A local TCP port that records every connection made to it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    seen: list = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                c, addr = srv.accept()
                seen.append(addr)
                c.close()
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], seen
    finally:
        stop.set()
        t.join()
        srv.close()


@pytest.mark.parametrize("module, name", [
    ("torch.distributed.checkpoint._async_process_executor", "TCPStore"),
    ("torch.distributed.checkpoint._async_process_executor", "PrefixStore"),
    ("torch.distributed.checkpoint._experimental.checkpoint_process", "Connection"),
    ("torch.distributed.checkpoint.staging", "ThreadPoolExecutor"),
    ("torch.distributed.checkpoint.staging", "timedelta"),
    ("torch.distributed.checkpoint.metadata", "dataclass"),
    ("builtins", "eval"), ("os", "system"), ("torch", "load"),
])
def test_index_unpickler_refuses_everything_off_the_allow_list(module, name):
    with pytest.raises(UnsafeCheckpointError, match=f"{module}.{name}"):
        ck._RestrictedUnpickler(io.BytesIO(b"")).find_class(module, name)


def test_a_real_index_needs_only_the_allow_list(tmp_path):
    m = saved(tmp_path, 1)
    seen = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append((module, name))
            return super().find_class(module, name)
    with open(tmp_path / "step_000001/.metadata", "rb") as f:
        Recorder(f).load()
    off_list = {(mod, n) for mod, n in seen
                if (mod, n) not in ck.ALLOWED_GLOBALS and mod != "torch"}
    assert not off_list
    assert loaded(m, m.latest()) == 1.0


def test_resume_refuses_a_tampered_index_before_anything_is_written(tmp_path):
    from flowrl.config import compose
    from flowrl.train import ConfigError, train

    saved(tmp_path / "checkpoints", 1)
    with listener() as (port, seen):
        tamper(tmp_path / "checkpoints/step_000001", port)
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        cfg = compose(["model=tiny", "trainer=smoke", f"trainer.output_dir={tmp_path}",
                       "trainer.resume=true", "logger.tensorboard=false"])
        with pytest.raises(ConfigError, match="TCPStore.*refusing"):
            train(cfg)
    assert seen == []  # no connection was attempted
    # nothing written but the run directory's lock file, kept by design (runtime/io/rundir.py)
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != ".flowrl.lock")
    assert after == before


def test_export_refuses_a_tampered_index_without_connecting_or_writing(tmp_path):
    from flowrl.config import compose, to_train_config

    model = dataclasses.asdict(to_train_config(compose(["model=tiny",
                                                        f"trainer.output_dir={tmp_path}"])).model)
    saved(tmp_path / "ckpts", 1, meta={"model": model})
    out = tmp_path / "exported"
    with listener() as (port, seen):
        tamper(tmp_path / "ckpts/step_000001", port)
        try:
            proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "export",
                                   str(tmp_path / "ckpts/step_000001"), str(out)],
                                  cwd=REPO, capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        except subprocess.TimeoutExpired:
            proc = None
    assert seen == [], "export connected to the address in the tampered index"
    assert proc is not None and proc.returncode == 2, proc and proc.stderr[-2000:]
    assert "TCPStore" in proc.stderr and "refusing" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


# ------------------------------------------------------------------ 5. disk full
class _Disk:
    """A disk that takes ``capacity`` more bytes, then fails writes with ENOSPC, as a full
    file system does (patched into DCP's file system streams)."""

    def __init__(self, capacity: int):
        self.left = capacity

    def stream(self, inner):
        disk = self

        class Limited:
            def write(self, b):
                n = len(memoryview(b).cast("B"))
                if n > disk.left:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.left -= n
                return inner.write(b)

            def __getattr__(self, name):  # tell, seek, fileno, flush...: the real file's
                return getattr(inner, name)
        return Limited()


@pytest.fixture
def full_disk(monkeypatch):
    from torch.distributed.checkpoint import filesystem

    disk = _Disk(1 << 30)
    orig = filesystem.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with orig(self, path, mode) as s:
            yield disk.stream(s) if "w" in mode else s
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    return disk


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_is_named_leaves_no_partial_folder_and_resume_works_after(
        tmp_path, full_disk, monkeypatch, async_save):
    m = saved(tmp_path, 1)
    full_disk.left = 300  # a few hundred bytes into the next save
    with pytest.raises(CheckpointWriteError) as e:
        m.save(2, state(2.0), {"history": []}, async_save=async_save)
        m.wait()
    msg = str(e.value)
    assert "checkpoint step 2 not saved" in msg and "no space left on device" in msg
    assert "the file system at /" in msg and "needs about" in msg and "free" in msg
    assert "step_000001" in msg and "trainer.resume=true" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # no step_000002.tmp
    assert loaded(m, m.resume_point()) == 1.0
    full_disk.left = 1 << 30  # space is back
    m.save(2, state(2.0), {"history": []})
    assert loaded(m, m.resume_point()) == 2.0


def test_save_checks_free_space_before_writing(tmp_path, monkeypatch):
    m = saved(tmp_path, 1)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))
    with pytest.raises(CheckpointWriteError, match=r"has 1000 B free, this checkpoint needs about"):
        m.save(2, state(2.0), {"history": []})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


def test_ctrl_c_during_a_save_is_an_interrupt_not_a_disk_error(tmp_path, monkeypatch):
    """DCP wraps a Ctrl-C in its write into a CheckpointException; that was reported as "writing
    ... failed (KeyboardInterrupt: ) ... Fix the cause" (fresh-user report). It is re-raised as
    KeyboardInterrupt, with the partial folder removed."""
    from torch.distributed.checkpoint.api import CheckpointException

    m = saved(tmp_path, 1)

    def interrupted(*a, **k):
        raise CheckpointException("save", {0: (KeyboardInterrupt(), None)})

    monkeypatch.setattr("torch.distributed.checkpoint.save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m.save(2, state(2.0), {"history": []})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


def test_stale_tmp_folders_are_removed_at_start(tmp_path):
    m = saved(tmp_path, 1)
    (tmp_path / "step_000002.tmp").mkdir()
    (tmp_path / "step_000002.tmp/__0_0.distcp").write_bytes(b"x" * 100)
    m.remove_stale()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]


# ------------------------------------------------------------------ 6. corrupt newest, fsync
@pytest.mark.parametrize("damage", ["empty_json", "truncated_shard", "truncated_index",
                                    "deleted_index", "deleted_json"])
def test_resume_falls_back_past_a_corrupt_newest_checkpoint(tmp_path, damage):
    # deleted_*: a published folder missing a file was passed over in silence as "incomplete",
    # and the resumed run later overwrote it (fresh-user report); saves publish by renaming a
    # complete folder, so it is damage, set aside as the others are
    m = saved(tmp_path, 1, 2)
    newest = tmp_path / "step_000002"
    if damage == "empty_json":
        (newest / "trainer_state.json").write_text("")
    elif damage == "deleted_index":
        (newest / ".metadata").unlink()
    elif damage == "deleted_json":
        (newest / "trainer_state.json").unlink()
    elif damage == "truncated_shard":
        shard = next(newest.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:50])
    else:
        idx = newest / ".metadata"
        idx.write_bytes(idx.read_bytes()[:40])
    assert m.latest() == tmp_path / "step_000001"
    chosen = m.resume_point()
    assert chosen == tmp_path / "step_000001" and loaded(m, chosen) == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002.corrupt"]


def test_a_shard_changed_after_the_save_is_caught_by_its_checksum(tmp_path):
    """Bytes overwritten in place (the length kept) pass a length check; the CRC-32 recorded at
    save names the file, and resume falls back past it as past any corrupt checkpoint."""
    m = saved(tmp_path, 1, 2)
    newest = tmp_path / "step_000002"
    sums = json.loads((newest / "checksums.json").read_text())
    assert sorted(sums) == sorted(p.name for p in newest.iterdir()
                                  if p.name not in ("checksums.json", "trainer_state.json"))
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of tensor data
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{shard}: its bytes changed since the save "
                                                     rf"\(CRC-32 [0-9a-f]{{8}}, recorded {sums[shard.name]}\)"):
        verify_checkpoint(newest)
    assert m.latest() == tmp_path / "step_000001"
    assert m.resume_point() == tmp_path / "step_000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002.corrupt"]


def test_a_damaged_shard_without_recorded_checksums_fails_its_load_by_name(tmp_path):
    """A checkpoint saved before checksums were recorded: the damage shows at load, which names
    the checkpoint and the cause; previous() finds the older one, set_aside() renames."""
    m = saved(tmp_path, 1, 2)
    newest = tmp_path / "step_000002"
    (newest / "checksums.json").unlink()
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(b"\0" * shard.stat().st_size)
    assert m.latest() == newest  # nothing a length check can see
    with pytest.raises(CorruptCheckpointError, match=r"step_000002: its tensors did not load \("):
        loaded(m, newest)
    assert m.previous(newest) == tmp_path / "step_000001" and m.previous(tmp_path / "step_000001") is None
    assert loaded(m, m.previous(newest)) == 1.0
    assert m.set_aside(newest, "damaged") == tmp_path / "step_000002.corrupt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002.corrupt"]
    assert m.resume_point() == tmp_path / "step_000001"


def test_no_loadable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    m = saved(tmp_path, 1)
    (tmp_path / "step_000001/trainer_state.json").write_text("{")
    with pytest.raises(CorruptCheckpointError, match="no loadable checkpoint.*step_000001"):
        m.resume_point()
    assert (tmp_path / "step_000001").is_dir()  # nothing moved


def test_publishing_fsyncs_the_state_file_and_both_directories(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(a)))
        return real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    saved(tmp_path, 1)
    tmp = str(tmp_path / "step_000001.tmp")
    i = events.index(("replace", tmp))
    assert ("fsync", tmp + "/trainer_state.json") in events[:i]
    assert ("fsync", tmp) in events[:i]
    assert ("fsync", str(tmp_path)) in events[i:]


def test_export_says_what_it_was_given_wrong_in_one_line(tmp_path, capsys):
    """Fresh-user report: a mistyped option was reported as a model override named after the
    checkpoint path; a non-model override silently replaced the recorded model (a size mismatch
    at load); --role of a role the checkpoint lacks was a missing-key traceback."""
    from flowrl.export import export_main

    saved(tmp_path / "ck", 1)
    ckpt, out = tmp_path / "ck" / "step_000001", tmp_path / "out"
    for argv, said in [
        ([str(ckpt), str(out), "--adaptor-only"],
         "unrecognized option --adaptor-only (did you mean --adapter-only?)"),
        ([str(ckpt), str(out), "algorithm.kl_coef=0.5", "model=tiny"],
         "only model settings apply to an export (model=..., model.<field>=...), got "
         "algorithm.kl_coef=0.5; without any, the checkpoint's recorded model is used")]:
        with pytest.raises(SystemExit) as e:
            export_main(argv)
        assert e.value.code == 2 and capsys.readouterr().err.strip().endswith(said)
    with pytest.raises(ValueError, match=r"^export: .*step_000001 holds no role 'critic' \(--role\); "
                                         r"its roles: actor$"):
        export_main([str(ckpt), str(out), "--role", "critic", "model=tiny"])
    assert not out.exists()


def test_a_second_damaged_checkpoint_of_a_step_is_set_aside_beside_the_first(tmp_path):
    """The second set-aside of step 2 replaced the first step_000002.corrupt without a word."""
    m = saved(tmp_path, 1, 2)
    (tmp_path / "step_000002" / ".metadata").unlink()
    assert m.resume_point() == tmp_path / "step_000001"
    (tmp_path / "step_000002.corrupt" / "MARKER").write_text("first")
    m.save(2, state(2.0), {"history": []})
    (tmp_path / "step_000002" / "trainer_state.json").write_text("")
    assert m.resume_point() == tmp_path / "step_000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000001", "step_000002.corrupt", "step_000002.corrupt.1"]
    assert (tmp_path / "step_000002.corrupt" / "MARKER").read_text() == "first"
    m.save(2, state(2.0), {"history": []})  # and set_aside (a load that failed) does the same
    assert m.set_aside(tmp_path / "step_000002", "its tensors did not load") == \
        tmp_path / "step_000002.corrupt.2"
