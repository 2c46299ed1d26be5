"""Pre-flight in one place, run once, before any model loads, and fast: a rejected config answers
before torch is imported, and the check before Hydra's job starts is the job's (not repeated)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What the run config reads of algorithms/losses.py (its registries' names); a stand-in module so
# this test measures the entry, the config schema and the pre-flight, whatever that module imports
LOSSES_STUB = ("import sys, types; m = types.ModuleType('flowrl.algorithms.losses'); "
               "m.POLICY_LOSSES = dict.fromkeys(['ppo_clip', 'gspo', 'vanilla']); "
               "m.ROLLOUT_IS = dict.fromkeys(['none', 'tis']); "
               "sys.modules['flowrl.algorithms.losses'] = m; ")


def test_a_config_typo_is_rejected_before_torch_is_imported(tmp_path):
    code = LOSSES_STUB + (
        "from flowrl.cli import main\n"
        "try:\n    main(['train', 'algorithm.n=0'])\n"
        "except SystemExit as e:\n"
        "    heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'})\n"
        "    print(e.code, heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert r.stdout.split("\n")[0] == "2 []", r.stdout + r.stderr[-2000:]
    assert r.stderr.strip() == "flowrl train: error: invalid config: algorithm.n must be >= 1, got 0"
    assert not list(tmp_path.iterdir())  # Hydra wrote no run directory


def test_the_preflight_is_the_jobs(tmp_path, monkeypatch, capsys):
    """``flowrl train``: ``prepare`` checks the run (graph loaded once), then the job
    starts (stopped here where it would create the process group) without checking it again."""
    from flowrl.cli import main
    from flowrl.graph import validate

    loads = []
    original = validate.load_graph

    def counted(path):
        loads.append(Path(path).name)
        return original(path)

    class Started(Exception):
        pass

    def started(*a, **k):
        raise Started()

    monkeypatch.setattr(validate, "load_graph", counted)  # the run loads its graph through it
    monkeypatch.setattr("flowrl.runtime.io.distributed.init_distributed", started)
    monkeypatch.setattr(sys, "argv", ["flowrl"])
    with pytest.raises(SystemExit) as e:  # the crash report of Started (exit status 1)
        main(["train", "model=tiny", "trainer=smoke", f"hydra.run.dir={tmp_path / 'run'}"])
    assert e.value.code == 1 and "stopped by Started" in capsys.readouterr().err
    assert loads == ["grpo.yaml"]
