"""The outer step checks every leaf's buffers before it writes any: a mismatched buffer is
refused by name, never broadcast, cut, or found half-way through a fragment."""

import numpy as np
import pytest

from decoupled_diloco.diloco import merge, outer


def fragment() -> tuple[dict, dict, dict]:
    """(Θ, an offer, a momentum) of two leaves; "a" is stepped before "b"."""
    theta = {"a": np.ones(4, np.float32), "b": np.ones(3, np.float32)}
    v = {k: np.full_like(x, 0.1) for k, x in theta.items()}
    return theta, v, {k: np.full_like(x, 0.5) for k, x in theta.items()}


def copies(tree: dict) -> dict:
    return {k: x.copy() for k, x in tree.items()}


def assert_unchanged(tree: dict, before: dict) -> None:
    assert set(tree) == set(before)
    for k in before:
        np.testing.assert_array_equal(tree[k], before[k])


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("bad", [(1,), (10,)])  # numpy broadcast the first, cut the second
def test_a_momentum_of_another_shape_is_refused_before_any_leaf_steps(inplace, bad):
    theta, v, momentum = fragment()
    momentum["b"] = np.full(bad, 0.5, np.float32)
    before, state_before = copies(theta), copies(momentum)
    steps = {
        "outer_step": lambda state: outer.outer_step(theta, v, state, 1.0, 0.9, inplace=inplace),
        "merge_outer_step": lambda state: merge.merge_outer_step(
            theta, [v], [1.0], "rda", state, 1.0, 0.9, inplace=inplace
        ),
    }
    for step in steps.values():
        state = merge.OuterState(copies(momentum))
        with pytest.raises(ValueError, match=r"momentum\['b'\]: shape"):
            step(state)
        assert_unchanged(theta, before)
        assert_unchanged(state.momentum, state_before)


@pytest.mark.parametrize("rule", merge.RULES)
@pytest.mark.parametrize(
    "bad",
    [
        np.empty(2, np.float32),  # too short (caught only after "a" had stepped)
        np.empty(6, np.float32)[::2],  # a strided view: the new Θ would land in a copy
        np.empty(3, np.float64),
    ],
    ids=["size", "strided", "dtype"],
)
def test_a_theta_copy_that_cannot_take_the_new_theta_is_refused_before_any_leaf_steps(rule, bad):
    theta, v, momentum = fragment()
    before = copies(theta)
    state = merge.OuterState(copies(momentum))
    copy = {"a": np.full(4, np.nan, np.float32), "b": bad}
    with pytest.raises(ValueError, match=r"theta_copy\['b'\]"):
        merge.merge_outer_step(
            theta, [v], [1.0], rule, state, 1.0, 0.9, inplace=True, theta_copy=copy
        )
    assert_unchanged(theta, before)
    assert_unchanged(state.momentum, momentum)
    assert np.all(np.isnan(copy["a"]))
