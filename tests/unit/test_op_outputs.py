"""Typed op outputs: an op's return ``TypedDict`` is its output contract (``register_op`` takes
``outputs`` from its keys, or refuses a declaration that disagrees), and each key's annotation
agrees with the kind the graph validator gives that field (``Tensor`` / ``list[...]``)."""
from typing import TypedDict

import pytest

from flowrl.ops.fields import LIST, TENSOR, Rewards
from flowrl.ops.registry import OPS, output_type, register_op

# built-in ops that return a plain dict, and why: their outputs depend on how they are registered
UNTYPED = {
    **{name: "one op per estimator, registered by a loop; 'returns' only where the estimator "
             "produces it (algorithms/variants.py)" for name in OPS if name.startswith("advantage.")},
    "filter.dynamic_sampling": "passes through whichever optional batch fields are bound (CARRIED)",
}


def test_every_builtin_op_returns_its_typed_outputs_or_is_listed():
    typed = {name for name, spec in OPS.items() if spec.output_type is not None}
    builtin = {name for name, spec in OPS.items() if spec.bound is not None and
               spec.bound.__module__.startswith("flowrl.ops.")}
    assert builtin - typed == set(UNTYPED)
    for name in typed & builtin:
        spec = OPS[name]
        assert spec.outputs == tuple(spec.output_type.__annotations__), name


@pytest.mark.parametrize("name", sorted(n for n, s in OPS.items() if s.output_type is not None))
def test_a_typed_output_is_annotated_with_its_fields_kind(name):
    spec = OPS[name]
    for key, ann in spec.output_type.__annotations__.items():
        text = getattr(ann, "__forward_arg__", str(ann))  # "Tensor" / "list[str]"
        kind = LIST if text.startswith("list[") else TENSOR if text == "Tensor" else text
        assert kind == spec.kind(key), f"op '{name}': output '{key}' is annotated {text!r}"


def test_outputs_come_from_the_return_typed_dict():
    try:
        @register_op("test.typed", inputs=("scores",))
        def fn(ctx, cfg, *, scores) -> Rewards:
            return {"rewards": scores.sum(-1)}

        assert OPS["test.typed"].outputs == ("rewards",)
        assert OPS["test.typed"].output_type is Rewards
    finally:
        OPS.pop("test.typed", None)


class _Two(TypedDict):
    rewards: object
    extra: object


def test_outputs_that_disagree_with_the_typed_dict_are_refused():
    with pytest.raises(TypeError) as e:
        @register_op("test.disagree", inputs=("scores",), outputs=("rewards",))
        def fn(ctx, cfg, *, scores) -> _Two:
            return {"rewards": scores, "extra": scores}
    assert str(e.value) == (
        f"op 'test.disagree': {__name__}.fn returns _Two with keys ['rewards', 'extra'], but "
        "declares outputs ['rewards']: declare one (drop outputs=)")
    assert "test.disagree" not in OPS


def test_a_plain_dict_annotation_is_untyped():
    def plain(ctx, cfg) -> dict:
        return {}

    def unresolvable(ctx, cfg) -> "NotDefinedAnywhere":  # noqa: F821
        return {}

    assert output_type(plain) is None and output_type(unresolvable) is None
