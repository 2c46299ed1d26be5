"""The generated arith task under `flowrl train` with the tiny model: the default data
(`data=arith`), held-out evals before, every `trainer.eval.every` steps and after, scored on the
fixed test split; `trainer=gsm8k` switches to GSM8K with one override."""
import json
from pathlib import Path

from flowrl.config import compose
from flowrl.data import load_arith
from flowrl.train import train

BASE = ["model=tiny", "trainer=smoke", "logger.progress=false", "logger.tensorboard=false"]


def test_arith_trains_with_a_held_out_eval_curve(tmp_path: Path):
    out = tmp_path / "run"
    train(compose(BASE + [f"trainer.output_dir={out}", "data=arith", "trainer.total_steps=3",
                          "trainer.eval.every=2", "trainer.eval.limit=4"]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # one line per step, evals merged in
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 3]
    assert all(r["eval/n"] == 4.0 for r in rows if "eval/accuracy" in r)
    assert "reward/mean" in rows[1] and "eval/accuracy" not in rows[1]
    # the eval answers are the first held-out items of the default difficulty, in order
    answers = [json.loads(x) for x in (out / "eval_after.jsonl").read_text().splitlines()]
    assert [a["ground_truth"] for a in answers] == [r["ground_truth"] for r in load_arith("test", 4)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"]["eval/n"] == 4.0


def test_gsm8k_is_one_override_away():
    from flowrl.config import to_train_config

    cfg = to_train_config(compose(["trainer=gsm8k", "trainer.output_dir=/tmp/x"]))
    assert (cfg.data.name, cfg.trainer.total_steps, cfg.rollout.sampling.max_new_tokens) == (
        "gsm8k", 10, 200)
    cfg = to_train_config(compose(["trainer.output_dir=/tmp/x"]))  # the README's `flowrl train`
    assert (cfg.data.name, cfg.trainer.total_steps, cfg.trainer.eval.every) == ("arith", 20, 10)
