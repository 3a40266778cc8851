"""decoupled_diloco.collectives: what a compiled step sends between devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from decoupled_diloco import collectives


@pytest.fixture
def mesh8():
    return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_collective_in_a_loop_counts_once_per_trip(mesh8):
    """XLA:CPU records the scan's trip count; one all-gather of 8 x 1024 float32 (32 KiB)
    over 8 devices per trip sends 7/8 of it."""
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32, sharding=NamedSharding(mesh8, P("d")))

    def fn(x):
        def body(c, _):
            whole = jax.lax.with_sharding_constraint(c, NamedSharding(mesh8, P()))
            return jax.lax.with_sharding_constraint(whole * 2, NamedSharding(mesh8, P("d"))), None

        return jax.lax.scan(body, x, None, length=5)[0]

    text = _compiled(fn, x)
    t = collectives.traffic(text)
    assert t.count == {"all-gather": 5}
    assert t.wire_bytes["all-gather"] == pytest.approx(5 * 32768 * 7 / 8)
    [(_, trips, one_trip)] = collectives.loops(text)
    assert trips == 5 and one_trip.count == {"all-gather": 1}


def test_an_all_reduce_sends_twice_its_share(mesh8):
    x = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=NamedSharding(mesh8, P("d")))
    t = collectives.traffic(_compiled(lambda x: jnp.sum(x, axis=0), x))
    assert t.count == {"all-reduce": 1}
    assert t.total_bytes == pytest.approx(2 * 256 * 4 * 7 / 8)


def test_a_step_without_collectives_sends_nothing():
    t = collectives.traffic(_compiled(lambda x: x * 2, np.ones(4, np.float32)))
    assert t.count == {} and t.total_bytes == 0 and t.unknown_trips == 0


# HLO text in the forms XLA:TPU writes: a loop whose trip count is only in its condition, an
# all-reduce cut to a shard in its fusion (a reduce-scatter), an async permute's tuple, one
# all-gather split into two chained continuation pieces, named-mesh and iota replica groups.
TPU_STYLE = """HloModule m, num_partitions=8

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = f32[64]{0} all-gather(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %s = f32[8]{0} slice(%ag), slice={[0:8]}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %s)
}

%ars (input: f32[64]) -> f32[8] {
  %input = f32[64]{0} parameter(0)
  %ar = f32[64]{0} all-reduce(%input), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}
  %off = u32[] constant(0)
  ROOT %ds = f32[8]{0} dynamic-slice(%ar, %off), dynamic_slice_sizes={8}
}

%piece (a: bf16[4,2]) -> bf16[4,8] {
  %a = bf16[4,2]{1,0} parameter(0)
  ROOT %g = bf16[4,8]{1,0} all-gather(%a), channel_id=9, CHAINED
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %init = (s32[], f32[8]{0}) tuple(%z, %a)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %y = f32[64]{0} broadcast(%a), dimensions={}
  %f = f32[8]{0} fusion(%y), kind=kCustom, calls=%ars
  %cp = (f32[16], f32[16], u32[], u32[]) collective-permute-start(%y), channel_id=3
  %cpd = f32[16]{0} collective-permute-done(%cp)
  %p1 = bf16[4,8]{1,0} fusion(%q), kind=kCustom, calls=%piece
  %p2 = bf16[4,8]{1,0} fusion(%q), kind=kCustom, calls=%piece2
  ROOT %r = f32[8]{0} add(%f, %a)
}

%piece2 (a: bf16[4,2]) -> bf16[4,8] {
  %a = bf16[4,2]{1,0} parameter(0)
  ROOT %g = bf16[4,8]{1,0} all-gather(%a), channel_id=9, CHAINED
}
"""
CHAINED = "replica_groups=mesh['x'=2,'y'=4] {'y'}, frontend_attributes={chain_id=\"0\"}"
TPU_STYLE = TPU_STYLE.replace("CHAINED", CHAINED)


def test_tpu_style_hlo():
    t = collectives.traffic(TPU_STYLE)
    # 3 trips of a 256-byte all-gather over 8 (7/8 each), plus the chained one counted once:
    # bf16[4,8] = 64 bytes over the 4 devices of mesh axis y.
    assert t.count["all-gather"] == 3 + 1
    assert t.wire_bytes["all-gather"] == pytest.approx(3 * 256 * 7 / 8 + 64 * 3 / 4)
    assert t.count["reduce-scatter"] == 1 and "all-reduce" not in t.count
    assert t.wire_bytes["reduce-scatter"] == pytest.approx(32 * 7)  # a 32-byte shard of 8
    assert t.count["collective-permute"] == 1
    assert t.wire_bytes["collective-permute"] == 64  # the result half of the start's tuple
    assert t.unknown_trips == 0
    [(name, trips, _)] = collectives.loops(TPU_STYLE)
    assert (name, trips) == ("w", 3)


def test_a_loop_of_unknown_length_counts_once_and_says_so():
    text = TPU_STYLE.replace("direction=LT", "direction=NE")
    t = collectives.traffic(text)
    assert t.count["all-gather"] == 1 + 1 and t.unknown_trips == 1


def test_text_without_an_entry_computation_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        collectives.traffic("HloModule m\n")


ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
"""
GROUP = "replica_groups={{0,1,2,3}}"


def _module(body: str, *computations: str) -> str:
    return "\n".join(["HloModule m, num_partitions=4", ADD, *computations,
                      f"ENTRY %main (a: f32[1024]) -> f32[] {{\n{body}}}"])  # fmt: skip


def test_async_forms_count_their_results():
    """all-reduce-start's shape is its results (two combined operands: both), a scalar's
    too; an all-gather-start's tuple is (operand, result); an async wrapper whose update
    and done ops name the computation too (XLA prints `calls=` on each without its syntax
    sugar) runs it once."""
    combined = _module(f"""  %a = f32[1024]{{0}} parameter(0)
  %s = (f32[1024]{{0}}, f32[1024]{{0}}) all-reduce-start(%a, %a), channel_id=1, {GROUP}
  %d = (f32[1024]{{0}}, f32[1024]{{0}}) all-reduce-done(%s)
  %s2 = f32[] all-reduce-start(%x), channel_id=2, {GROUP}, to_apply=%add
  %d2 = f32[] all-reduce-done(%s2)
  %g = (f32[256]{{0}}, f32[1024]{{0}}) all-gather-start(%q), channel_id=3, {GROUP}, dimensions={{0}}
  ROOT %gd = f32[1024]{{0}} all-gather-done(%g)
""")
    t = collectives.traffic(combined)
    assert t.count == {"all-reduce": 2, "all-gather": 1}
    assert t.wire_bytes["all-reduce"] == pytest.approx(2 * (8192 + 4) * 3 / 4)
    assert t.wire_bytes["all-gather"] == pytest.approx(4096 * 3 / 4)
    wrapped = _module(
        """  %a = f32[1024]{0} parameter(0)
  %st = ((f32[1024]{0}), f32[256]{0}, u32[]) async-start(%a), calls=%rs
  %up = ((f32[1024]{0}), f32[256]{0}, u32[]) async-update(%st), calls=%rs
  ROOT %dn = f32[256]{0} async-done(%up), calls=%rs
""",
        f"""%rs (p: f32[1024]) -> f32[256] {{
  %p = f32[1024]{{0}} parameter(0)
  ROOT %r = f32[256]{{0}} reduce-scatter(%p), channel_id=1, {GROUP}, dimensions={{0}}
}}""",
    )
    t = collectives.traffic(wrapped)
    assert t.count == {"reduce-scatter": 1} and t.total_bytes == 1024 * 3


LOOP = """%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(COMPARED), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %g = bf16[4,8]{1,0} fusion(%x), kind=kCustom, calls=%piece
  %g2 = bf16[4,8]{1,0} fusion(%x), kind=kCustom, calls=%piece
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %s)
}

%piece (a: bf16[4,2]) -> bf16[4,8] {
  %a = bf16[4,2]{1,0} parameter(0)
  ROOT %g = bf16[4,8]{1,0} all-gather(%a), channel_id=9, PIECE
}""".replace("PIECE", GROUP + ', dimensions={1}, frontend_attributes={chain_id="0"}')


def test_a_chained_collective_in_a_loop_counts_once_per_trip():
    """Two chained pieces of one channel in a 4-trip loop's body: one all-gather per trip.
    One that XLA:TPU starts before the loop and continues in its body (a piece per trip,
    as in the 2B config's chunked output layer) is one all-gather."""
    text = _module("  ROOT %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body\n",
                   LOOP.replace("COMPARED", "%i, %n"))  # fmt: skip
    t = collectives.traffic(text)
    assert t.count == {"all-gather": 4} and t.unknown_trips == 0
    assert t.wire_bytes["all-gather"] == pytest.approx(4 * 64 * 3 / 4)
    started = text.replace(
        "  ROOT %w =", "  %s = bf16[4,8]{1,0} fusion(%a), kind=kCustom, calls=%piece\n  ROOT %w ="
    )
    t = collectives.traffic(started)
    assert t.count == {"all-gather": 1}
    assert t.wire_bytes["all-gather"] == pytest.approx(64 * 3 / 4)
    # A count down (n < i) has a length this does not read: once, and said so.
    t = collectives.traffic(text.replace("compare(%i, %n)", "compare(%n, %i)"))
    assert t.count == {"all-gather": 1} and t.unknown_trips == 1


def test_a_conditional_runs_one_branch():
    """The costliest branch counts, for an index's list of branches and a predicate's two."""
    branches = [
        f"""%b{i} (p: f32[{n}]) -> f32[{n}] {{
  %p = f32[{n}]{{0}} parameter(0)
  ROOT %r = f32[{n}]{{0}} all-reduce(%p), channel_id={i}, {GROUP}, to_apply=%add
}}"""
        for i, n in ((0, 256), (1, 512))
    ]
    by_index = _module("  ROOT %c = f32[256]{0} conditional(%i, %a, %a), "
                       "branch_computations={%b0, %b1}\n", *branches)  # fmt: skip
    by_pred = by_index.replace("branch_computations={%b0, %b1}",
                               "true_computation=%b0, false_computation=%b1")  # fmt: skip
    for text in (by_index, by_pred):
        t = collectives.traffic(text)
        assert t.count == {"all-reduce": 1}
        assert t.wire_bytes["all-reduce"] == pytest.approx(2 * 2048 * 3 / 4)
