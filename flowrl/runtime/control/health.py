"""Run health: the per-step guards that turn a silently useless run into a loud one.

A train engine skips an optimizer step whose loss or gradient norm is not finite (its weights
stay as they were). One skip is a guard doing its job; a run that skips most of its steps trains
nothing and must not end with exit status 0 (Dr.GRPO with rewards ±3e38 skipped every step and
"finished"). :class:`RunHealth` counts, from each step's reduced metrics:

- ``train/skipped_steps``: optimizer steps skipped so far (cumulative over the run, resumes
  included): ``Σ <role>/skipped · <role>/optimizer_steps`` over the trained roles. Past
  ``trainer.max_skipped_steps``, or once the skipped fraction of the optimizer steps so far
  exceeds ``trainer.max_skipped_frac`` (checked from the 4th step, and at the last step), the
  run stops with :class:`~flowrl.errors.RunStopped` naming the setting (``flowrl train`` prints
  it in one line with the resume command, exit status 1).
- ``reward/constant_steps``: consecutive steps whose scorable rewards were all the same value
  (``reward/std == 0``; a step without any scorable reward leaves the count as it was): a verifier that quietly returns 0 (or a format bonus for everyone)
  gives GRPO no signal at all. At ``trainer.constant_reward_steps`` in a row a warning says so
  (again every that many steps while it lasts).
- ``train/unscorable_steps``: consecutive steps on which no sample was scorable
  (``train/unscorable_frac`` = 1: the reward function or verifier raised or timed out on every
  one). At ``trainer.max_unscorable_steps`` in a row the run stops (:class:`RunStopped`): it
  trains on no reward at all, and would otherwise end with exit status 0.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional, Sequence

from flowrl.errors import RunStopped
from flowrl.graph.roles import TRAINED_ROLES

log = logging.getLogger(__name__)

SKIPPED_KEY = "train/skipped_steps"
CONSTANT_KEY = "reward/constant_steps"
UNSCORABLE_KEY = "train/unscorable_steps"
FRAC_FROM_STEP = 4  # the skipped-fraction budget is not judged on the first 3 steps


class RunHealth:
    """Counters and budgets over a run's steps (see the module doc).

    Args:
        max_skipped_steps: skipped optimizer steps allowed (cumulative); more stops the run.
        max_skipped_frac: largest allowed fraction of skipped optimizer steps (0..1].
        constant_reward_steps: identical-reward steps in a row that trigger the warning (0 = off).
        total_steps: the run's last step (the fraction is always judged there).
        history: the checkpointed per-step history of a resumed run (its last
            ``train/skipped_steps`` / ``train/optimizer_steps`` continue the count).
        max_unscorable_steps: steps in a row with no scorable sample that stop the run (0 = off).
        speak: log the warnings (rank 0: the metrics are reduced over ranks, so every rank would
            say the same; all ranks still count and stop alike).
    """

    def __init__(self, max_skipped_steps: int, max_skipped_frac: float, constant_reward_steps: int,
                 total_steps: int, history: Sequence[Mapping[str, Any]] = (),
                 max_unscorable_steps: int = 0, speak: bool = True):
        self.max_skipped_steps, self.max_skipped_frac = max_skipped_steps, max_skipped_frac
        self.constant_reward_steps, self.total_steps = constant_reward_steps, total_steps
        last = history[-1] if history else {}
        self.skipped = int(last.get(SKIPPED_KEY, 0))
        self.optimizer_steps = int(last.get("train/optimizer_steps", 0))
        self.constant = int(last.get(CONSTANT_KEY, 0))
        self.unscorable = int(last.get(UNSCORABLE_KEY, 0))
        # a judge metric (reward/genrm/unparseable_frac) at 1 on the last step: the cause, when
        # nothing raised (the stop message blamed a raise or timeout the log did not hold)
        self.unparseable: Optional[str] = None
        self.max_unscorable_steps = max_unscorable_steps
        self.steps = len(history)
        self.speak = speak

    def update(self, step: int, m: dict[str, float]) -> None:
        """Add this step's counters to ``m`` (in place) and apply the budgets.

        Raises:
            RunStopped: the skipped-step budget is exceeded.
        """
        self.steps += 1
        for role in TRAINED_ROLES:
            n = m.get(f"{role}/optimizer_steps")
            if n is None:
                continue
            self.optimizer_steps += int(n)
            self.skipped += int(round(float(m.get(f"{role}/skipped", 0.0)) * float(n)))
        m[SKIPPED_KEY] = float(self.skipped)
        m["train/optimizer_steps"] = float(self.optimizer_steps)
        # a step with no scorable reward (reward/mean NaN) says nothing about the verifier's spread
        std, mean = m.get("reward/std"), m.get("reward/mean", 0.0)
        if std is not None and math.isfinite(std) and math.isfinite(mean):
            self.constant = self.constant + 1 if std == 0.0 else 0
            m[CONSTANT_KEY] = float(self.constant)
            n_const = self.constant_reward_steps
            if n_const and self.constant and self.constant % n_const == 0 and self.speak:
                log.warning("step %d: every scorable reward of the last %d steps was the same "
                            "(reward/mean=%s, reward/std=0): GRPO gets no signal; check the "
                            "reward function or verifier (trainer.constant_reward_steps=%d)",
                            step, self.constant, m.get("reward/mean"), n_const)
        frac_u = m.get("train/unscorable_frac")
        if frac_u is not None:
            self.unscorable = self.unscorable + 1 if frac_u >= 1.0 else 0
            m[UNSCORABLE_KEY] = float(self.unscorable)
            self.unparseable = next((k for k, v in m.items() if k.endswith("/unparseable_frac")
                                     and v is not None and v >= 1.0), None)
        self._check(step)

    def _unscorable_cause(self) -> tuple[str, str]:
        """(why no sample was scored, what to fix): an unreadable judge when its metric says so
        (nothing raised), else the reward function or verifier raising or timing out."""
        if self.unparseable is not None:  # a generative judge answered, unreadably
            return (f"the judge's answer could not be read as a score for any of them, "
                    f"{self.unparseable} = 1", "Fix the judge (its model, prompt or answer length)")
        return ("the reward function or verifier raised or timed out on every one; the first "
                "error of each step is in the log", "Fix the reward function")

    def _check(self, step: int) -> None:
        n_u = self.max_unscorable_steps
        if n_u and self.unscorable >= n_u:
            why, fix = self._unscorable_cause()
            raise RunStopped(
                f"step {step}: no sample could be scored on the last {self.unscorable} steps "
                f"(train/unscorable_frac = 1: {why}), so the run trains on no reward "
                f"(trainer.max_unscorable_steps={n_u}). {fix}, or raise "
                "trainer.max_unscorable_steps")
        if self.skipped > self.max_skipped_steps:
            raise RunStopped(
                f"step {step}: {self.skipped} optimizer steps skipped (non-finite loss or grad "
                f"norm), more than trainer.max_skipped_steps={self.max_skipped_steps}; the run "
                "is not training. Look at the loss, grad norm and rewards of the skipped steps "
                "in metrics.jsonl, or raise trainer.max_skipped_steps")
        if step >= self.total_steps and self.unscorable >= self.steps and self.speak:
            # a run shorter than the stop budget that never scored a sample ends with
            # reward=nan and exit status 0: said (fresh-user report, graph=genrm_grpo)
            log.warning("no sample of the run's %d steps could be scored (%s): it trained on no "
                        "reward", self.steps, self._unscorable_cause()[0])
        judged = self.steps >= FRAC_FROM_STEP or step >= self.total_steps
        frac = self.skipped / self.optimizer_steps if self.optimizer_steps else 0.0
        if judged and frac > self.max_skipped_frac:
            raise RunStopped(
                f"step {step}: {self.skipped} of {self.optimizer_steps} optimizer steps skipped "
                f"(non-finite loss or grad norm), a fraction {frac:.2f} above "
                f"trainer.max_skipped_frac={self.max_skipped_frac:g}; the run is not training. "
                "Look at the loss, grad norm and rewards in metrics.jsonl, or raise "
                "trainer.max_skipped_frac")
