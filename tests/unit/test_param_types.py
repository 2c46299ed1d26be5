"""`OpSpec.make_config` checks each graph param against its config field's annotation (torch-free):
a wrong type is one ValueError naming the stage and `params.<field>` before any model loads,
instead of an unscorable sample or a crash at step 1."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest

from flowrl.ops.registry import OPS, get_op
from flowrl.ops.reward import OverlongConfig
from flowrl.ops.spec import OpSpec, ParamError, field_types, type_mismatch


@dataclass
class Inner:
    lr: float = 1e-5
    name: str = "x"


@dataclass
class UserConfig:  # annotations are strings here (from __future__ import annotations)
    scale: float = 1.0
    steps: int = 1
    on: bool = False
    label: str = ""
    cap: Optional[int] = 4
    mode: Literal["sum", "mean"] = "sum"
    names: list[str] = field(default_factory=list)
    pair: tuple[int, int] = (0, 1)
    weights: dict[str, float] = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)
    anything: Any = None
    maybe_names: Optional[list[str]] = None


USER = OpSpec(name="user.op", inputs=(), outputs=("out",), config_cls=UserConfig)


@pytest.mark.parametrize("params, message", [
    ({"scale": "abc"}, "stage 's': params.scale: expected a float, got 'abc' (str)"),
    ({"steps": 1.5}, "stage 's': params.steps: expected an int, got 1.5 (float)"),
    ({"steps": True}, "stage 's': params.steps: expected an int, got True (bool)"),
    ({"scale": False}, "stage 's': params.scale: expected a float, got False (bool)"),
    ({"on": "yes"}, "stage 's': params.on: expected a bool, got 'yes' (str)"),
    ({"on": 1}, "stage 's': params.on: expected a bool, got 1 (int)"),
    ({"label": 3}, "stage 's': params.label: expected a str, got 3 (int)"),
    ({"cap": "4"}, "stage 's': params.cap: expected an int or null, got '4' (str); write the "
                   "number without quotes"),
    ({"mode": "max"}, "stage 's': params.mode: expected one of 'sum', 'mean', got 'max' (str)"),
    ({"names": "a"}, "stage 's': params.names: expected a list, got 'a' (str)"),
    ({"names": ["a", 2]}, "stage 's': params.names[1]: expected a str, got 2 (int)"),
    ({"pair": [1]}, "stage 's': params.pair: expected a list of 2 items, got [1] (list)"),
    ({"pair": [1, "b"]}, "stage 's': params.pair[1]: expected an int, got 'b' (str)"),
    ({"weights": [1.0]}, "stage 's': params.weights: expected a mapping, got [1.0] (list)"),
    ({"weights": {"rm": "x"}}, "stage 's': params.weights.rm: expected a float, got 'x' (str)"),
    ({"weights": {1: 1.0}}, "stage 's': params.weights key 1: expected a str, got 1 (int)"),
    ({"inner": {"lr": "fast"}}, "stage 's': params.inner.lr: expected a float, got 'fast' (str)"),
    ({"inner": {"lrr": 1.0}}, "stage 's': params.inner: unknown field(s) ['lrr'] of Inner; "
                              "known: ['lr', 'name']"),
    ({"inner": 3}, "stage 's': params.inner: expected a mapping of Inner fields, got 3 (int)"),
    ({"maybe_names": "a"}, "stage 's': params.maybe_names: expected a list or null, got 'a' (str)"),
    ({"maybe_names": ["a", 1]}, "stage 's': params.maybe_names[1]: expected a str, got 1 (int)"),
    ({"scale": "1e-5"}, "stage 's': params.scale: expected a float, got '1e-5' (str); YAML reads "
                        "1e-5 as a string: write 1.0e-5"),
    ({"scal": 1.0}, "stage 's': params: unknown param(s) ['scal'] for op 'user.op'; did you mean "
                    "'scale'? known: ['anything', 'cap', 'inner', 'label', 'maybe_names', 'mode', "
                    "'names', 'on', 'pair', 'scale', 'steps', 'weights']"),
])
def test_a_wrong_type_is_one_message_naming_stage_and_field(params, message):
    with pytest.raises(ParamError) as e:
        USER.make_config(params, stage="s")
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)  # callers catching ValueError still see it


def test_values_of_the_right_type_pass_unchanged():
    """The values a user writes keep their meaning: an int given to a float field stays the int,
    a str of digits stays a str where a str is asked for, None where Optional allows it."""
    params = {"scale": 2, "steps": 3, "on": True, "label": "7", "cap": None, "mode": "mean",
              "names": ["a"], "pair": [1, 2], "weights": {"rm": 1}, "inner": {"lr": 1},
              "anything": object, "maybe_names": None}
    cfg = USER.make_config(params, stage="s")
    assert {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)} == params
    assert type(cfg.scale) is int and cfg.inner == {"lr": 1}
    assert USER.make_config(None, stage="s") == UserConfig()


def test_builtin_op_messages():
    with pytest.raises(ValueError, match=r"^stage 'reward': params.format_score: expected a float, "
                                         r"got 'abc' \(str\)$"):
        get_op("reward.rule").make_config({"format_score": "abc"}, stage="reward")
    with pytest.raises(ValueError, match=r"^stage 'mt': params.max_turns: expected an int, "
                                         r"got 2.0 \(float\)$"):
        get_op("rollout.multi_turn").make_config({"max_turns": 2.0}, stage="mt")
    with pytest.raises(ValueError, match=r"^stage 'mt': params: unknown param\(s\) \['tool_specs'\]"):
        get_op("rollout.multi_turn").make_config({"tool_specs": ()}, stage="mt")  # init=False
    cfg = get_op("reward.overlong").make_config({"max_length": 8, "buffer_fraction": 1}, stage="o")
    assert cfg == OverlongConfig(max_length=8, buffer_fraction=1)


def test_every_builtin_config_annotation_resolves():
    """A builtin config whose annotation the checker cannot read would silently accept anything:
    each field resolves to a real type (no string left, no fallback to Any)."""
    for spec in OPS.values():
        hints = field_types(spec.config_cls)
        for f in dataclasses.fields(spec.config_cls):
            assert not isinstance(hints[f.name], str) and hints[f.name] is not Any, (spec.name, f.name)
            if f.init:  # each default fits its own annotation
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                    else f.default
                assert type_mismatch(default, hints[f.name], f.name) is None, (spec.name, f.name)


def test_an_annotation_that_does_not_resolve_accepts_anything():
    @dataclass
    class Local:
        a: int = 0
        b: Missing = None  # type: ignore[name-defined]  # noqa: F821 - never defined

    spec = OpSpec(name="user.local", inputs=(), outputs=("out",), config_cls=Local)
    assert spec.make_config({"b": "whatever"}, stage="s").b == "whatever"
    with pytest.raises(ValueError, match=r"params.a: expected an int, got 'x' \(str\)"):
        spec.make_config({"a": "x"}, stage="s")


def test_params_given_to_an_op_that_takes_none_say_so():
    """It said ``known: []``."""
    from flowrl.ops.registry import OPS

    with pytest.raises(ParamError) as e:
        OPS["advantage.grpo"].make_config({"eps": 1e-6}, stage="advantage")
    assert str(e.value) == ("stage 'advantage': params: unknown param(s) ['eps'] for op "
                            "'advantage.grpo'; it takes no params: drop them")
