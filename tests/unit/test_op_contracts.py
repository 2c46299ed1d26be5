"""Each op owns its contract: declared on its function, in its module (inputs, outputs, params
dataclass, pre-run check); the standard fields' shapes and dtypes are declared once; ops read
the run's objects typed (``ctx.run``); no module re-exports another's names."""
import re
from pathlib import Path

import pytest

from flowrl.ops import builtin
from flowrl.ops.context import StageContext
from flowrl.ops.registry import OPS, get_op, run_op_checks

REPO = Path(__file__).resolve().parents[2]


def test_every_builtin_op_is_declared_in_a_module_of_the_builtin_list():
    modules = {spec.fn.__module__ for spec in OPS.values() if spec.fn.__module__.startswith("flowrl.")}
    assert modules == set(builtin.MODULES)
    # the params dataclass lives beside the function (MultiTurnConfig: envs/config.py, shared
    # with the environments' session)
    for spec in OPS.values():
        if spec.config_cls.__name__ not in ("NoConfig", "MultiTurnConfig"):
            assert spec.config_cls.__module__ == spec.fn.__module__, spec.name
    assert get_op("reward.rule").config_cls.__module__ == "flowrl.ops.reward"


def test_builtin_py_declares_nothing():
    text = (REPO / "flowrl/ops/builtin.py").read_text()
    assert "@dataclass" not in text and "OpSpec" not in text


def test_standard_fields_give_every_op_the_same_shape_and_dtype():
    assert str(get_op("update.policy").field_type("response_mask")) == "(B, R) bool"
    assert str(get_op("logprobs").field_type("logprobs")) == "(B, R) float32"
    assert str(get_op("reward.rule").field_type("rewards")) == "(B,) float32"
    assert get_op("reward.rule").kind("ground_truth") == "list"
    assert get_op("rollout.multi_turn").kind("finish_reason") == "list"
    assert get_op("data.sample").kind("group_id") == "tensor"


def test_run_op_checks_runs_the_multi_turn_stage_check():
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from flowrl.compiler.plan import compile_plan
    from flowrl.graph import Graph

    plan = compile_plan(Graph.load(REPO / "graphs/grpo_tools.yaml"), OmegaConf.create(
        {"algorithm": {"kl_coef": 0.0, "recompute_old_logprobs": True},
         "rollout": {"sampling": {"max_new_tokens": 64}}}))
    cfg = SimpleNamespace(data=SimpleNamespace(tools=None), algorithm=None)
    run_op_checks(plan, cfg)  # rollout.multi_turn's check puts the stage's tools into data.tools
    assert [t["function"]["name"] for t in cfg.data.tools] == ["calculator"]


def test_typed_run_resources_name_the_stage_when_missing():
    from flowrl.algorithms.config import AlgorithmConfig

    ctx = StageContext(stage="adv", step=1, resources={"algorithm": AlgorithmConfig(kl_coef=0.25)})
    assert ctx.run.algorithm.kl_coef == 0.25
    assert ctx.run.prompts_or_none is None
    with pytest.raises(KeyError, match="stage 'adv': run has no resource 'sampling'"):
        ctx.run.sampling  # noqa: B018


def test_no_module_re_exports_another_modules_names():
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in sorted((REPO / "flowrl").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"noqa: F401.*re-export", line)]
    assert offenders == []


def test_an_op_of_your_own_declares_a_field_of_its_own():
    from flowrl.ops.fields import Field
    from flowrl.ops.registry import register_op

    try:
        @register_op("test.fields", inputs=("scores",), outputs=("rewards",),
                     fields={"scores": Field("(B, 3)", "float32")})
        def fn(ctx, cfg, *, scores):
            return {"rewards": scores.sum(-1)}

        spec = get_op("test.fields")
        assert str(spec.field_type("scores")) == "(B, 3) float32"
        assert str(spec.field_type("rewards")) == "(B,) float32"  # the standard field
    finally:
        OPS.pop("test.fields", None)
    with pytest.raises(ValueError, match=r"op 'test.bad': fields \['score'\] are none of its"):
        register_op("test.bad", inputs=("scores",), outputs=(), fields={"score": Field()})
    # without outputs= they come from the function's return type: checked when it is decorated
    with pytest.raises(ValueError, match=r"op 'test.bad': fields \['score'\] are none of its"):
        register_op("test.bad", inputs=("scores",), fields={"score": Field()})(
            lambda ctx, cfg, *, scores: {})
    assert "test.bad" not in OPS
