"""The post-step parameter guard: a diverged optimizer step stops the run before its weights are
used.

``train_step`` already skips a step whose loss or grad norm is not finite. An update can still
wreck the weights with finite inputs (``lr=1e30``: every weight ~1e30 after one AdamW step, and
the next generation fails deep inside the sampler with "probability tensor contains inf/nan").
:func:`guarded_step` wraps the optimizer step: it compares the largest absolute parameter value
(the inf-norm over all parameters, one reduction, read once) before and after, and raises
:class:`ParameterDivergenceError` when the weights are no longer finite or the largest one grew
more than ``max_param_growth`` times in one step. An AdamW step moves each weight by about
``lr``, so a healthy step changes that maximum by a tiny fraction; 10x is a blow-up.

The run then stops with that message (``flowrl.train`` prints the resume command and the last
complete checkpoint, which holds weights from before the blow-up): nothing is rolled back in
memory, because undoing an AdamW step exactly needs a copy of the weights and both moments
(3x the parameters) kept every step.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn


class ParameterDivergenceError(RuntimeError):
    """The optimizer step produced non-finite or exploding parameters; the run must stop."""


def param_absmax(model: nn.Module) -> Tensor:
    """Largest |value| over the parameters (a DTensor: this rank's shard), a 0-dim float32
    tensor on their device; NaN or inf when any parameter is not finite."""
    from torch.distributed.tensor import DTensor

    local = [t for t in (p.to_local().detach() if isinstance(p, DTensor) else p.detach()
                         for p in model.parameters()) if t.numel()]  # a shard may be empty
    if not local:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(local, norm_type=math.inf).float()


@contextmanager
def guarded_step(engine, max_growth: float) -> Iterator[None]:
    """Run the optimizer step of ``engine`` (a ``LocalTrainEngine``) inside this block and check
    the parameters after it; every rank of a lockstep (FSDP) engine agrees (``_all_true``).

    Args:
        max_growth: the largest allowed ratio max|w| after / before one step; <= 0 = only the
            finiteness check.

    Raises:
        ParameterDivergenceError: non-finite parameters, or max|w| grew more than
            ``max_growth`` times.
    """
    before = param_absmax(engine.model)
    yield
    after = param_absmax(engine.model)
    b, a = torch.stack([before.to(after.device), after]).tolist()
    finite = math.isfinite(a)
    ok = finite and (max_growth <= 0 or a <= max_growth * max(b, 1e-12))
    if engine._all_true(ok):
        return
    lr = engine.optimizer.param_groups[0]["lr"] if engine.optimizer is not None else float("nan")
    what = ("the parameters are no longer finite" if not finite else
            f"the largest |parameter| grew from {b:.3g} to {a:.3g}, more than "
            f"trainer.engine.max_param_growth={max_growth:g}x in one step" if not ok else
            "another rank's parameters diverged")
    raise ParameterDivergenceError(
        f"after the optimizer step {what} (lr={lr:g}): the update diverged. Stopped before "
        "these weights reach the sampler or a checkpoint; lower trainer.engine.lr (or look at "
        "the loss and grad norm of this step)")
