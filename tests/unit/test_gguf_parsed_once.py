"""``gguf_parsed_once`` (flowrl/models/loading.py): while transformers loads a GGUF checkpoint, one
reader per file and one tensor-name map per (arch, blocks), then gguf's own functions back. Run
against a stand-in ``gguf`` module (counts constructions); the real SmolLM2 load with and without
it is compared in tests/integration/test_smollm2_gguf_load.py (slow tier)."""
from __future__ import annotations

import sys
import types

import pytest

from flowrl.models.loading import gguf_parsed_once


@pytest.fixture
def fake_gguf(monkeypatch):
    mod = types.ModuleType("gguf")
    built = {"readers": 0, "maps": 0}

    class GGUFReader:
        def __init__(self, path, mode="r"):
            built["readers"] += 1
            self.path, self.mode = path, mode

    def get_tensor_name_map(arch, n_blocks):
        built["maps"] += 1
        return {"arch": arch, "n": n_blocks}

    mod.GGUFReader, mod.get_tensor_name_map = GGUFReader, get_tensor_name_map
    monkeypatch.setitem(sys.modules, "gguf", mod)
    return mod, built


def test_one_reader_per_file_and_one_map_per_arguments(fake_gguf):
    mod, built = fake_gguf
    real_reader, real_map = mod.GGUFReader, mod.get_tensor_name_map
    with gguf_parsed_once():
        from gguf import GGUFReader, get_tensor_name_map  # as transformers imports them

        a, b, c = GGUFReader("/m/x.gguf"), GGUFReader("/m/x.gguf"), GGUFReader("/m/y.gguf")
        maps = [get_tensor_name_map(7, 30) for _ in range(397)] + [get_tensor_name_map(7, 24)]
    assert a is b and a is not c and built["readers"] == 2
    assert built["maps"] == 2 and maps[0] is maps[396] and maps[-1] == {"arch": 7, "n": 24}
    assert (mod.GGUFReader, mod.get_tensor_name_map) == (real_reader, real_map)  # restored


def test_restored_when_the_load_raises(fake_gguf):
    mod, _ = fake_gguf
    real_reader = mod.GGUFReader
    with pytest.raises(RuntimeError, match="bad file"):
        with gguf_parsed_once():
            raise RuntimeError("bad file")
    assert mod.GGUFReader is real_reader
    assert mod.GGUFReader("/m/x.gguf") is not mod.GGUFReader("/m/x.gguf")  # no caching outside


def test_without_gguf_it_does_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with gguf_parsed_once():
        pass
