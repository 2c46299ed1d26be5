"""A resume on another world size (``job.rescale_prompt_state``): the sampler restarts at the next
epoch and the warning says how the global batch moves (fresh-user report: it doubled unsaid)."""
import logging

from flowrl.runtime.control.job import rescale_prompt_state

STATE = {"sampler": {"world_size": 1, "epoch": 0, "position": 5, "seed": 0}, "step": 3,
         "group_offset": 24}


def test_another_world_size_restarts_the_sampler_and_names_the_batch(caplog):
    with caplog.at_level(logging.WARNING, logger="flowrl"):
        out = rescale_prompt_state(STATE, 2, prompts_per_step=4)
    assert out["sampler"] == {"world_size": 2, "epoch": 1, "position": 0, "seed": 0}
    assert (out["step"], out["group_offset"]) == (3, 24)
    assert [r.getMessage() for r in caplog.records] == [
        "resuming a world-size-1 run on 2 ranks: the prompt sampler restarts at epoch 1; a step "
        "now draws 8 prompts, not 4 (trainer.prompts_per_step=4 per rank)"]


def test_the_same_world_size_is_unchanged(caplog):
    with caplog.at_level(logging.WARNING, logger="flowrl"):
        assert rescale_prompt_state(STATE, 1, prompts_per_step=4) is STATE
    assert not caplog.records
