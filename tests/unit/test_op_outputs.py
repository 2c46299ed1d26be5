"""Typed op outputs: an op's return ``TypedDict`` is its output contract (``register_op`` takes
``outputs`` from its keys, or refuses a declaration that disagrees), and each key's annotation
agrees with the kind the graph validator gives that field (``Tensor`` / ``list[...]``)."""
from typing import TypedDict

import pytest

from flowrl.ops.fields import LIST, TENSOR, Rewards
from flowrl.ops.registry import OPS, output_type, register_op


def test_every_builtin_op_returns_its_typed_outputs():
    typed = {name for name, spec in OPS.items() if spec.output_type is not None}
    builtin = {name for name, spec in OPS.items() if spec.bound is not None and
               spec.bound.__module__.startswith("flowrl.ops.")}
    assert builtin - typed == set()
    for name in typed & builtin:
        spec = OPS[name]
        assert spec.outputs == tuple(spec.output_type.__annotations__), name


@pytest.mark.parametrize("name", sorted(n for n, s in OPS.items() if s.output_type is not None))
def test_a_typed_output_is_annotated_with_its_fields_kind(name):
    spec = OPS[name]
    for key, ann in spec.output_type.__annotations__.items():
        text = getattr(ann, "__forward_arg__", str(ann))  # "Tensor" / "list[str]"
        text = text.removesuffix(" | None")  # None where its optional input is unbound
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


def test_advantage_ops_return_returns_only_where_the_estimator_produces_them():
    """One op per estimator (a registration loop): the estimator's ``produces_returns`` picks the
    op's return type, so ``returns`` is declared exactly by GAE and the REINFORCE++ pair."""
    from flowrl.ops.advantage import Advantages, AdvantagesAndReturns

    types = {name: OPS[name].output_type for name in OPS if name.startswith("advantage.")}
    assert types == {
        "advantage.grpo": Advantages, "advantage.dr_grpo": Advantages, "advantage.rloo": Advantages,
        "advantage.rloo_std": Advantages, "advantage.distill": Advantages,
        "advantage.reinforce_pp": AdvantagesAndReturns,
        "advantage.reinforce_pp_baseline": AdvantagesAndReturns,
        "advantage.gae": AdvantagesAndReturns}
    assert OPS["advantage.gae"].outputs == ("advantages", "returns")
    assert OPS["advantage.grpo"].outputs == ("advantages",)


def test_dynamic_sampling_returns_every_carried_field_none_when_unbound():
    import torch

    from flowrl.ops.filter import CARRIED, DynamicSamplingConfig, KeptRows, dynamic_sampling

    assert OPS["filter.dynamic_sampling"].output_type is KeptRows
    assert OPS["filter.dynamic_sampling"].outputs == ("rewards", "group_id", *CARRIED)

    class Ctx:
        stage = "filter"

        def log(self, **kw):
            pass

    out = dynamic_sampling(Ctx(), DynamicSamplingConfig(),
                           rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),  # group 1: constant
                           group_id=torch.tensor([0, 0, 1, 1]),
                           response_ids=torch.tensor([[5], [6], [7], [8]]))
    assert list(out) == ["rewards", "group_id", *CARRIED]
    assert out["rewards"].tolist() == [1.0, 0.0] and out["group_id"].tolist() == [0, 0]
    assert out["response_ids"].tolist() == [[5], [6]]
    assert [k for k, v in out.items() if v is None] == [k for k in CARRIED if k != "response_ids"]
