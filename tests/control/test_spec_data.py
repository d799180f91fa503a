"""The data and evaluation fields of a RunSpec: a blend or a prefix, a split, eval settings;
each refusal names its field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from contracts.spec import RunSpec
from supervisor.api.examples import TINY_SPEC


def _spec(data: dict[str, Any] | None = None, **training: Any) -> dict[str, Any]:
    spec = copy.deepcopy(TINY_SPEC)
    spec["data"] = data or {}
    spec["training"] = {**spec["training"], **training}
    return spec


def _error(spec: dict[str, Any]) -> tuple[tuple[str | int, ...], str]:
    with pytest.raises(ValidationError) as info:
        RunSpec.model_validate(spec)
    (err,) = info.value.errors()
    return tuple(err["loc"]), err["msg"]


def test_blend_and_split_are_accepted_and_normalised() -> None:
    blend = [{"prefix": "/d/a", "weight": 3}, {"prefix": "/d/b", "weight": 1.5}]
    spec = RunSpec.model_validate(
        _spec({"blend": blend, "split": "98, 2"}, eval_interval=50, eval_iters=4)
    )
    assert [(p.prefix, p.weight) for p in spec.data.blend] == [("/d/a", 3.0), ("/d/b", 1.5)]
    assert spec.data.split_fractions == (0.98, 0.02)
    assert spec.data.megatron
    assert (spec.training.eval_interval, spec.training.eval_iters) == (50, 4)


def test_defaults_keep_the_plain_token_stream() -> None:
    spec = RunSpec.model_validate(_spec({"prefix": "/d/a"}))
    assert spec.data.split_fractions == (1.0, 0.0) and not spec.data.megatron
    assert (spec.training.eval_interval, spec.training.eval_iters) == (0, 10)
    assert RunSpec.model_validate(_spec({"prefix": "/d/a", "split": "1,0"})).data.megatron


@pytest.mark.parametrize(
    ("data", "training", "loc", "msg"),
    [
        ({"prefix": "/d/a", "blend": [{"prefix": "/d/b", "weight": 1}]}, {}, ("data",),
         "give data.prefix or data.blend, not both"),
        ({"blend": [{"prefix": "/d/b", "weight": 0}]}, {}, ("data", "blend", 0, "weight"),
         "greater than 0"),
        ({"blend": [{"prefix": "d/b", "weight": 1}]}, {}, ("data", "blend", 0, "prefix"),
         "must be an absolute path"),
        ({"blend": []}, {}, ("data", "blend"), "at least 1 item"),
        ({"blend": [{"prefix": "/d/b"}]}, {}, ("data", "blend", 0, "weight"), "Field required"),
        ({"split": "98"}, {}, ("data", "split"), "should match pattern"),
        ({"split": "98,1,1"}, {}, ("data", "split"), "should match pattern"),
        ({"split": "0,5"}, {}, ("data",), "must give training a share above 0"),
        ({}, {"eval_interval": 10}, (), "training.eval_interval needs a valid share"),
        ({"split": "100,0"}, {"eval_interval": 10}, (), "needs a valid share"),
        ({"split": "9,1"}, {"eval_iters": 0}, ("training", "eval_iters"), "greater than 0"),
        ({}, {"eval_interval": -1}, ("training", "eval_interval"), "greater than or equal"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(data: dict, training: dict, loc: tuple, msg: str) -> None:
    got_loc, got_msg = _error(_spec(data, **training))
    assert got_loc == loc
    assert msg in got_msg
