"""Messages that say what happened and what to change, in one line: a model folder without a
model, a missing checkpoint for export (answered before torch is imported)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.config import compose
from flowrl.train import ConfigError, prepare

REPO = Path(__file__).resolve().parents[2]


def test_a_model_folder_without_a_model_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        prepare(compose([f"model.path={tmp_path}", f"trainer.output_dir={tmp_path / 'run'}"]))
    assert str(e.value) == (
        f"invalid config: model.path {str(tmp_path)!r} holds no Hugging Face model (no config.json): "
        "point it at a model directory (save_pretrained output), or use model=smollm2 / model=tiny")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # weights, no tokenizer
    with pytest.raises(ConfigError, match=r"holds no Hugging Face model \(no tokenizer files "
                                          r"\(tokenizer.json / tokenizer_config.json"):
        prepare(compose([f"model.path={tmp_path}", f"trainer.output_dir={tmp_path / 'run'}"]))


def test_export_of_a_missing_checkpoint_says_not_found_before_importing_torch(tmp_path):
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    code = ("import sys; from flowrl.cli import main; rc = main(['export', sys.argv[1], 'out']); "
            "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "checkpoints" / "step_000003")],
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "False"]
    assert r.stderr.strip() == (f"flowrl export: error: no checkpoint at "
                                f"{tmp_path}/checkpoints/step_000003 (not found; "
                                f"{tmp_path}/checkpoints has step_000002)")


@pytest.mark.parametrize("given", ["run", "checkpoints"])
def test_export_of_a_run_directory_names_its_newest_checkpoint(tmp_path, given):
    """A run directory (or its checkpoints/ folder) given for a checkpoint: the newest complete
    one is named (it said only that the run directory is not a complete checkpoint)."""
    from flowrl.export import export_checkpoint

    for step in (2, 10):
        ckpt = tmp_path / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text("{}")
        (ckpt / ".metadata").write_bytes(b"")
    (tmp_path / "checkpoints" / "step_000012").mkdir()  # an unfinished save: not offered
    where = tmp_path if given == "run" else tmp_path / "checkpoints"
    with pytest.raises(FileNotFoundError) as e:
        export_checkpoint(where, tmp_path / "out")
    assert str(e.value) == (f"export: {where} holds checkpoints but is not one: give one of them, "
                            f"e.g. {tmp_path}/checkpoints/step_000010 (the newest of 2)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["file", "full", "overwrite", "parent_file"])
def test_export_refuses_an_out_dir_it_would_clobber_before_importing_torch(tmp_path, case):
    ckpt = tmp_path / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    out = tmp_path / "out"
    if case == "file":
        out.write_text("notes")
    elif case == "parent_file":
        (tmp_path / "notes").write_text("notes")
        out = tmp_path / "notes" / "sub"
    else:
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "notes.txt").write_text("mine")
    extra = ", '--overwrite'" if case == "overwrite" else ""
    code = (f"import sys; from flowrl.cli import main; rc = main(['export', sys.argv[1], sys.argv[2]{extra}]); "
            "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(ckpt), str(out)], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=120)
    # refused before torch loads; past the check (--overwrite), the checkpoint's own check answers
    assert r.stdout.split() == ["2", "True" if case == "overwrite" else "False"]
    expected = {
        "file": f"export: {out} is a file, not a directory: choose a new directory",
        "parent_file": f"export: {out} cannot be created: {tmp_path / 'notes'} is a file",
        "full": f"export: {out} already holds config.json, notes.txt: choose a new or empty "
                "directory, or pass --overwrite to write over it",
        # --overwrite passes the check: the next one (an empty checkpoint folder) answers
        "overwrite": f"export: {ckpt} is not a complete flowrl checkpoint (needs "
                     "trainer_state.json and .metadata)"}[case]
    assert r.stderr.strip() == f"flowrl export: error: {expected.removeprefix('export: ')}"
    if case == "file":
        assert out.read_text() == "notes"
    elif case == "parent_file":
        assert (tmp_path / "notes").read_text() == "notes"
    else:
        assert (out / "notes.txt").read_text() == "mine"
