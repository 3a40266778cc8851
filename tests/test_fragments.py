"""Fragment plans: coverage, determinism, strategies, schedule, serialisation, errors."""

import math
import random

import numpy as np
import pytest

from decoupled_diloco.diloco.fragment_members import join_members, parse_member
from decoupled_diloco.diloco.fragments import STRATEGIES, FragmentPlan, make_fragment_plan
from decoupled_diloco.models import flatten_params, unflatten_params

D, F, H, G, V, LAYERS = 16, 48, 4, 8, 64, 4


def model_shapes(layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    """Leaf shapes of a small Gemma-like model, named as the model emits them."""
    shapes = {"embedder/embedding": (V, D), "final_norm/scale": (D,)}
    for i in range(layers):
        block = {
            "attn/q": (D, H, G),
            "attn/k": (D, 1, G),
            "attn/v": (D, 1, G),
            "attn/out": (H, G, D),
            "ffw/gate": (D, F),
            "ffw/up": (D, F),
            "ffw/down": (F, D),
            "pre_attn_norm/scale": (D,),
            "pre_ffw_norm/scale": (D,),
        }
        shapes.update({f"block_{i}/{k}": v for k, v in block.items()})
    return shapes


SHAPES = model_shapes()
SIZES = {n: math.prod(s) for n, s in SHAPES.items()}
CASES = [(s, p) for s in STRATEGIES for p in (1, 2, 3, 5)]


@pytest.mark.parametrize("strategy,P", CASES)
def test_every_leaf_exactly_once(strategy, P):
    plan = make_fragment_plan(SHAPES, P, strategy)
    flat = [n for group in plan.names for n in group]
    assert sorted(flat) == sorted(SHAPES) and len(flat) == len(set(flat))
    assert plan.num_fragments == P and all(plan.names)
    assert all(list(group) == sorted(group) for group in plan.names)
    for p, group in enumerate(plan.names):
        assert all(plan.fragment_of(n) == p for n in group)


@pytest.mark.parametrize("strategy,P", CASES)
def test_identical_across_calls_and_dict_orders(strategy, P):
    reference = make_fragment_plan(SHAPES, P, strategy, sync_every=6)
    items = list(SHAPES.items())
    for seed in range(3):
        random.Random(seed).shuffle(items)
        assert make_fragment_plan(dict(items), P, strategy, sync_every=6) == reference


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_embedding_alone_in_its_fragment(strategy):
    plan = make_fragment_plan(SHAPES, 3, strategy)
    assert plan.names[plan.embedding_fragment] == ("embedder/embedding",)
    assert make_fragment_plan(SHAPES, 1, strategy).embedding_fragment == -1
    no_embedding = {n: s for n, s in SHAPES.items() if not n.startswith("embedder/")}
    plan = make_fragment_plan(no_embedding, 3, strategy)
    assert plan.embedding_fragment == -1 and plan.num_fragments == 3


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_balanced_bins_within_largest_leaf(P):
    plan = make_fragment_plan(SHAPES, P, "balanced")
    rest = [g for p, g in enumerate(plan.names) if p != plan.embedding_fragment]
    bin_sizes = [sum(SIZES[n] for n in g) for g in rest]
    largest = max(SIZES[n] for g in rest for n in g)
    assert max(bin_sizes) - min(bin_sizes) <= largest
    assert plan.fragment_bytes(SHAPES) == [4 * sum(SIZES[n] for n in g) for g in plan.names]


def test_balanced_zero_sized_leaves_never_leave_a_fragment_empty():
    shapes = {"a": (0,), "b": (0,), "c": (0, 3), "d": (5,)}
    plan = make_fragment_plan(shapes, 4, "balanced")
    assert sorted(len(g) for g in plan.names) == [1, 1, 1, 1]


@pytest.mark.parametrize("P", [2, 3, 5])
def test_layer_strategy_is_strided(P):
    plan = make_fragment_plan(SHAPES, P, "layer")
    fragment = []
    for i in range(LAYERS):
        in_block = {plan.fragment_of(n) for n in SHAPES if n.startswith(f"block_{i}/")}
        assert len(in_block) == 1  # a block is never split
        fragment.extend(in_block)
    for i in range(LAYERS):
        for j in range(LAYERS):
            assert (fragment[i] == fragment[j]) == (i % (P - 1) == j % (P - 1))
    assert plan.fragment_of("final_norm/scale") != plan.embedding_fragment


def test_tensor_strategy_groups_kinds():
    plan = make_fragment_plan(SHAPES, 4, "tensor")
    for kind in ("attn/q", "ffw/down", "pre_ffw_norm/scale"):
        assert len({plan.fragment_of(f"block_{i}/{kind}") for i in range(LAYERS)}) == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_split_join_identity(strategy):
    rng = np.random.default_rng(0)
    flat = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    plan = make_fragment_plan(SHAPES, 3, strategy)
    parts = plan.split(flat)
    assert [sorted(p) for p in parts] == [list(g) for g in plan.names]
    joined = plan.join(parts)
    assert list(joined) == sorted(flat)
    assert all(joined[n] is flat[n] for n in flat)
    nested = unflatten_params(joined)
    assert nested["block_2"]["attn"]["q"] is flat["block_2/attn/q"]
    assert flatten_params(nested) == joined


@pytest.mark.parametrize("H,P", [(4, 4), (6, 3), (5, 2), (3, 5), (1, 1)])
def test_due_schedule(H, P):
    shapes = {f"block_{i}/w": (2,) for i in range(P)}
    plan = make_fragment_plan(shapes, P, "balanced", sync_every=H)
    assert plan.due(0) == [] and plan.due(-3) == []
    due = {p: [t for t in range(1, 4 * H + 1) if p in plan.due(t)] for p in range(P)}
    for p, steps in due.items():
        assert len(steps) == 4 and np.all(np.diff(steps) == H)  # exactly once per H steps
        assert all((t - plan.offsets[p]) % H == 0 for t in steps)
    assert plan.offsets == tuple(p * H // P for p in range(P))
    if P == H:  # one fragment per step
        assert all(len(plan.due(t)) == 1 for t in range(1, 3 * H))


def test_json_round_trip():
    plan = make_fragment_plan(SHAPES, 4, "layer", sync_every=8)
    restored = FragmentPlan.from_json(plan.to_json())
    assert restored == plan and restored.fragment_of("final_norm/scale") == plan.fragment_of(
        "final_norm/scale"
    )


def test_errors():
    with pytest.raises(ValueError, match="diloco.fragment_strategy"):
        make_fragment_plan(SHAPES, 2, "random")
    with pytest.raises(ValueError, match="diloco.fragments"):
        make_fragment_plan(SHAPES, 0)
    with pytest.raises(ValueError, match="diloco.fragments"):
        make_fragment_plan(SHAPES, len(SHAPES) + 1)
    with pytest.raises(ValueError, match="diloco.fragments"):  # 4 blocks + final_norm < 6 bins
        make_fragment_plan(SHAPES, 7, "layer")
    with pytest.raises(ValueError, match="diloco.fragments"):  # 10 kinds cannot fill 11 bins
        make_fragment_plan(SHAPES, 12, "tensor")
    with pytest.raises(ValueError, match="diloco.sync_every"):
        make_fragment_plan(SHAPES, 2, sync_every=0)
    plan = make_fragment_plan(SHAPES, 2)
    with pytest.raises(ValueError, match="missing"):
        plan.split({"embedder/embedding": 0})
    with pytest.raises(ValueError):
        plan.fragment_of("nope")
    with pytest.raises(ValueError, match="more than one"):
        FragmentPlan((("a",), ("a",)), 1, (0, 0), "balanced", -1)
    with pytest.raises(ValueError, match="empty"):
        FragmentPlan((("a",), ()), 1, (0, 0), "balanced", -1)


# --- the embedding in row slices (diloco/fragment_members.py) ------------------------------


def _gemma_2b_plan(P: int = 24, embedding_merge: str = "mean"):
    import jax

    from decoupled_diloco import models
    from decoupled_diloco.diloco.config import DilocoConfig
    from decoupled_diloco.diloco.fragments import model_plan

    cfg = models.get_model_config("gemma_2b")  # abstract shapes: nothing is allocated
    flat = models.flatten_params(jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0))))
    diloco = DilocoConfig(fragments=P, sync_every=P, embedding_merge=embedding_merge)
    return model_plan(cfg, diloco), {k: tuple(v.shape) for k, v in flat.items()}


def _peak_over_mean(plan, shapes) -> float:
    per_step = [0] * plan.sync_every
    for p, size in enumerate(plan.fragment_bytes(shapes)):
        per_step[plan.offsets[p]] += size
    return max(per_step) / (sum(per_step) / len(per_step))


def test_gemma_2b_at_p24_has_flat_traffic_with_the_embedding_in_slices():
    plan, shapes = _gemma_2b_plan()
    assert _peak_over_mean(plan, shapes) <= 1.1
    emb = set(plan.embedding_fragments)
    assert len(emb) > 1 and plan.embedding_fragment == 0
    for p, group in enumerate(plan.names):  # embedding fragments hold embedding rows only
        assert all(n.startswith("embedder/") for n in group) == (p in emb)
    assert all(parse_member(n)[1] is not None for p in emb for n in plan.names[p])
    # Under RDA (norms per leaf) the embedding stays whole: one fragment, 5x the others.
    whole, _ = _gemma_2b_plan(embedding_merge="rda")
    assert whole.embedding_fragments == (0,) and whole.names[0] == ("embedder/embedding",)
    assert _peak_over_mean(whole, shapes) > 5


def test_split_join_identity_with_embedding_slices():
    shapes = {"embedder/embedding": (1000, 4), **{f"block_{i}/w": (40, 10) for i in range(6)}}
    plan = make_fragment_plan(shapes, 5, "balanced", sync_every=5)
    assert len(plan.embedding_fragments) == 3  # 4000 in 3 vs 2400 in 2: max(1333, 1200)
    rng = np.random.default_rng(0)
    flat = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    parts = plan.split(flat)
    assert [sorted(p) for p in parts] == [list(g) for g in plan.names]
    slices = [v for p in plan.embedding_fragments for v in parts[p].values()]
    assert all(np.shares_memory(v, flat["embedder/embedding"]) for v in slices)  # views
    joined = plan.join(parts)
    assert list(joined) == sorted(flat)
    for n in flat:
        np.testing.assert_array_equal(joined[n], flat[n])
    assert join_members({k: v for p in parts for k, v in p.items()}).keys() == joined.keys()
    sizes = plan.fragment_bytes(shapes)
    assert sum(sizes) == 4 * sum(math.prod(s) for s in shapes.values())
    assert FragmentPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="rows"):
        plan.split({**flat, "embedder/embedding": flat["embedder/embedding"][:-1]})
    with pytest.raises(ValueError, match="do not tile"):
        join_members({"e[0:2]": np.zeros((2, 1)), "e[3:4]": np.zeros((1, 1))})
    with pytest.raises(ValueError, match="overlap"):
        FragmentPlan((("e[0:3]",), ("e[2:4]",)), 2, (0, 1), "balanced", -1)


def test_plans_written_before_embedding_slices_still_load():
    plan = make_fragment_plan(SHAPES, 3, "balanced")
    old = {k: v for k, v in plan.to_json().items() if k != "embedding_fragments"}
    assert FragmentPlan.from_json(old) == plan and plan.embedding_fragments == (0,)
