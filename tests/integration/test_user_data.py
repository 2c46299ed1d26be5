"""Your own data end to end on the tiny model (a jsonl with a user reward reading extra fields, a
parquet with chat messages), eval scored by the graph's verifier, and the run directory: one
metrics row per step, a refused second run that keeps the first run's record, a resume that drops
the rows it redoes, a bad row or config rejected before anything is written, and a clean console.

The reward functions below are the "user's" (pytest puts this folder on sys.path, so the graph
names them ``test_user_data:<function>``)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.config import compose
from flowrl.runtime.io.metrics import read_metrics
from flowrl.train import ConfigError, train

REPO = Path(__file__).resolve().parents[2]
BASE = ["model=tiny", "trainer=smoke", "logger.progress=false", "logger.tensorboard=false"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
SEEN: list[dict] = []


def bonus_reward(response_text, fields, metadata):
    """Reads an extra column: the row's ``bonus`` (1.0 for every row of the file below)."""
    SEEN.append(dict(fields))
    return float(fields["bonus"])


def text_reward(response_text, fields, metadata):
    """A reward that varies with the response (its CRC), so a group's advantages are not 0."""
    import zlib

    return (zlib.crc32(response_text.encode()) % 1000) / 1000


def run(out: Path, *overrides: str) -> dict:
    return train(compose(BASE + [f"trainer.output_dir={out}", *overrides]))


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def write_jsonl(path: Path, rows_: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


def function_graph(tmp: Path, fn: str = "bonus_reward") -> Path:
    """graphs/grpo.yaml with the rule reward replaced by the user function ``fn`` above."""
    text = (REPO / "graphs/grpo.yaml").read_text()
    text = text.replace("  op: reward.rule\n", "  op: reward.function\n  params:\n"
                        f"    path: test_user_data:{fn}\n    num_workers: 0\n")
    text = text.replace("    ground_truth: sample.ground_truth\n",
                        "    ground_truth: sample.ground_truth\n    group_id: sample.group_id\n", 1)
    g = tmp / "function_grpo.yaml"
    g.write_text(text)
    return g


def test_a_user_jsonl_with_a_user_reward_reading_extra_fields(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": f"Say the word number {i}.", "answer": str(i), "bonus": 1.0, "topic": f"t{i}"}
        for i in range(6)])
    evals = write_jsonl(tmp_path / "eval.jsonl", [
        {"prompt": "Say yes.", "answer": "yes", "bonus": 1.0, "topic": "e0"},
        {"prompt": "Say no.", "answer": "no", "bonus": 1.0, "topic": "e1"}])
    SEEN.clear()
    summary = run(tmp_path / "run", f"graph.path={function_graph(tmp_path)}", f"data.path={data}",
                  f"data.eval_path={evals}", "data.ground_truth_key=answer",
                  "data.extra_keys=[bonus,topic]")
    m = read_metrics(tmp_path / "run")
    assert sorted(m) == [0, 1, 2]
    assert m[1]["reward/mean"] == m[2]["reward/mean"] == 1.0  # every row's bonus
    # eval is scored by the graph's verifier (the user function: 1.0), not a GSM8K check (0.0)
    assert summary["eval_before"]["eval/accuracy"] == summary["eval_after"]["eval/accuracy"] == 1.0
    assert summary["eval_after"]["eval/n"] == 2.0
    assert "eval/format_frac" not in summary["eval_after"]  # the #### views are GSM8K's
    train_seen = [f for f in SEEN if f["topic"].startswith("t")]
    assert len(train_seen) == 2 * 2 * 4  # 2 steps x 2 prompts x n=4
    for f in train_seen:  # each sample's own row: question, ground truth and extra fields agree
        i = int(f["ground_truth"])
        assert (f["question"], f["topic"], f["bonus"]) == (f"Say the word number {i}.", f"t{i}", 1.0)
    assert {f["topic"] for f in SEEN} >= {"e0", "e1"}


def test_a_user_parquet_of_chat_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def chat(i):
        return [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": f"What is {i} + {i}?"}]

    pq.write_table(pa.Table.from_pylist([{"messages": chat(i), "sum": 2 * i} for i in range(6)]),
                   tmp_path / "train.parquet")
    summary = run(tmp_path / "run", f"data.path={tmp_path / 'train.parquet'}",
                  f"data.eval_path={tmp_path / 'train.parquet'}", "data.prompt_key=messages",
                  "data.ground_truth_key=sum", "trainer.eval.limit=3")
    m = read_metrics(tmp_path / "run")
    assert sorted(m) == [0, 1, 2] and m[2]["data/prompts"] == 2.0
    assert summary["eval_after"]["eval/n"] == 3.0 and "eval/format_frac" in summary["eval_after"]
    answers = [json.loads(x) for x in (tmp_path / "run/eval_after.jsonl").read_text().splitlines()]
    assert [a["ground_truth"] for a in answers] == ["0", "2", "4"]


def test_bad_rows_are_rejected_before_the_run_directory_is_touched(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "1"}, {"prompt": "y"}])
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/d.jsonl line 2: no field 'answer'$"):
        run(tmp_path / "run", f"data.path={data}", "data.ground_truth_key=answer",
            f"data.eval_path={data}")
    # a ground truth the graph's GSM8K verifier cannot read: named by line and field
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "1"},
                                               {"prompt": "y", "answer": "forty-two"}])
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/d.jsonl line 2: field 'answer': gsm8k "
                                          r"ground_truth must hold a number, got 'forty-two' \(the "
                                          r"graph's reward.rule gsm8k \(stage 'reward'\)\)$"):
        run(tmp_path / "run", f"data.path={data}", "data.ground_truth_key=answer",
            "trainer.eval.limit=0")
    # every bad row of both kinds in one line, in the file's order (a missing field on line 3
    # was said alone, line 2's unreadable answer only on the next try, the rest one run each)
    gsm8k = (r"field 'answer': gsm8k ground_truth must hold a number, got '{}' \(the graph's "
             r"reward.rule gsm8k \(stage 'reward'\)\)")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "1"},
                                               {"prompt": "y", "answer": "seven"}, {"prompt": "z"}])
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/d.jsonl line 2: {gsm8k.format('seven')}; "
                                          r"line 3: no field 'answer'$"):
        run(tmp_path / "run", f"data.path={data}", "data.ground_truth_key=answer",
            "trainer.eval.limit=0")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "z", "answer": None},
                                               {"prompt": "y", "answer": "seven"},
                                               {"prompt": "w", "answer": ""}, {"answer": "3"},
                                               {"prompt": "v"}])
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/d.jsonl line 1: field 'answer' \(the "
                                          r"ground truth\) must be a string or a number, got null; line "
                                          rf"2: {gsm8k.format('seven')}; line 3: "
                                          rf"{gsm8k.format('')} \(and 2 more rows with problems\)$"):
        run(tmp_path / "run", f"data.path={data}", "data.ground_truth_key=answer",
            "trainer.eval.limit=0")
    # unreadable answers alone: every one, counted past the first three
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": w}
                                               for w in ("one", "2", "three", "four", "five")])
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/d.jsonl line 1: {gsm8k.format('one')}; "
                                          rf"line 3: {gsm8k.format('three')}; line 4: "
                                          rf"{gsm8k.format('four')} \(and 1 more row with "
                                          r"problems\)$"):
        run(tmp_path / "run", f"data.path={data}", "data.ground_truth_key=answer",
            "trainer.eval.limit=0")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "answer": "1"}])
    with pytest.raises(ConfigError, match="is a single file, so it has no held-out split"):
        run(tmp_path / "run", f"data.path={data}", "data.ground_truth_key=answer")
    # no answer column under a rule verifier would score every sample unscorable: refused
    with pytest.raises(ConfigError, match=r"^data.ground_truth_key=null, but stage 'reward' "
                                          r"\(reward.rule, verifier 'gsm8k'\) scores each response"):
        run(tmp_path / "run", f"data.path={data}", "data.ground_truth_key=null",
            "trainer.eval.limit=0")
    assert not (tmp_path / "run").exists()


def test_resume_drops_the_rows_logged_after_the_last_checkpoint(tmp_path):
    """A run killed after logging step 3 but before its checkpoint finished (here: the step-3
    checkpoint removed) resumes from step 2: every step has exactly one row."""
    import shutil

    out = tmp_path / "run"
    run(out, "trainer.total_steps=3", "trainer.save_every=2", "trainer.keep_last=3",
        "data.limit=32", "trainer.eval.after=false")
    shutil.rmtree(out / "checkpoints/step_000003")
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3]
    run(out, "trainer.total_steps=3", "trainer.save_every=2", "trainer.resume=true",
        "data.limit=32")
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3]  # step 3 once: the redone one
    assert "eval/accuracy" in rows(out)[3] and "perf/checkpoint_s" in rows(out)[3]


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowrl.train", *BASE, "data.limit=32", *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_cli_one_row_per_step_clean_console_and_a_refused_second_run(tmp_path):
    d = tmp_path / "run"
    r = cli(f"hydra.run.dir={d}", "trainer.save_every=1", "logger.progress=true")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [x["step"] for x in rows(d)]
    assert steps == [0, 1, 2]  # eval before, two steps with their checkpoint time, eval after
    assert "perf/checkpoint_s" in rows(d)[1] and "eval/accuracy" in rows(d)[2]
    assert "torch.distributed is disabled" not in r.stderr + r.stdout
    step_lines = [x for x in r.stdout.splitlines() if x.startswith("step    1 ")]
    assert len(step_lines) == 1 and "store=" in step_lines[0]  # one line, never wrapped at 80
    out_lines = r.stdout.splitlines()
    assert any(x.startswith("train ") and "2/2" in x and "eta 0:00:00" in x for x in out_lines)
    # issue 27: stdout in a file gets the start-up phases as they end, a plain progress line per
    # step (rich drew its bar only at the end), the checkpoint path at each save and at the end
    firsts = [x.split(" ")[0] for x in out_lines if not x.startswith("[")][:4]
    assert firsts == ["flowrl", "setup:", "setup:", "machine:"], out_lines
    assert [x for x in out_lines if x.startswith("train ")] == [
        x for x in out_lines if x.startswith(("train 1/2  reward ", "train 2/2  reward "))]
    assert f"checkpoint step 1: {d / 'checkpoints' / 'step_000001'}" in out_lines
    assert out_lines[-2] == f"checkpoint: {d / 'checkpoints' / 'step_000002'}"
    # and the run's wall time: where start-up, the steps and the end went (fresh-user report)
    done = re.fullmatch(r"done: ([\d.]+) s since the command started \(step 1 finished at "
                        r"([\d.]+) s, step 2 at ([\d.]+) s\)", out_lines[-1])
    assert done is not None, out_lines[-1]
    assert 0 < float(done[2]) <= float(done[3]) <= float(done[1])
    record = (d / ".hydra/overrides.yaml").read_text()
    metrics = (d / "metrics.jsonl").read_text()
    again = cli(f"hydra.run.dir={d}", "trainer.total_steps=3")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"flowrl train: error: {d} holds a previous run (checkpoints, metrics.jsonl, summary.json "
        "and 3 more): continue it with trainer.resume=true, replace it with "
        "trainer.overwrite=true, or choose another run directory (hydra.run.dir=...)"]
    # the first run's record is intact: Hydra was stopped before it rewrote .hydra/
    assert (d / ".hydra/overrides.yaml").read_text() == record
    assert (d / "metrics.jsonl").read_text() == metrics


def test_the_readmes_worked_example_runs_as_written(tmp_path):
    """The README's "Your own data" bash block, run as a new user would (``flowrl`` = this
    checkout's ``python -m flowrl.cli``), in an empty directory."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Your own data"):]
    block = section[section.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    assert "cat > my_prompts.jsonl" in block and "data.path=my_prompts.jsonl" in block
    script = block.replace("flowrl train", f"{sys.executable} -m flowrl.cli train", 1)
    r = subprocess.run(["bash", "-euc", script], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={**ENV, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "runs/my_data"
    assert [x["step"] for x in rows(out)] == [0, 1, 2]
    answers = [json.loads(x) for x in (out / "eval_after.jsonl").read_text().splitlines()]
    assert [a["ground_truth"] for a in answers] == ["7", "36"]
    config = (out / ".hydra/config.yaml").read_text()
    assert "instruction: Write the final answer on its own line as '#### <number>'." in config


def test_a_sweep_job_that_crashes_does_not_cancel_the_next(tmp_path):
    """`flowrl train -m trainer.engine.lr=1e6,1e-5`: the first job diverges; the second still
    runs, and the sweep's end says which job stopped (it ended the sweep, unsaid; fresh-user
    report)."""
    graph = function_graph(tmp_path, "text_reward")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO)])}
    r = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", "-m", *BASE,
                        f"graph.path={graph}", "trainer.eval.before=false",
                        "trainer.eval.after=false", "trainer.engine.lr=1e6,1e-5",
                        f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "stopped by ParameterDivergenceError" in r.stderr
    last = r.stderr.strip().splitlines()[-1]  # (Hydra writes the job's overrides its own way)
    assert last.startswith("flowrl train: 1 sweep job stopped (the others ran): job 1 (model=tiny")
    assert last.endswith(" trainer.engine.lr=1000000.0): ParameterDivergenceError"), last
    assert [x["step"] for x in rows(tmp_path / "sweep" / "1")] == [1, 2]  # job 2 ran to its end
