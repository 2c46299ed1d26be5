"""End-to-end `flowrl train` on a tiny random model: metrics, checkpoint, resume, Hydra sweeps."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.config import compose
from flowrl.train import train

REPO = Path(__file__).resolve().parents[2]
BASE = ["model=tiny", "trainer=smoke", "data.limit=64", "logger.progress=false",
        "logger.tensorboard=true", "trainer.eval.limit=4"]


def run(tmp: Path, *overrides: str) -> dict:
    cfg = compose(BASE + [f"trainer.output_dir={tmp}", *overrides])
    return train(cfg)


def read_metrics(d: Path) -> dict[int, dict]:
    rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
    out: dict[int, dict] = {}
    for r in rows:
        out.setdefault(r["step"], {}).update(r)
    return out


def weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt_dir), str(ckpt_dir / "flat.pt"))
    sd = torch.load(ckpt_dir / "flat.pt", weights_only=False)
    return {k: v for k, v in sd["actor"]["model"].items()}


def test_two_steps_metrics_and_checkpoint(tmp_path):
    summary = run(tmp_path)
    m = read_metrics(tmp_path)
    assert sorted(m) == [0, 1, 2]  # 0 = eval before training
    for step in (1, 2):
        row = m[step]
        for key in ("reward/mean", "reward/std", "reward/accuracy", "response/length_mean",
                    "response/length_max", "response/truncated_frac", "actor/pg_loss",
                    "actor/entropy", "actor/clipfrac", "actor/grad_norm",
                    "rollout/logprob_mismatch", "perf/step_s", "perf/tokens_per_s",
                    "store/peak_bytes", "time/rollout", "time/update"):
            assert key in row, key
        # on-policy HF rollout sharing the actor's weights: sampler and trainer agree
        assert row["rollout/logprob_mismatch"] < 1e-4
        # the lifecycle manager keeps less alive than keeping every intermediate would
        assert 0 < row["store/peak_bytes"] < row["store/keep_all_bytes"]
        assert row["actor/optimizer_steps"] == 1
    assert "eval/accuracy" in m[0] and m[0]["eval/n"] == 4
    assert summary["eval_after"]["eval/n"] == 4
    ckpt = tmp_path / "checkpoints" / "step_000002"
    assert (ckpt / ".metadata").is_file() and (ckpt / "trainer_state.json").is_file()
    assert list((tmp_path / "tb").iterdir()), "TensorBoard events written"
    assert "ExecutionPlan" in (tmp_path / "plan.txt").read_text()


def test_resume_continues_like_an_uninterrupted_run(tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    off = ["trainer.eval.before=false", "trainer.eval.after=false"]
    run(straight, "trainer.total_steps=3", *off)
    run(interrupted, "trainer.total_steps=2", *off)
    meta2 = json.loads((interrupted / "checkpoints/step_000002/trainer_state.json").read_text())
    run(interrupted, "trainer.total_steps=3", "trainer.resume=true", *off)
    a, b = read_metrics(straight), read_metrics(interrupted)
    assert sorted(b) == [1, 2, 3]  # resumed at step 3, not from scratch
    for key in ("reward/mean", "response/length_mean", "actor/pg_loss", "actor/grad_norm",
                "actor/entropy"):
        assert b[3][key] == pytest.approx(a[3][key], rel=1e-5, abs=1e-7), key
    meta_a = json.loads((straight / "checkpoints/step_000003/trainer_state.json").read_text())
    meta_b = json.loads((interrupted / "checkpoints/step_000003/trainer_state.json").read_text())
    assert meta_a["prompts"] == meta_b["prompts"] != meta2["prompts"]  # same data position
    wa = weights(straight / "checkpoints/step_000003")
    wb = weights(interrupted / "checkpoints/step_000003")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_kl_run_uses_ref_stage(tmp_path):
    run(tmp_path, "algorithm.kl_coef=0.05", "trainer.total_steps=1", "trainer.eval.before=false",
        "trainer.eval.after=false")
    row = read_metrics(tmp_path)[1]
    assert "time/ref_logprobs" in row and "actor/kl_loss" in row
    # the actor and the reference start from the same weights: k3 at the first step is ~0
    assert abs(row["actor/kl_loss"]) < 1e-6


def test_hydra_multirun_sweep(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "flowrl.train", "-m", *BASE, "trainer.total_steps=1",
           "trainer.eval.before=false", "trainer.eval.after=false", "logger.tensorboard=false",
           "algorithm.kl_coef=0,0.01", f"hydra.sweep.dir={tmp_path}"]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in runs] == ["0", "1"]
    for p, kl in zip(runs, (0.0, 0.01)):
        assert (p / "metrics.jsonl").is_file() and (p / "checkpoints/step_000001").is_dir()
        cfg = (p / ".hydra" / "overrides.yaml").read_text()
        assert f"algorithm.kl_coef={kl:g}" in cfg
    assert "time/ref_logprobs" not in read_metrics(runs[0])[1]
    assert "time/ref_logprobs" in read_metrics(runs[1])[1]


def test_skipping_old_logprobs_gives_the_same_update(tmp_path):
    """One on-policy update: π_old = current policy, so the recomputed old logprobs add nothing —
    the weights after the step and the mismatch metric must match the run that recomputes them."""
    off = ["trainer.total_steps=1", "trainer.eval.before=false", "trainer.eval.after=false"]
    run(tmp_path / "recompute", *off)
    run(tmp_path / "skip", *off, "algorithm.recompute_old_logprobs=false")
    a, b = read_metrics(tmp_path / "recompute")[1], read_metrics(tmp_path / "skip")[1]
    assert "time/old_logprobs" in a and "time/old_logprobs" not in b
    assert b["rollout/logprob_mismatch"] < 1e-4
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert b["actor/ratio_abs_dev"] == 0.0
    wa = weights(tmp_path / "recompute" / "checkpoints/step_000001")
    wb = weights(tmp_path / "skip" / "checkpoints/step_000001")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_train_rejects_bad_config_in_one_line_before_loading_anything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flowrl.train", "model=tiny", "trainer.total_steps=0",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "flowrl train: error: invalid config: trainer.total_steps must be >= 1, got 0"]
    assert not (tmp_path / "run").exists()  # no .hydra/, no empty train.log: nothing at all


def test_a_data_refusal_only_the_tokenizer_can_make_is_one_line_and_leaves_nothing(tmp_path):
    # every prompt over data.max_prompt_tokens is known once the job has the tokenizer (after
    # the run directory is locked): still one line, no model loaded, the directory removed
    r = subprocess.run([sys.executable, "-m", "flowrl.train", "model=tiny", "trainer=smoke",
                        "data.max_prompt_tokens=1", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "flowrl train: error: data: all 7100 prompts of arith/train exceed data.max_prompt_tokens=1")
    assert "Traceback" not in r.stderr + r.stdout and "model loaded" not in r.stdout + r.stderr
    assert not (tmp_path / "run").exists()


def test_resuming_a_finished_run_keeps_its_record(tmp_path, capsys):
    run(tmp_path, "trainer.total_steps=1")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    before = json.loads((tmp_path / "summary.json").read_text())["eval_before"]
    capsys.readouterr()
    summary = run(tmp_path, "trainer.total_steps=1", "trainer.resume=true")
    assert capsys.readouterr().out == ("run already complete at step 1 (trainer.total_steps=1); "
                                       "raise trainer.total_steps to train further\n")
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines  # nothing re-run
    assert summary["eval_before"] == before and "eval_after" in summary


def test_resume_with_no_checkpoint_says_so_on_the_console(tmp_path, capsys):
    """trainer.resume=true where no checkpoint was written starts at step 1 (a requeued job's
    auto-resume) and says so on the console: a mistyped output_dir was an INFO line in the log."""
    run(tmp_path, "trainer.total_steps=1", "trainer.eval.limit=0", "trainer.resume=true")
    out = capsys.readouterr().out
    assert (f"setup: trainer.resume=true but no checkpoint in {tmp_path / 'checkpoints'}: starting "
            "at step 1") in out
    assert json.loads((tmp_path / "summary.json").read_text())["checkpoint"].endswith("step_000001")


def test_resume_names_the_settings_it_changed(tmp_path, capsys):
    """A resume may change a setting (a lower lr to go on with) but says which, on the console
    and in the log; what a resume is expected to change (total_steps, eval, logging) is not
    listed, and an unchanged resume lists nothing."""
    off = ("trainer.eval.before=false", "trainer.eval.after=false")
    run(tmp_path, "trainer.total_steps=1", *off)
    run(tmp_path, "trainer.total_steps=2", "trainer.resume=true", "trainer.eval.limit=2", *off)
    assert "settings changed" not in capsys.readouterr().out
    run(tmp_path, "trainer.total_steps=3", "trainer.resume=true", "algorithm.kl_coef=0.05",
        "trainer.engine.lr=5e-05", *off)
    (line,) = [l for l in capsys.readouterr().out.splitlines() if "settings changed" in l]
    assert line == ("setup: settings changed since step_000002: algorithm.kl_coef: 0.0 -> 0.05; "
                    "trainer.engine.lr: 0.0001 -> 5e-05")


def test_machine_line_names_what_was_resolved(tmp_path, capsys):
    """The console's machine line gives the strategy the engines were built with (auto at one CPU
    rank: local) and what trainer.offload resolved to, not the raw 'auto' (fresh-user check)."""
    run(tmp_path, "trainer.total_steps=1", "trainer.eval.limit=0", "trainer.offload=rollout")
    out = capsys.readouterr().out
    assert ("machine: device=cpu rollout=hf dtype=float32 strategy=local offload=rollout only "
            "(trainer.offload=rollout)") in out


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_a_refused_sweep_leaves_no_multirun_folder(tmp_path):
    """`flowrl train -m` whose first job is refused writes nothing: Hydra's `multirun.yaml` and its
    `multirun/<date>/<time>` folders go with the refusal. A sweep that already ran a job keeps
    its folder (the job's run and `multirun.yaml`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    base = [sys.executable, "-m", "flowrl.train", "-m", *BASE, "trainer.total_steps=1",
            "trainer.eval.before=false", "trainer.eval.after=false", "logger.tensorboard=false"]
    r = subprocess.run([*base, "placement.staleness=2"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "placement.staleness=2 with placement=colocated" in r.stderr
    assert list(tmp_path.iterdir()) == []
    # a later job's placement is checked before job 1 runs: nothing is written either
    r = subprocess.run([*base, "placement.staleness=0,2"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "flowrl train: error: sweep job 2 of 2 (placement.staleness=2): placement.staleness=2 "
        "with placement=colocated"), r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
    # a re-used sweep folder whose job-2 directory holds an older run: refused before job 1
    # (it was refused at job 2's turn, after job 1 had trained)
    sweep = tmp_path / "sweep"
    (sweep / "1").mkdir(parents=True)
    (sweep / "1" / "metrics.jsonl").write_text("")
    r = subprocess.run([*base, "trainer.seed=0,1", f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"flowrl train: error: sweep job 2 of 2 (trainer.seed=1): {sweep / '1'} holds a previous "
        "run (metrics.jsonl): continue it with trainer.resume=true, replace it with "
        "trainer.overwrite=true, or choose another run directory (hydra.sweep.dir=..., with a "
        "hydra.sweep.subdir of its own per job); no job was run"), r.stderr[-2000:]
    assert sorted(p.name for p in sweep.iterdir()) == ["1"]  # job 1 never ran
    assert [p.name for p in (sweep / "1").iterdir()] == ["metrics.jsonl"]
    # with trainer.resume=true the same sweep runs (job 2's folder holds no checkpoint: it starts)
    r = subprocess.run([*base, "trainer.seed=0,1", "trainer.resume=true",
                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert all((sweep / j / "summary.json").is_file() for j in ("0", "1"))


def test_resuming_a_finished_run_from_the_command_line_keeps_its_hydra_record(tmp_path):
    """`flowrl train ... trainer.resume=true` on a finished run: the same one line, exit 0, and the
    run's .hydra/ still holds the config it trained with (Hydra's job rewrote it with the new
    invocation, here one that drops an override; a new user's report)."""
    out = tmp_path / "run"
    base = ["model=tiny", "trainer=smoke", "trainer.total_steps=1", "trainer.eval.before=false",
            "trainer.eval.after=false", "logger.progress=false", f"trainer.output_dir={out}"]
    first = subprocess.run([sys.executable, "-m", "flowrl.train", *base, "trainer.engine.lr=3e-4"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    hydra = {p.name: p.read_text() for p in (out / ".hydra").iterdir()}
    again = subprocess.run([sys.executable, "-m", "flowrl.train", *base, "trainer.resume=true"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.strip().splitlines()[-1] == (
        "run already complete at step 1 (trainer.total_steps=1); raise trainer.total_steps to "
        "train further")
    assert {p.name: p.read_text() for p in (out / ".hydra").iterdir()} == hydra
    assert "trainer.engine.lr=3e-4" in hydra["overrides.yaml"]


def test_resume_past_a_newest_checkpoint_whose_shard_is_damaged_in_place(tmp_path):
    """A shard overwritten in place (its length kept: no size check sees it) made every resume
    fail the same way, with a traceback and a resume command that failed again (fresh-user
    report). The run resumes from the checkpoint before it and sets the damaged one aside."""
    out = tmp_path / "run"
    base = ["model=tiny", "trainer=smoke", "trainer.save_every=1", "trainer.eval.before=false",
            "trainer.eval.after=false", "logger.progress=false", f"trainer.output_dir={out}"]
    first = subprocess.run([sys.executable, "-m", "flowrl.train", *base], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002"]
    shards = sorted((ckpts / "step_000002").glob("*.distcp"))
    for shard in shards:
        shard.write_bytes(b"\0" * shard.stat().st_size)
    # flowrl export of it: one line naming the file its recorded checksum catches, nothing written
    exp = subprocess.run([sys.executable, "-m", "flowrl.cli", "export", str(ckpts / "step_000002"),
                          str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert exp.returncode == 2 and "Traceback" not in exp.stderr
    assert exp.stderr.strip().splitlines()[-1].startswith(
        f"flowrl export: error: {shards[0]}: its bytes changed since the save (CRC-32 ")
    assert not (tmp_path / "hf").exists()
    # a checkpoint without recorded checksums (written before flowrl recorded them): the damage
    # shows only when its tensors load; the job then resumes from the one before it
    (ckpts / "step_000002" / "checksums.json").unlink()
    again = subprocess.run([sys.executable, "-m", "flowrl.train", *base, "trainer.resume=true",
                            "trainer.total_steps=3"], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    said = [ln for ln in again.stdout.splitlines() if "did not load" in ln or "set aside" in ln]
    assert len(said) == 2, said
    assert "resume: " in said[0] and "step_000002 did not load (" in said[0] and \
        "its tensors did not load" in said[0] and said[0].endswith("moved to step_000002.corrupt")
    assert said[1] == ("setup: resuming from step_000001 instead (step_000002 set aside as "
                       "step_000002.corrupt)")
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [2, 3]  # step 2 trained again, then step 3
    # trainer.keep_last=2 pruned step 1; the damaged copy is kept for inspection, never pruned
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000002.corrupt",
                                                       "step_000003"]


@pytest.mark.slow  # default tier time (CI runs the slow tier too: .ci/run)
def test_a_refused_resume_keeps_the_runs_hydra_record(tmp_path):
    """A resume refused inside the job (its checkpoint does not read) exits 2 in one line, and
    the run's .hydra/ still holds the config it trained with: Hydra's job had rewritten it with
    the refused invocation's (a new user's report)."""
    out = tmp_path / "run"
    base = ["model=tiny", "trainer=smoke", "trainer.total_steps=1", "trainer.eval.before=false",
            "trainer.eval.after=false", "logger.progress=false", f"trainer.output_dir={out}"]
    first = subprocess.run([sys.executable, "-m", "flowrl.train", *base],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    hydra = {p.name: p.read_text() for p in (out / ".hydra").iterdir()}
    for f in (out / "checkpoints").glob("step_*/*.distcp"):
        f.write_bytes(b"not a checkpoint")
    again = subprocess.run([sys.executable, "-m", "flowrl.train", *base, "trainer.resume=true",
                            "trainer.total_steps=2"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2, again.stderr[-2000:]
    assert again.stderr.strip().splitlines()[-1].startswith("flowrl train: error: ")
    assert {p.name: p.read_text() for p in (out / ".hydra").iterdir()} == hydra


@pytest.mark.parametrize("change, named", [
    ("data.arith.digits=3", "data.arith.digits: 2 -> 3"),
    ("data.limit=32", "data.limit: 64 -> 32"),
])
def test_resume_with_other_data_is_refused_before_the_model_loads(tmp_path, change, named,
                                                                   monkeypatch):
    """A resume whose prompts differ from the checkpoint's (its place in the data cannot be
    continued) is one line naming the data setting, before any model loads; it was a traceback
    after the model load (fresh-user report)."""
    from flowrl.runtime.control.preflight import ConfigError

    off = ("trainer.eval.before=false", "trainer.eval.after=false")
    run(tmp_path, "trainer.total_steps=1", *off)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.setattr("flowrl.runtime.step.resources.build_engines",
                        lambda *a, **k: pytest.fail("a model was built"))
    with pytest.raises(ConfigError) as e:
        run(tmp_path, "trainer.total_steps=2", "trainer.resume=true", change, *off)
    assert str(e.value).startswith(f"trainer.resume: step_000001 drew its prompts from other data "
                                   f"than this run's ({named}): its place in the data cannot be "
                                   "continued (")
    assert str(e.value).endswith("resume with the checkpoint's data settings, or start a new run "
                                 "(another hydra.run.dir)")
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_resumed_interrupted_run_keeps_its_eval_before_in_the_summary(tmp_path):
    """An interrupted run wrote no summary.json; its resume's summary takes eval_before from the
    step-0 row of metrics.jsonl (it had none; fresh-user report)."""
    run(tmp_path, "trainer.total_steps=1", "trainer.eval.limit=2", "trainer.eval.after=false")
    first = json.loads((tmp_path / "summary.json").read_text())["eval_before"]
    (tmp_path / "summary.json").unlink()  # what an interrupted run leaves
    run(tmp_path, "trainer.total_steps=2", "trainer.resume=true", "trainer.eval.after=false")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_before"] == first and first["eval/n"] == 2.0
    assert [h["step"] for h in summary["history"]] == [1, 2]


def test_resume_lines_are_said_once_and_kept_in_train_log(tmp_path):
    """The start-up console lines also go to train.log (a log.info twin doubled them on the
    console; fresh-user report): run as a user does, `flowrl train`."""
    common = [*BASE, f"hydra.run.dir={tmp_path}", "trainer.eval.before=false",
              "trainer.eval.after=false"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    flowrl = [sys.executable, "-m", "flowrl.cli", "train", *common]
    subprocess.run([*flowrl, "trainer.total_steps=1"], env=env, check=True, capture_output=True,
                   timeout=300)
    r = subprocess.run([*flowrl, "trainer.total_steps=2", "trainer.resume=true",
                        "trainer.engine.lr=5e-05"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    said = (r.stdout + r.stderr).splitlines()
    line = (f"setup: resumed from {tmp_path}/checkpoints/step_000001 in ")
    assert len([x for x in said if line in x]) == 1
    assert len([x for x in said if "settings changed since step_000001" in x]) == 1
    log = (tmp_path / "train.log").read_text()
    assert log.count(line) == 1 and ": continuing at step 2 of 2\n" in log
    assert log.count("setup: settings changed since step_000001: trainer.engine.lr: 0.0001 -> "
                     "5e-05\n") == 1
    # the console's step and checkpoint lines too (train.log stopped at "step 1 done")
    step2 = next(x for x in said if x.startswith("step    2 reward="))
    assert log.count(f"] - {step2}\n") == 1
    assert log.count(f"] - checkpoint: {tmp_path}/checkpoints/step_000002\n") == 1
