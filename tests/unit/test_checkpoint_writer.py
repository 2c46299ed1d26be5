"""The checkpoint writer: one file per tensor for GPU states (DCP's writer otherwise stages a whole
rank's state in host RAM until its single file closes), and such a checkpoint loads back exactly
through the restricted reader."""
import torch

from flowrl.runtime.io import checkpoint as ckpt
from flowrl.runtime.io.checkpoint import CheckpointManager, storage_writer


def test_writer_layout_choice(tmp_path):
    cpu = {"model": {"w": torch.zeros(2)}}
    assert storage_writer(tmp_path, cpu).single_file_per_rank is True  # CPU: nothing is staged
    assert storage_writer(tmp_path, cpu, file_per_tensor=True).single_file_per_rank is False
    meta_state = {"model": {"w": torch.zeros(2, device="meta")}}
    assert ckpt._has_cuda_tensor(meta_state) is False
    assert ckpt._has_cuda_tensor({"a": [1, "x", None]}) is False


def test_file_per_tensor_checkpoint_round_trip(tmp_path, monkeypatch):
    real = storage_writer
    monkeypatch.setattr(ckpt, "storage_writer",
                        lambda path, tensors: real(path, tensors, file_per_tensor=True))
    state = {"model": {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([7, 8])},
             "rng": {"torch": torch.get_rng_state()}}
    mgr = CheckpointManager(tmp_path / "ckpts")
    out = mgr.save(3, state, {"prompts": {"pos": 5}})
    files = sorted(p.name for p in out.iterdir() if p.suffix == ".distcp")
    assert len(files) == 3  # one per tensor (a, b, the RNG state), not one per rank
    into = {"model": {"a": torch.zeros(2, 3), "b": torch.zeros(2, dtype=torch.long)},
            "rng": {"torch": torch.zeros_like(state["rng"]["torch"])}}
    meta = mgr.load(mgr.latest(), into)
    assert torch.equal(into["model"]["a"], state["model"]["a"])
    assert into["model"]["b"].tolist() == [7, 8]
    assert torch.equal(into["rng"]["torch"], state["rng"]["torch"])
    assert meta["step"] == 3 and meta["prompts"] == {"pos": 5}
