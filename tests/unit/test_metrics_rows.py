"""metrics.jsonl holds exactly one row per step (later metrics of the last step are merged into
its row), a resumed run drops the rows it redoes, a cut-short last line is tolerated, and the
console neither wraps lines when stdout is a file nor shows a train bar during the eval."""
import io
import json

import pytest
from rich.console import Console

from flowrl.config import LoggerConfig
from flowrl.runtime.io import metrics as M
from flowrl.runtime.io.metrics import MetricsLogger, read_metrics

QUIET = LoggerConfig(console=False, progress=False, tensorboard=False)


def lines(d):
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def test_one_row_per_step(tmp_path):
    with MetricsLogger(tmp_path, QUIET, 3) as log:
        log.log(0, {"eval/accuracy": 0.25})
        log.log(1, {"reward/mean": 0.5, "perf/step_s": 2.0})
        log.log(1, {"perf/checkpoint_s": 0.75})          # checkpoint time: same step
        log.log(2, {"reward/mean": float("nan")})
        log.log(2, {})                                    # nothing: no bare {"step": 2} row
        log.log(3, {"reward/mean": 1.0})
        log.log(3, {"perf/checkpoint_s": 0.5})
        log.log(3, {"eval/accuracy": 0.5, "reward/mean": 0.9})  # eval after: merged, wins
    assert lines(tmp_path) == [
        {"step": 0, "eval/accuracy": 0.25},
        {"step": 1, "reward/mean": 0.5, "perf/step_s": 2.0, "perf/checkpoint_s": 0.75},
        {"step": 2, "reward/mean": None},
        {"step": 3, "reward/mean": 0.9, "perf/checkpoint_s": 0.5, "eval/accuracy": 0.5}]
    assert read_metrics(tmp_path)[3]["perf/checkpoint_s"] == 0.5


def test_a_resumed_run_drops_the_rows_it_redoes(tmp_path):
    # an interrupted run logged steps 3 and 4 after its last checkpoint (step 2); an older
    # version also wrote a checkpoint row of its own, and the kill cut the last line short
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "eval/accuracy": 0.1}\n{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n'
        '{"step": 2, "perf/checkpoint_s": 3}\n{"step": 3, "a": 3}\n{"step": 4, "a"')
    with MetricsLogger(tmp_path, QUIET, 5, first_step=3) as log:
        log.log(3, {"a": 30})
    assert lines(tmp_path) == [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "a": 1},
                               {"step": 2, "a": 2, "perf/checkpoint_s": 3}, {"step": 3, "a": 30}]
    # from step 1 (no checkpoint to resume from): the eval at step 0 is redone too
    with MetricsLogger(tmp_path, QUIET, 5, first_step=1) as log:
        log.log(1, {"a": 10})
    assert lines(tmp_path) == [{"step": 1, "a": 10}]


def test_reader_merges_old_files_and_skips_a_cut_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 1, "b": 2}\n{"step": 2')
    assert read_metrics(tmp_path) == {1: {"step": 1, "a": 1, "b": 2}}
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not valid JSON"):
        read_metrics(tmp_path)


@pytest.mark.parametrize("uid", [0, 9])
def test_tensorboard_hides_the_redone_steps(tmp_path, monkeypatch, uid):
    """uid 9: the two writers' files get the per-process counters 9 and 10, which TensorBoard's
    name order reads 10 first when both are created in the same second (the suite's flake):
    the resumed writer waits for the next second, so its file sorts last."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(uid))
    cfg = LoggerConfig(console=False, progress=False, jsonl=False, tensorboard=True)
    with MetricsLogger(tmp_path, cfg, 4) as log:
        for step in (1, 2, 3):
            log.log(step, {"a": float(step)})
    with MetricsLogger(tmp_path, cfg, 4, first_step=3) as log:  # resumed from step 2
        log.log(3, {"a": 30.0})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("a")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_console_lines_are_not_wrapped_when_stdout_is_a_file(tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(M, "Console", lambda **kw: Console(file=out, **kw))
    cfg = LoggerConfig(progress=False, jsonl=False, tensorboard=False)
    with MetricsLogger(tmp_path, cfg, 2) as log:
        log.log(1, {k: 0.5 for k, _, _ in M._CONSOLE_KEYS if k != "store/peak_bytes"})
    text = out.getvalue().rstrip("\n")
    assert "\n" not in text and len(text) > 200 and text.startswith("step    1 reward=0.500")


def test_eta_and_clock(monkeypatch):
    monkeypatch.setattr(M.time, "perf_counter", lambda: 130.0)
    assert M._eta(100.0, 3, 10) == pytest.approx(70.0)  # 10 s a step, 7 to go
    assert M._eta(100.0, 0, 10) is None
    assert (M._clock(70.0), M._clock(3723.4), M._clock(None)) == ("0:01:10", "1:02:03", "-:--:--")


def test_eval_has_its_own_progress_and_the_train_bar_starts_with_training(tmp_path, monkeypatch):
    monkeypatch.setattr(M, "Console", lambda **kw: Console(file=io.StringIO(), force_terminal=True,
                                                           **kw))
    cfg = LoggerConfig(console=False, jsonl=False, tensorboard=False)
    log = MetricsLogger(tmp_path, cfg, 10)
    tasks = lambda: [(t.description, t.completed, t.total) for t in log._progress.tasks]  # noqa: E731
    update = log.eval_progress("eval before")
    update(0, 32)
    assert tasks() == [("eval before", 0, 32)]  # no "train 0/10" while the eval runs
    update(16, 32)
    assert log._progress.tasks[0].fields["info"].startswith("eta ")
    update(32, 32)
    assert tasks() == []
    log.set_progress(4)  # resumed after step 4
    log.log(5, {"perf/step_s": 1.0, "reward/mean": 0.5})
    assert tasks() == [("train", 5, 10)]
    assert "eta 0:00:" in log._progress.tasks[0].fields["info"]
    log.close()


def test_progress_in_a_file_is_plain_lines_as_they_happen(tmp_path, monkeypatch):
    """stdout in a file (issue 27): rich drew the bar, ETA included, only when it stopped; a
    file now gets each eval and train progress line when it happens."""
    out = io.StringIO()
    monkeypatch.setattr(M, "Console", lambda **kw: Console(file=out, **kw))
    now = [100.0]
    monkeypatch.setattr(M.time, "perf_counter", lambda: now[0])
    log = MetricsLogger(tmp_path, LoggerConfig(jsonl=False, tensorboard=False), 4)
    with log:
        update = log.eval_progress("eval before")  # t0 = 100
        for t, done in ((100, 0), (110, 8), (115, 16), (150, 24)):
            now[0] = t
            update(done, 32)  # a line at the start, then once 30 s have passed: at 150
        assert out.getvalue().splitlines() == ["eval before 0/32 greedy decoding",
                                               "eval before 24/32 eta 0:00:17"]
        now[0] = 160.0
        log.set_progress(0)
        now[0] = 200.0  # eta: 40 s a step x 3
        log.log(1, {"perf/step_s": 40.0, "reward/mean": 0.25})  # 200: eta 40 s x 3
    assert out.getvalue().splitlines()[2:] == [
        "step    1 reward=0.250 step_s=40.0", "train 1/4  reward 0.250  step 40.0s  eta 0:02:00"]


def test_an_sft_update_shows_its_loss_on_the_console(tmp_path, monkeypatch):
    """graph=sft_teacher's step line showed gnorm but no loss (fresh-user report)."""
    out = io.StringIO()
    monkeypatch.setattr(M, "Console", lambda **kw: Console(file=out, **kw))
    cfg = LoggerConfig(progress=False, jsonl=False, tensorboard=False)
    with MetricsLogger(tmp_path, cfg, 2) as log:
        log.log(1, {"actor/sft_loss": 1.25, "actor/grad_norm": 0.5})
    assert out.getvalue().strip() == "step    1 sft=1.2500 gnorm=0.500"


def test_a_partitioned_step_shows_what_the_train_pool_waited(tmp_path, monkeypatch):
    """The train pool's wait for the rollout pool's batch was only in metrics.jsonl
    (fresh-user report); it is where a partitioned step's time goes."""
    out = io.StringIO()
    monkeypatch.setattr(M, "Console", lambda **kw: Console(file=out, **kw))
    cfg = LoggerConfig(progress=False, jsonl=False, tensorboard=False)
    with MetricsLogger(tmp_path, cfg, 2) as log:
        log.log(2, {"perf/step_s": 0.589, "perf/recv_wait_s/train": 0.256})
    assert out.getvalue().strip() == "step    2 step_s=0.6 wait=0.26"
