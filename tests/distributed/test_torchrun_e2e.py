"""`flowrl train launcher.nproc=2` (torchrun, 2 gloo ranks) end to end, export, resume at 1 rank."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ARGS = ["model=tiny", "trainer=smoke", "data.limit=64", "logger.progress=false",
        "logger.tensorboard=false", "trainer.eval.before=false", "trainer.eval.after=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def flowrl(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "flowrl.cli", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_two_ranks_train_export_and_resume_on_one(tmp_path):
    run = tmp_path / "run"
    flowrl("train", "launcher.nproc=2", *ARGS, f"trainer.output_dir={run}",
           "trainer.save_every=1", "trainer.async_save=true")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "perf/step_s" in r]
    assert steps == [1, 2]  # rank 0 alone writes: each step once
    for r in rows:
        if "perf/step_s" in r:
            assert r["data/prompts"] == 2 * 2  # prompts_per_step × 2 ranks (summed)
            assert r["rollout/logprob_mismatch"] < 1e-4  # synced rollout copy == FSDP actor
            assert "perf/offload_s" in r and "perf/onload_s" in r
            assert r["perf/weight_sync_bytes"] > 0  # gathered from the shards
    ckpt = run / "checkpoints" / "step_000002"
    meta = json.loads((ckpt / "trainer_state.json").read_text())
    assert meta["world_size"] == 2 and meta["model"]["tiny"]["hidden_size"] == 64
    assert (run / "checkpoints" / "step_000001" / ".metadata").is_file()  # the async save landed

    out = tmp_path / "hf"
    flowrl("export", str(ckpt), str(out))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    dcp_to_torch_save(str(ckpt), str(tmp_path / "flat.pt"))
    saved = torch.load(tmp_path / "flat.pt", weights_only=True)["actor"]["model"]
    hf = AutoModelForCausalLM.from_pretrained(out)
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)

    flowrl("train", *ARGS, f"trainer.output_dir={run}", "trainer.total_steps=3",
           "trainer.resume=true")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "perf/step_s" in r] == [1, 2, 3]
    assert (run / "checkpoints" / "step_000003" / ".metadata").is_file()


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_ctrl_c_on_two_ranks_ends_in_one_resume_line(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole process group: torchrun's agent and both ranks):
    one `interrupted` line with the resume command, the job's last, no traceback of the agent or
    of a rank whose teardown caught torchrun's forwarded second SIGINT; exit status 130."""
    import signal
    import time

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flowrl.cli", "train", "launcher.nproc=2", *ARGS,
                             "trainer.total_steps=500", "trainer.save_every=1",
                             f"trainer.output_dir={run}"], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step_000002" / ".metadata").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.count("flowrl train: interrupted") == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("flowrl train: interrupted. Continue from step_"), last
    assert f"hydra.run.dir={run} trainer.resume=true launcher.nproc=2" in last
