"""Fault injection on CPU: what an operator's accidents do to a flowrl run, and what resume gives back.

    python benchmarks/faults.py [--kills 3] [--seed 0] [--only kill,rank,disk,reward,sync,guard,malformed]

Results: benchmarks/results/faults_cpu.md (one table: test, expected, observed, pass).

Every run is ``python -m flowrl.train`` on the tiny random model (``model=tiny trainer=smoke``,
6 steps, a checkpoint every step, eval off) with a deterministic user reward
(``benchmarks/_fault_rewards.py``: the tiny model scores 0 on GSM8K, so without it the advantages
and every update would be 0 and "bit-identical" would prove nothing). Scenarios:

- SIGKILL at a random moment of a step, during a checkpoint save (a ``step_N.tmp`` folder is
  being written), during an ``async_save`` write, and of one rank of a 2-rank (torchrun, gloo)
  job; then ``trainer.resume=true``. Pass: the final checkpoint (weights, AdamW moments,
  scheduler, RNG, sampler position) is bit-identical to an uninterrupted run's.
- A dead rank (SIGKILL) and a frozen rank (SIGSTOP) of a 2-rank job: the job stops (the frozen
  one within ``launcher.heartbeat_timeout_s``, here 15 s), its last line names the rank, its pid
  and the signal or the silence, with the resume command, and resume is bit-identical.
- A full disk (a real tmpfs; needs root to mount, else the rows are skipped): the save is refused
  with a message naming the file system and the bytes, no partial folder is left, and resume
  works once space is back; a stale ``.tmp`` folder that fills the disk is removed at start.
- Reward functions that kill their worker on one sample, hang on one sample (also with SIGALRM
  blocked: the worker is killed at its timeout), or return garbage (a string, None, NaN, 1e39):
  the run completes and only those samples are unscorable.
- A weight sync that reaches nothing (LoRA with its own rollout copy, a loader that copies
  nothing): ``rollout.verify_sync`` stops the run at step 1 naming the engine and the tensors.
- A LoRA sync that sends the base weights (adapters not merged): the readback passes, the
  effective-weight check stops the run at step 1 naming the engine and the tensors.
- Health guards: Dr.GRPO with rewards of ±3e38 (every step skipped) stops at
  ``trainer.max_skipped_steps``; a verifier that raises on every sample stops at
  ``trainer.max_unscorable_steps``; a constant reward is warned about (the message text checked).
- Malformed graphs and configs (the table of ``tests/unit/test_malformed_inputs.py``) through
  ``flowrl graph validate``, ``flowrl plan`` and ``flowrl train`` (in this process, the model
  loader replaced by a tripwire), and one of them as a real ``flowrl train`` process: each is
  refused before any model loads, in one line naming the stage or field and what to change.
- DAPO dynamic sampling that can keep no group (a constant reward): the run stops with one line
  saying which knob to turn and the resume command, no traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import (  # noqa: E402
    REPO_ROOT,
    command_line,
    git_revision,
    machine_info,
    markdown_table,
    text_table,
    utc_now,
    versions,
)

STEPS = 6
BENCH = Path(__file__).resolve().parent


@dataclass
class Row:
    test: str
    expected: str
    observed: str
    ok: Optional[bool]  # None = skipped

    @property
    def verdict(self) -> str:
        return "skipped" if self.ok is None else "pass" if self.ok else "FAIL"


def make_graph(folder: Path, fn: str, base: str = "grpo", **params) -> Path:
    """graphs/<base>.yaml with its reward stage replaced by the user function ``fn``."""
    import yaml

    g = yaml.safe_load((REPO_ROOT / f"graphs/{base}.yaml").read_text())
    reward = next(s for s in g["stages"] if s["name"] == "reward")
    reward.update(op="reward.function", params={"path": f"_fault_rewards:{fn}", **params})
    reward["inputs"]["group_id"] = "sample.group_id"
    path = folder / f"graph_{base}_{fn}.yaml"
    path.write_text(yaml.safe_dump(g, sort_keys=False))
    return path


class Job:
    """One ``flowrl train`` process (``ranks`` > 1: torchrun through ``launcher.nproc``), its
    output in ``<run_dir>.log``."""

    log_dir: Path = Path(tempfile.gettempdir())

    def __init__(self, run_dir: Path, overrides: list[str], ranks: int = 1):
        self.run_dir, self.ranks = run_dir, ranks
        self.log_path = Job.log_dir / f"{run_dir.name}.{int(time.time() * 1e3)}.log"
        module = "flowrl.train" if ranks == 1 else "flowrl.cli"
        argv = [sys.executable, "-m", module] + ([] if ranks == 1 else ["train"])
        argv += [f"hydra.run.dir={run_dir}", *overrides]
        if ranks > 1:
            argv.append(f"launcher.nproc={ranks}")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(BENCH),
               "OMP_NUM_THREADS": "1"}
        self._log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            return self.proc.wait()
        finally:
            self._log.flush()

    def worker(self, rank: int) -> psutil.Process:
        """The process of ``rank`` (a torchrun child with that ``RANK``)."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "flowrl" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        raise RuntimeError(f"no rank {rank} process")

    def kill_all(self) -> None:
        """SIGKILL the whole session (torchrun, its workers, reward workers)."""
        try:
            for p in [*psutil.Process(self.proc.pid).children(recursive=True)]:
                p.send_signal(signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.Error):
            pass

    @property
    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")


def last_line(output: str) -> str:
    """The job's last non-empty line (what the operator reads first)."""
    return next((ln for ln in reversed(output.splitlines()) if ln.strip()), "")


def wait_for(cond: Callable[[], bool], timeout: float, poll: float = 0.005) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(poll)
    return False


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def flat_state(path: Path) -> dict:
    """Every tensor and value of a DCP checkpoint, flattened ``a.b.c -> value``, plus the
    sampler state of ``trainer_state.json``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(str(path), f"{d}/flat.pt")
        sd = torch.load(f"{d}/flat.pt", weights_only=False)
    out: dict = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            out[prefix] = v
    walk("", sd)
    meta = json.loads((path / "trainer_state.json").read_text())
    out["trainer_state.prompts"] = meta["prompts"]
    out["trainer_state.step"] = meta["step"]
    return out


def identical(a: dict, b: dict) -> tuple[bool, str]:
    import torch

    if a.keys() != b.keys():
        return False, f"keys differ: {sorted(a.keys() ^ b.keys())[:3]}"
    for k in a:
        x, y = a[k], b[k]
        same = (torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                else x == y)
        if not same:
            return False, f"{k} differs"
    return True, "bit-identical"


class Bench:
    def __init__(self, root: Path, kills: int, seed: int):
        self.root, self.kills, self.rng = root, kills, random.Random(seed)
        self.rows: list[Row] = []
        self.notes: list[tuple[str, str]] = []  # (scenario, a line of its output)
        Job.log_dir = root / "logs"
        Job.log_dir.mkdir()
        self.graph = make_graph(root, "length_reward")
        self.refs: dict[int, dict] = {}
        self.step_s: dict[int, float] = {}

    def base(self, *extra: str) -> list[str]:
        return ["model=tiny", "trainer=smoke", "data.limit=32", f"graph.path={self.graph}",
                "logger.progress=false", "logger.tensorboard=false", "trainer.eval.before=false",
                "trainer.eval.after=false", f"trainer.total_steps={STEPS}", "trainer.save_every=1",
                "trainer.keep_last=2", *extra]

    def note(self, scenario: str, output: str, text: str) -> None:
        """Keep the last line of ``output`` that contains ``text`` for the results page."""
        lines = [ln for ln in output.splitlines() if text in ln]
        if lines:
            self.notes.append((scenario, lines[-1][:1200]))

    def row(self, *args) -> None:
        r = Row(*args)
        self.rows.append(r)
        print(f"[{r.verdict}] {r.test}: {r.observed}", flush=True)

    # ------------------------------------------------------------------ references
    def reference(self, ranks: int) -> dict:
        if ranks not in self.refs:
            d = self.root / f"ref{ranks}"
            job = Job(d, self.base(), ranks)
            rc = job.wait()
            if rc != 0:
                raise RuntimeError(f"reference run ({ranks} rank) failed:\n{job.output[-3000:]}")
            self.refs[ranks] = flat_state(ckpt(d, STEPS))
            hist = json.loads((ckpt(d, STEPS) / "trainer_state.json").read_text())["history"]
            self.step_s[ranks] = sum(h["perf/step_s"] for h in hist) / len(hist)
        return self.refs[ranks]

    def resume_matches(self, d: Path, ranks: int, *extra: str) -> tuple[bool, str]:
        job = Job(d, self.base("trainer.resume=true", *extra), ranks)
        rc = job.wait()
        if rc != 0:
            return False, f"resume exit {rc}: {job.output.strip().splitlines()[-1][:200]}"
        return identical(flat_state(ckpt(d, STEPS)), self.reference(ranks))

    # ------------------------------------------------------------------ SIGKILL + resume
    def kill_and_resume(self, kind: str, i: int, ranks: int = 1) -> tuple[bool, str]:
        """One random SIGKILL of ``kind`` (step | save | async), then resume and compare."""
        d = self.root / f"kill_{kind}_{ranks}r_{i}"
        extra = ["trainer.async_save=true"] if kind == "async" else []
        job = Job(d, self.base(*extra), ranks)
        k = self.rng.randint(1, STEPS - 1)
        if kind == "step":  # a random moment inside step k + 1
            ok = wait_for(lambda: ckpt(d, k).is_dir() or job.proc.poll() is not None, 300)
            time.sleep(self.rng.uniform(0.0, 0.9 * self.step_s.get(ranks, 1.0)))
            where = f"in step {k + 1}"
        else:  # while step_k.tmp is being written
            tmp = ckpt(d, k).with_name(ckpt(d, k).name + ".tmp")
            ok = wait_for(lambda: tmp.is_dir() or job.proc.poll() is not None, 300, poll=0.001)
            time.sleep(self.rng.uniform(0.0, 0.02))
            where = f"saving step {k}" + (" (tmp present)" if tmp.is_dir() else " (missed: done)")
        if job.proc.poll() is not None or not ok:
            return False, f"run ended before the kill (exit {job.proc.poll()})"
        victim = job.worker(self.rng.randint(0, ranks - 1)) if ranks > 1 else None
        if victim is not None:
            where += f", rank {victim.environ()['RANK']}"
            victim.send_signal(signal.SIGKILL)
            job.wait(120)
        job.kill_all()
        job.wait()
        same, how = self.resume_matches(d, ranks, *extra)
        return same, f"{where}: {how}"

    def kills_row(self, kind: str, label: str, n: int, ranks: int = 1) -> None:
        results = [self.kill_and_resume(kind, i, ranks) for i in range(n)]
        good = sum(ok for ok, _ in results)
        self.row(label, "resume → final checkpoint bit-identical to the uninterrupted run",
                 f"{good}/{n} identical ({'; '.join(w for _, w in results)})", good == n)

    # ------------------------------------------------------------------ dead / frozen rank
    def dead_rank(self) -> None:
        d = self.root / "dead_rank"
        job = Job(d, self.base(), 2)
        wait_for(lambda: ckpt(d, 2).is_dir() or job.proc.poll() is not None, 300)
        victim = job.worker(1)
        victim.send_signal(signal.SIGKILL)
        t = time.monotonic()
        rc = job.wait(300)
        stop_s = time.monotonic() - t
        last = last_line(job.output)
        named = (last.startswith("flowrl train: stopped: rank 1 (host") and
                 f"pid {victim.pid}" in last and "died of SIGKILL" in last)
        hint = "trainer.resume=true" in last
        self.note("dead rank", job.output, "flowrl train: stopped")
        same, how = self.resume_matches(d, 2)
        self.row("a dead rank (SIGKILL of rank 1 of 2)",
                 "job stops; its last line names rank 1, its pid and SIGKILL, and the resume "
                 "command; resume bit-identical",
                 f"exit {rc} after {stop_s:.0f} s; last line names rank, pid, signal: {named}; "
                 f"resume command in it: {hint}; {how}", rc != 0 and named and hint and same)

    def frozen_rank(self) -> None:
        d = self.root / "frozen_rank"
        beat = 15  # launcher.heartbeat_timeout_s; the collective timeout stays at its 600 s
        job = Job(d, self.base(f"launcher.heartbeat_timeout_s={beat}"), 2)
        wait_for(lambda: ckpt(d, 2).is_dir() or job.proc.poll() is not None, 300)
        victim = job.worker(1)
        victim.send_signal(signal.SIGSTOP)
        t = time.monotonic()
        # the survivor's peer monitor stops it once the heartbeat is silent; the launcher
        # SIGKILLs the frozen rank (torchrun's own SIGTERM would wait 30 s for it)
        rc = job.wait(beat + 240)
        stop_s = time.monotonic() - t
        out = job.output
        last = last_line(out)
        named = (last.startswith("flowrl train: stopped: rank 1 (host") and
                 f"pid {victim.pid}" in last and "sent no heartbeat" in last and
                 "the launcher killed it (SIGKILL)" in last)
        hint = "trainer.resume=true" in last
        self.note("frozen rank", out, "flowrl train: stopped")
        job.kill_all()
        same, how = self.resume_matches(d, 2)
        in_time = stop_s < beat + 15  # one beat interval and the exit, not 30 s or 600 s
        self.row(f"a frozen rank (SIGSTOP of rank 1 of 2, heartbeat timeout {beat} s)",
                 f"job stops within ~{beat} s; its last line names rank 1, its pid, the silence "
                 "and the kill, and the resume command; resume bit-identical",
                 f"exit {rc} after {stop_s:.0f} s; last line names rank, pid, silence: {named}; "
                 f"resume command in it: {hint}; {how}",
                 rc != 0 and in_time and named and hint and same)

    # ------------------------------------------------------------------ full disk
    def full_disk(self) -> None:
        mnt = self.root / "tmpfs"
        mnt.mkdir()
        size_mb = 180  # two tiny-model checkpoints (74 MB each) fit, not a third
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mnt)],
                          capture_output=True).returncode != 0:
            for t in ("disk full during a save", "a stale .tmp fills the disk"):
                self.row(t, "clear error, no partial folder, resume once space is back",
                         "skipped: mounting a tmpfs needs root", None)
            return
        try:
            d = mnt / "run"
            job = Job(d, self.base("logger.tensorboard=true"))
            rc = job.wait()
            out = job.output
            msg = next((ln for ln in out.splitlines() if "not saved" in ln), "")
            self.note("disk full", out, "flowrl train: stopped")
            named = "the file system at" in msg and "free" in msg and "needs about" in msg
            left = sorted(p.name for p in (d / "checkpoints").iterdir())
            clean = not any(n.endswith(".tmp") for n in left)
            subprocess.run(["mount", "-o", "remount,size=400m", str(mnt)], check=True)
            same, how = self.resume_matches(d, 1, "logger.tensorboard=true")
            self.row(f"disk full during a save (tmpfs of {size_mb} MB)",
                     "exit with a message naming the file system and the bytes, no partial "
                     "folder, complete checkpoints kept; resume bit-identical once space is back",
                     f"exit {rc}; message names fs + bytes: {named}; left {left}; resume: {how}",
                     rc != 0 and named and clean and left and same)
            # a save killed mid-write left step_000003.tmp, filling the disk; resume must remove
            # it before anything (TensorBoard, metrics) writes
            shutil.rmtree(d)
            subprocess.run(["mount", "-o", "remount,size=260m", str(mnt)], check=True)
            job = Job(d, self.base("logger.tensorboard=true", "trainer.total_steps=2"))
            job.wait()
            stale = ckpt(d, 3).with_name("step_000003.tmp")
            stale.mkdir()
            free = shutil.disk_usage(mnt).free
            with open(stale / "__0_0.distcp", "wb") as f:
                f.write(b"\0" * max(0, free - 4096))
            full = shutil.disk_usage(mnt).free < 1 << 20
            same, how = self.resume_matches(d, 1, "logger.tensorboard=true")
            self.row("a stale .tmp fills the disk (resume after a crash mid-save)",
                     "removed at start; resume completes bit-identical",
                     f"disk full before resume: {full}; stale folder gone: {not stale.exists()}; "
                     f"{how}", full and not stale.exists() and same)
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    # ------------------------------------------------------------------ reward functions
    def _reward_run(self, fn: str, timeout_s: float) -> tuple["Job", int, dict[int, dict]]:
        """Two steps of a graph whose reward stage calls ``fn`` (2 workers, ``timeout_s``):
        the job, its exit code and its metrics by step."""
        d = self.root / f"reward_{fn}"
        graph = make_graph(self.root, fn, num_workers=2, timeout_s=timeout_s)
        job = Job(d, [*self.base(f"graph.path={graph}"), "trainer.total_steps=2"])
        rc = job.wait()
        rows: dict[int, dict] = {}
        if (d / "metrics.jsonl").is_file():
            for line in (d / "metrics.jsonl").read_text().splitlines():
                r = json.loads(line)
                rows.setdefault(r["step"], {}).update(r)
        return job, rc, rows

    def reward_fn(self, fn: str, label: str, expect: dict[str, float]) -> None:
        job, rc, rows = self._reward_run(fn, 2.0)
        got = {s: {k: rows.get(s, {}).get(f"reward/{k}") for k in expect} for s in (1, 2)}
        ok = rc == 0 and all(got[s] == expect for s in (1, 2))
        self.note(label, job.output, "sample(s) unscorable")
        batch = 2 * 4  # smoke: 2 prompts x n=4
        self.row(label, f"run completes; per step of {batch}: "
                 + ", ".join(f"{k}={v:g}" for k, v in expect.items()),
                 f"exit {rc}; " + "; ".join(f"step {s}: " + ", ".join(
                     f"{k}={v}" for k, v in got[s].items()) for s in (1, 2)), ok)

    def deaf_reward(self) -> None:
        """A call that blocks SIGALRM and hangs: its worker process is killed at timeout_s + 1 s
        (before: the batch's backstop, timeout_s * 4 + 5 = 13 s per step here)."""
        fn, timeout = "deaf_hang_on_first", 2.0
        job, rc, rows = self._reward_run(fn, timeout)
        got = {s: (rows.get(s, {}).get("reward/timeouts"), rows.get(s, {}).get("reward/unscorable"),
                   rows.get(s, {}).get("time/reward", float("inf"))) for s in (1, 2)}
        killed = job.output.count("(it ignores SIGALRM?); killing its worker process")
        self.note("reward worker deaf to SIGALRM", job.output, "killing its worker process")
        # the kill at timeout_s + 1 s plus up to two pool spawns (the step's first pool, and
        # the fresh one for the call the kill took down): under the old backstop alone
        backstop = timeout * 4 + 5
        fast = all(t < backstop for _, _, t in got.values())
        self.row(f"reward function blocks SIGALRM and hangs on one sample (timeout_s={timeout:g})",
                 "its worker process is killed at timeout_s + 1 s (logged), run completes; per "
                 "step: timeouts=1, unscorable=1, reward stage under the batch backstop "
                 f"({timeout * 4 + 5:g} s, what it cost before)",
                 f"exit {rc}; kills logged: {killed}; " + "; ".join(
                     f"step {s}: timeouts={a}, unscorable={b}, reward stage {t:.1f} s"
                     for s, (a, b, t) in got.items()),
                 rc == 0 and killed == 2 and fast and
                 all((a, b) == (1, 1) for a, b, _ in got.values()))

    # ------------------------------------------------------------------ weight sync check
    def broken_sync(self) -> None:
        """A LoRA run whose rollout engine holds its own copy (FSDP2 at world size 1) with a
        loader that takes every tensor and copies none (``benchmarks/_fault_sync.py``)."""
        d = self.root / "broken_sync"
        graph = make_graph(self.root, "length_reward")
        import yaml

        g = yaml.safe_load(graph.read_text())
        next(s for s in g["stages"] if s["name"] == "reward")["params"]["path"] = \
            "_fault_sync:length_reward"
        graph = self.root / "graph_broken_sync.yaml"
        graph.write_text(yaml.safe_dump(g, sort_keys=False))
        job = Job(d, [*self.base(f"graph.path={graph}"), "trainer.total_steps=2",
                      "+model.lora.rank=4", "trainer.engine.strategy=fsdp",
                      "trainer.engine.lr=0.05", "rollout.backend=hf"])
        rc = job.wait()
        out = job.output
        last = last_line(out)
        self.note("weight sync that copies nothing", out, "flowrl train: stopped")
        named = last.startswith("flowrl train: stopped: weight sync actor -> rollout "
                                "(HFRolloutEngine) after step 1: the engine does not serve the "
                                "weights it was sent: ") and "q_proj.weight (max |difference|" in last
        self.row("a weight sync that reaches nothing (LoRA, the engine's loader copies nothing)",
                 "exit 1 at step 1: one line naming the engine and the tensors, the resume "
                 "command, no traceback",
                 f"exit {rc}; names engine + tensors at step 1: {named}; resume command: "
                 f"{'trainer.resume' in last or 'trainer.overwrite' in last}; traceback: "
                 f"{'Traceback' in out}", rc == 1 and named and "Traceback" not in out)

    def unmerged_lora_sync(self) -> None:
        """A LoRA run with its own rollout copy whose merge sends the base weights
        (``benchmarks/_fault_lora_merge.py``): the engine holds what was sent, so only the
        effective-weight check sees it."""
        d = self.root / "unmerged_lora_sync"
        graph = self._module_graph("_fault_lora_merge:length_reward", "unmerged")
        job = Job(d, [*self.base(f"graph.path={graph}"), "trainer.total_steps=2",
                      "+model.lora.rank=4", "trainer.engine.strategy=fsdp",
                      "trainer.engine.lr=0.05", "rollout.backend=hf"])
        rc = job.wait()
        out, last = job.output, last_line(job.output)
        self.note("LoRA sync with the adapters not merged", out, "flowrl train: stopped")
        named = last.startswith("flowrl train: stopped: weight sync actor -> rollout "
                                "(HFRolloutEngine) after step 1: the weights sent are not the "
                                "trainer's effective weights: 14 of 14 LoRA-adapted tensors differ")
        self.row("a LoRA sync that sends the base weights (adapters not merged)",
                 "exit 1 at step 1: one line naming the engine, what was synced and the tensors, "
                 "the resume command, no traceback",
                 f"exit {rc}; names engine + tensors at step 1: {named}; resume command: "
                 f"{'trainer.resume' in last or 'trainer.overwrite' in last}; traceback: "
                 f"{'Traceback' in out}", rc == 1 and named and "Traceback" not in out)

    def _module_graph(self, path: str, tag: str, base: str = "grpo") -> Path:
        import yaml

        g = yaml.safe_load(make_graph(self.root, "length_reward", base).read_text())
        next(s for s in g["stages"] if s["name"] == "reward")["params"]["path"] = path
        graph = self.root / f"graph_{tag}.yaml"
        graph.write_text(yaml.safe_dump(g, sort_keys=False))
        return graph

    def guard(self, label: str, fn: str, base: str, extra: list[str], expected: str,
              fragment: str, rc_want: int) -> None:
        """A run whose reward makes a health guard fire: the exit status and the message text
        (``fragment`` in the output's last ``flowrl train: stopped`` line, or in the log for a
        warning that lets the run finish)."""
        d = self.root / f"guard_{fn}"
        job = Job(d, [*self.base(f"graph.path={make_graph(self.root, fn, base)}"), *extra])
        rc = job.wait()
        out = job.output
        said = [ln for ln in out.splitlines() if fragment in ln]
        last = last_line(out)
        resume = rc == 0 or "trainer.resume" in last  # a run that finished needs none
        self.note(label, out, "flowrl train: stopped" if rc else fragment)
        self.row(label, expected,
                 f"exit {rc}; message text found: {bool(said)}; resume command: "
                 f"{'n/a (completed)' if rc == 0 else resume}; traceback: {'Traceback' in out}",
                 rc == rc_want and bool(said) and resume and "Traceback" not in out)

    def guards(self) -> None:
        self.guard("Dr.GRPO with rewards of +-3e38 (every optimizer step skipped), "
                   "trainer.max_skipped_steps=1", "huge", "dr_grpo",
                   ["trainer.total_steps=4", "trainer.max_skipped_steps=1"],
                   "exit 1 at step 2, one line: steps skipped, more than "
                   "trainer.max_skipped_steps=1, the resume command; never exit 0",
                   "2 optimizer steps skipped (non-finite loss or grad norm), more than "
                   "trainer.max_skipped_steps=1", 1)
        self.guard("a verifier that raises on every sample, trainer.max_unscorable_steps=2",
                   "raise_always", "grpo", ["trainer.total_steps=4",
                                            "trainer.max_unscorable_steps=2"],
                   "exit 1 at step 2, one line: no sample could be scored, the resume command",
                   "step 2: no sample could be scored on the last 2 steps", 1)
        self.guard("a reward that is the same for every sample, trainer.constant_reward_steps=2",
                   "constant", "grpo", ["trainer.total_steps=2", "trainer.constant_reward_steps=2"],
                   "run completes (exit 0) with a warning naming the constant reward",
                   "every scorable reward of the last 2 steps was the same", 0)

    # ------------------------------------------------------------------ malformed inputs
    def malformed(self) -> None:
        """The malformed-input table through the three commands, in this process."""
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "malformed_table", REPO_ROOT / "tests/unit/test_malformed_inputs.py")
        table = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(table)
        from flowrl import train
        from flowrl.models import loading

        loaded: list[str] = []

        def tripwire(*a, **k):
            loaded.append("model")
            raise RuntimeError("a model was loaded")

        loading.load_model, train.build_engines = tripwire, tripwire
        work = self.root / "malformed"
        graph_ok, graph_n, bad = 0, 0, []
        for case, (graph, fragment) in sorted(table.GRAPH_CASES.items()):
            for command in ("graph validate", "plan", "train"):
                d = work / f"{case}_{command.replace(' ', '_')}"
                d.mkdir(parents=True)
                path = table.write_graph(d, graph)
                args = ["graph", "validate", str(path)] if command == "graph validate" else \
                    [command, *table.job_args(d, f"graph.path={path}")]
                n_loaded = len(loaded)
                rc, lines = table.run_cli(args, d)
                ok = rc == (1 if command == "graph validate" else 2) and len(lines) == 1 and \
                    fragment in lines[0] and len(loaded) == n_loaded and not (d / "run").exists()
                graph_n += 1
                graph_ok += ok
                if not ok:
                    bad.append(f"{case} ({command}): exit {rc}, {len(lines)} line(s)")
        self.row(f"malformed graphs ({len(table.GRAPH_CASES)} kinds) x graph validate / plan / "
                 "train", "refused before any model loads: exit 1 (validate) or 2, one line "
                 "naming the stage or field and what to change",
                 f"{graph_ok}/{graph_n} refused so" + (f"; not: {'; '.join(bad)}" if bad else ""),
                 graph_ok == graph_n)
        cfg_ok, cfg_n, bad = 0, 0, []
        cases = dict(table.CONFIG_CASES)
        for case, (graph, fragment, _) in table.RUN_CONFIG_GRAPH_CASES.items():
            (work / case).mkdir(parents=True)
            cases[case] = ([f"graph.path={table.write_graph(work / case, graph)}"], fragment)
        for case, (overrides, fragment) in sorted(cases.items()):
            for command in ("plan", "train"):
                d = work / f"cfg_{case}_{command}"
                d.mkdir(parents=True)
                n_loaded = len(loaded)
                rc, lines = table.run_cli([command, *table.job_args(d, *overrides)], d)
                ok = rc == 2 and len(lines) == 1 and fragment in lines[0] and \
                    lines[0].startswith(f"flowrl {command}: error: ") and len(loaded) == n_loaded
                cfg_n += 1
                cfg_ok += ok
                if not ok:
                    bad.append(f"{case} ({command}): exit {rc}, {len(lines)} line(s)")
        self.row(f"malformed configs and run-config graph rules ({len(cases)} kinds) x plan / "
                 "train", "refused before any model loads: exit 2, one line naming the field "
                 "and what to change", f"{cfg_ok}/{cfg_n} refused so"
                 + (f"; not: {'; '.join(bad)}" if bad else ""), cfg_ok == cfg_n)
        # the real command line, as an operator runs it
        graph, fragment = table.GRAPH_CASES["list_into_tensor"]
        d = work / "real_process"
        d.mkdir()
        path = table.write_graph(d, graph)
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "flowrl.cli", "train", "model=tiny",
                               "trainer=smoke", f"graph.path={path}", f"hydra.run.dir={d / 'run'}"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        if lines:
            self.notes.append(("a list wired into a tensor input (flowrl train)", lines[-1]))
        self.row("a list output wired into a tensor input, as a real flowrl train process",
                 "exit 2 before any model loads, one line, no run directory",
                 f"exit {proc.returncode} after {time.monotonic() - t:.0f} s; {len(lines)} line(s); "
                 f"run directory created: {(d / 'run').exists()}",
                 proc.returncode == 2 and len(lines) == 1 and fragment in lines[0]
                 and not (d / "run").exists())

    # ------------------------------------------------------------------ dynamic sampling cap
    def refill_cap(self) -> None:
        d = self.root / "refill_cap"
        graph = make_graph(self.root, "constant", base="dapo")
        import yaml

        g = yaml.safe_load(graph.read_text())
        next(s for s in g["stages"] if s["name"] == "filter")["params"]["max_attempts"] = 2
        graph.write_text(yaml.safe_dump(g, sort_keys=False))
        job = Job(d, [*self.base(f"graph.path={graph}"), "trainer.total_steps=2"])
        rc = job.wait()
        out = job.output
        line = next((ln for ln in out.splitlines() if "flowrl train: stopped" in ln), "")
        self.note("dynamic sampling cap", out, "flowrl train: stopped")
        names = "dynamic sampling kept 0 of the 2 groups" in line and "params.max_attempts" in line
        self.row("DAPO dynamic sampling keeps no group (constant reward, max_attempts=2)",
                 "exit 1, one line naming the stage and the knobs, resume command, no traceback",
                 f"exit {rc}; names stage + knobs: {names}; resume command: "
                 f"{'trainer.resume' in line or 'nothing to resume' in line}; traceback: "
                 f"{'Traceback' in out}", rc == 1 and names and "Traceback" not in out)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=3, help="random SIGKILLs per kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="kill,rank,disk,reward,sync,guard,malformed")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks/results/faults_cpu.md")
    p.add_argument("--keep", action="store_true", help="keep the run folders")
    args = p.parse_args()
    only = set(args.only.split(","))
    root = Path(tempfile.mkdtemp(prefix="flowrl_faults_"))
    t0 = time.monotonic()
    b = Bench(root, args.kills, args.seed)
    try:
        b.reference(1)
        if "kill" in only:
            b.kills_row("step", "SIGKILL at a random moment of a step (1 rank)", args.kills)
            b.kills_row("save", "SIGKILL during a checkpoint save (1 rank)", args.kills)
            b.kills_row("async", "SIGKILL during an async_save write (1 rank)", args.kills)
            b.reference(2)
            b.kills_row("step", "SIGKILL of one rank at a random moment (2 ranks)",
                        max(1, args.kills - 1), ranks=2)
        if "rank" in only:
            b.reference(2)
            b.dead_rank()
            b.frozen_rank()
        if "disk" in only:
            b.full_disk()
        if "reward" in only:
            b.reward_fn("crash_on_first", "reward function kills its worker on one sample",
                        {"errors": 1, "timeouts": 0, "nonfinite": 0, "unscorable": 1})
            b.reward_fn("hang_on_first", "reward function hangs on one sample (timeout_s=2)",
                        {"errors": 0, "timeouts": 1, "nonfinite": 0, "unscorable": 1})
            b.reward_fn("garbage", "reward function returns \"0.5\", None, NaN, 1e39",
                        {"errors": 2, "timeouts": 0, "nonfinite": 2, "unscorable": 4})
            b.deaf_reward()
        if "sync" in only:
            b.broken_sync()
            b.unmerged_lora_sync()
        if "guard" in only:
            b.guards()
        if "malformed" in only:
            b.refill_cap()
            b.malformed()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.monotonic() - t0
    headers = ("test", "expected", "observed", "pass")
    table = [(r.test, r.expected, r.observed, r.verdict) for r in b.rows]
    print()
    print(text_table(headers, table))
    m, v = machine_info(), versions(["torch", "transformers"])
    passed = sum(r.ok is True for r in b.rows)
    md = [
        "# Fault injection on CPU",
        "",
        f"- Command: `{command_line()}`",
        f"- Date: {utc_now()} · commit {git_revision()} · wall time {wall / 60:.0f} min",
        f"- Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory']}, {m['os']}, "
        f"Python {m['python']}",
        f"- Versions: torch {v['torch']}, transformers {v['transformers']}",
        f"- Runs: `python -m flowrl.train model=tiny trainer=smoke` ({STEPS} steps, checkpoint every "
        "step, keep_last=2, eval off) with the deterministic user reward "
        "`benchmarks/_fault_rewards.py:length_reward`; 2 ranks = `launcher.nproc=2` (torchrun, "
        "gloo). Each kill is at a random moment (seeded); \"bit-identical\" compares every tensor "
        "of the final checkpoint (weights, AdamW moments, scheduler, RNG) and the sampler state "
        "with an uninterrupted run of the same world size.",
        "",
        f"{passed}/{len(b.rows)} rows pass.",
        "",
        markdown_table(headers, table),
        "",
        "## What the operator sees (the run's last message)",
        "",
        *[f"- {scenario}: `{line}`" for scenario, line in b.notes],
        "",
    ]
    args.out.write_text("\n".join(md))
    print(f"\nwrote {args.out}")
    sys.exit(0 if all(r.ok is not False for r in b.rows) else 1)


if __name__ == "__main__":
    main()
