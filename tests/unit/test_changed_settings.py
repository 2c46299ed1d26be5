"""What a resume says it changed (``rundir.changed_settings``): a placement mode's preset settings
fold into the mode's line."""
from flowrl.config import compose, to_train_config
from flowrl.runtime.io.rundir import changed_settings, settings_record

BASE = ["model=tiny", "trainer=smoke", "trainer.output_dir=/tmp/unused", "launcher.nproc=2"]


def cfg_of(*overrides: str):
    return to_train_config(compose(BASE + list(overrides)))


def test_colocated_to_partitioned_is_one_line_for_the_mode():
    saved = settings_record(cfg_of())
    assert changed_settings(saved, cfg_of("placement=partitioned")) == [
        "placement.mode: colocated -> partitioned (with its preset's pools, roles)"]
    back = settings_record(cfg_of("placement=partitioned"))
    assert changed_settings(back, cfg_of()) == [
        "placement.mode: partitioned -> colocated (with its preset's pools, roles)"]


def test_a_set_pool_and_other_settings_keep_their_lines():
    saved = settings_record(cfg_of("placement=partitioned", "placement.pools.train=[0]",
                                   "placement.pools.rollout=[1]"))
    now = cfg_of("placement=partitioned", "placement.pools.train=[1]",
                 "placement.pools.rollout=[0]", "trainer.engine.lr=5e-05")
    assert changed_settings(saved, now) == ["placement.pools.train: [0] -> [1]",
                                            "placement.pools.rollout: [1] -> [0]",
                                            "trainer.engine.lr: 0.0001 -> 5e-05"]


def test_an_unchanged_resume_lists_nothing():
    assert changed_settings(settings_record(cfg_of()), cfg_of()) == []
