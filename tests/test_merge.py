"""Syncer math: token weights, mean and RDA merges, outer Nesterov step, fused fast path."""

import threading

import numpy as np
import pytest

from decoupled_diloco.diloco import chunks, compression, merge, outer
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.diloco.fragments import make_fragment_plan
from decoupled_diloco.diloco.messages import Join, Offer
from decoupled_diloco.diloco.syncer import Syncer

SHAPES = {"attn/q": (6, 5), "ffw/down": (33,), "norm/scale": ()}


def tree(rng, scale=1.0, shapes=SHAPES):
    return {k: np.asarray(scale * rng.standard_normal(s), np.float32) for k, s in shapes.items()}


def norm(x) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64)))


def test_token_weights():
    w = merge.token_weights([100, 300, 50, 0], [10, 10, 0, 0])
    np.testing.assert_allclose(w, [100**2 / 10, 300**2 / 10, 0, 0])
    # Quantity × quality: twice the tokens at the same rate weigh 2×; the same tokens in
    # half the steps (bigger batches) weigh 2× too.
    np.testing.assert_allclose(merge.token_weights([200, 100], [10, 5]), [4000, 2000])
    np.testing.assert_allclose(merge.token_weights([100, 100], [10, 5]), [1000, 2000])
    np.testing.assert_array_equal(merge.token_weights([5, 7, 9], [1, 0, 3], "uniform"), [1, 0, 1])
    with pytest.raises(ValueError, match="diloco.weights"):
        merge.token_weights([1], [1], "loss")
    with pytest.raises(ValueError):
        merge.token_weights([1, 2], [1])
    with pytest.raises(ValueError):
        merge.token_weights([-1], [1])


def test_outer_gradient_is_anchor_minus_local_in_float32():
    rng = np.random.default_rng(0)
    anchor, local = tree(rng), {k: v.astype(np.float64) for k, v in tree(rng).items()}
    v = merge.outer_gradient(anchor, local)
    for k in SHAPES:
        assert v[k].dtype == np.float32 and v[k].shape == SHAPES[k]
        np.testing.assert_allclose(v[k], anchor[k] - local[k], rtol=1e-6)


def test_merge_mean_is_the_weighted_mean_and_ignores_zero_weights():
    rng = np.random.default_rng(1)
    vs, w = [tree(rng) for _ in range(4)], np.array([1.0, 3.0, 0.0, 2.0])
    out = merge.merge(vs, w, "mean")
    for k in SHAPES:
        want = np.average([np.asarray(v[k], np.float64) for v in vs], axis=0, weights=w)
        np.testing.assert_allclose(out[k], want, rtol=1e-5, atol=1e-6)
    scaled = merge.merge_mean(vs, 7 * w)
    assert all(np.allclose(scaled[k], out[k], rtol=1e-6) for k in SHAPES)


def test_rda_of_parallel_offers_has_the_weighted_mean_norm_and_their_direction():
    rng = np.random.default_rng(2)
    direction = tree(rng)
    coefs, w = [0.5, 2.0, 4.0], np.array([3.0, 1.0, 2.0])
    vs = [{k: c * d for k, d in direction.items()} for c in coefs]
    out = merge.merge_rda(vs, w)
    for k, d in direction.items():
        want_norm = float(np.dot(w, [c * norm(d) for c in coefs]) / w.sum())
        assert norm(out[k]) == pytest.approx(want_norm, rel=1e-5)
        np.testing.assert_allclose(out[k] / norm(out[k]), d / norm(d), atol=1e-6)


def test_rda_norm_is_the_weighted_mean_norm_in_general():
    rng = np.random.default_rng(3)
    vs, w = [tree(rng, scale=s) for s in (0.1, 1.0, 3.0)], np.array([1.0, 2.0, 5.0])
    out = merge.merge_rda(vs, w)
    for k in SHAPES:
        want = float(np.dot(w, [norm(v[k]) for v in vs]) / w.sum())
        assert norm(out[k]) == pytest.approx(want, rel=1e-5)


def test_rda_equals_mean_for_identical_offers():
    rng = np.random.default_rng(4)
    v = tree(rng)
    vs, w = [v, {k: x.copy() for k, x in v.items()}, v], np.array([1.0, 2.0, 3.0])
    rda, mean = merge.merge(vs, w, "rda"), merge.merge(vs, w, "mean")
    for k in SHAPES:
        np.testing.assert_allclose(rda[k], mean[k], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(rda[k], v[k], rtol=1e-5, atol=1e-7)


def test_rda_keeps_the_norm_of_orthogonal_offers_where_mean_shrinks():
    rng = np.random.default_rng(5)
    n, shapes = 8, {"w": (4096,)}
    vs, w = [tree(rng, shapes=shapes) for _ in range(n)], np.ones(n)
    mean_norm = np.mean([norm(v["w"]) for v in vs])
    assert norm(merge.merge_rda(vs, w)["w"]) == pytest.approx(mean_norm, rel=1e-5)
    assert norm(merge.merge_mean(vs, w)["w"]) == pytest.approx(mean_norm / np.sqrt(n), rel=0.1)


def test_rda_of_cancelling_or_zero_offers_is_zero():
    rng = np.random.default_rng(6)
    v = tree(rng)
    cancel = merge.merge_rda([v, {k: -x for k, x in v.items()}], np.ones(2))
    zero = merge.merge_rda([{k: np.zeros_like(x) for k, x in v.items()}] * 2, np.ones(2))
    for out in (cancel, zero):
        assert all(np.all(out[k] == 0) for k in SHAPES)


def nesterov_reference(theta, deltas, lr, mu, nesterov):
    """Float64 textbook SGD momentum over a sequence of outer gradients."""
    theta, buf = np.asarray(theta, np.float64), 0.0
    for d in deltas:
        buf = mu * buf + d
        theta = theta - lr * (d + mu * buf if nesterov else buf)
    return theta, buf


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_hand_computed_momentum(nesterov):
    rng = np.random.default_rng(7)
    theta = tree(rng)
    deltas = [tree(rng, scale=0.1) for _ in range(3)]
    state, got = merge.OuterState.zeros(theta), theta
    for d in deltas:
        got, state = outer.outer_step(got, d, state, lr=0.7, momentum=0.9, nesterov=nesterov)
    for k in SHAPES:
        want, buf = nesterov_reference(theta[k], [d[k] for d in deltas], 0.7, 0.9, nesterov)
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.momentum[k], buf, rtol=1e-5, atol=1e-6)


def test_outer_step_lr1_mu0_is_theta_minus_delta_and_pure():
    rng = np.random.default_rng(8)
    theta, delta = tree(rng), tree(rng)
    before = {k: v.copy() for k, v in theta.items()}
    state = merge.OuterState({})  # leaves missing from the state start at zero
    new, new_state = outer.outer_step(theta, delta, state, lr=1.0, momentum=0.0)
    for k in SHAPES:
        np.testing.assert_array_equal(new[k], theta[k] - delta[k])
        np.testing.assert_array_equal(theta[k], before[k])  # inputs untouched
    assert state.momentum == {} and set(new_state.momentum) == set(SHAPES)


@pytest.mark.parametrize("rule", merge.RULES)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("w", [[2.0], [1.0, 0.0, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
def test_fused_merge_outer_step_equals_composition(monkeypatch, rule, nesterov, w):
    monkeypatch.setattr(chunks, "CHUNK", 7)  # many chunks, ragged last one
    rng = np.random.default_rng(9)
    theta, vs = tree(rng), [tree(rng, scale=0.1) for _ in w]
    state = merge.OuterState(tree(rng, scale=0.01))
    want, want_state = outer.outer_step(theta, merge.merge(vs, w, rule), state, 0.5, 0.8, nesterov)
    got, got_state = merge.merge_outer_step(theta, vs, w, rule, state, 0.5, 0.8, nesterov)
    theta_inplace = {k: x.copy() for k, x in theta.items()}
    state_inplace = merge.OuterState({k: x.copy() for k, x in state.momentum.items()})
    # The syncer's fast path: RDA's direction in reused memory (one buffer for leaves of
    # every size), and the new Θ also written into its reply's arrays.
    copy = {k: np.full(np.size(x), np.nan, np.float32) for k, x in theta.items()}
    out, out_state = merge.merge_outer_step(
        theta_inplace, vs, w, rule, state_inplace, 0.5, 0.8, nesterov, inplace=True,
        scratch=chunks.Scratch(), theta_copy=copy,
    )  # fmt: skip
    assert out is theta_inplace and out_state is state_inplace
    for k in SHAPES:
        for tensor, reference in ((got, want), (out, want)):
            np.testing.assert_array_equal(tensor[k], reference[k])
        np.testing.assert_array_equal(copy[k].reshape(np.shape(want[k])), want[k])
        for buf in (got_state.momentum[k], out_state.momentum[k]):
            np.testing.assert_array_equal(buf, want_state.momentum[k])


def test_precomputed_offer_norms_give_the_same_rda(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK", 7)
    rng = np.random.default_rng(12)
    theta, vs, w = tree(rng), [tree(rng, scale=0.1) for _ in range(3)], [1.0, 0.0, 2.0]
    norms = [merge.offer_sq_norms(v) for v in vs]
    assert norms[0]["attn/q"] == pytest.approx(norm(vs[0]["attn/q"]) ** 2, rel=1e-6)
    state = merge.OuterState.zeros(theta)
    want, _ = merge.merge_outer_step(theta, vs, w, "rda", state, 0.7, 0.9)
    got, _ = merge.merge_outer_step(theta, vs, w, "rda", state, 0.7, 0.9, sq_norms=norms)
    rda, rda_known = merge.merge_rda(vs, w), merge.merge_rda(vs, w, sq_norms=norms)
    for k in SHAPES:
        np.testing.assert_array_equal(got[k], want[k])
        np.testing.assert_array_equal(rda_known[k], rda[k])
    bad = {**vs[0], "ffw/down": np.full(33, np.nan, np.float32)}
    assert not np.isfinite(merge.offer_sq_norms(bad)["ffw/down"])
    with pytest.raises(ValueError, match="sq_norms"):
        merge.merge_rda(vs, w, sq_norms=norms[:2])


@pytest.mark.parametrize("rule", merge.RULES)
def test_fused_path_returns_the_norm_of_the_merged_outer_gradient(monkeypatch, rule):
    monkeypatch.setattr(chunks, "CHUNK", 7)
    rng = np.random.default_rng(13)
    theta, w = tree(rng), [1.0, 0.0, 2.0]
    vs = [tree(rng, scale=0.1) for _ in w]
    delta = merge.merge(vs, w, rule)
    want = np.sqrt(sum(norm(d) ** 2 for d in delta.values()))
    state = merge.OuterState.zeros(theta)
    new, _, got = merge.merge_outer_step(
        theta, vs, w, rule, state, 0.7, 0.9, return_delta_norm=True
    )
    assert got == pytest.approx(want, rel=1e-5) and got > 0
    plain, _ = merge.merge_outer_step(theta, vs, w, rule, state, 0.7, 0.9)
    for k in SHAPES:
        np.testing.assert_array_equal(new[k], plain[k])


def test_router_divergence_is_the_relative_weighted_spread_of_router_offers():
    shapes = {"block_0/moe/router": (4, 3), "block_1/moe/router": (4, 3), "attn/q": (5,)}
    rng = np.random.default_rng(14)
    theta, v = tree(rng, shapes=shapes), tree(rng, scale=0.1, shapes=shapes)
    assert merge.router_divergence([v, v, v], [1.0, 2.0, 3.0], theta) == pytest.approx(0, abs=1e-9)
    # Two equally weighted offers ±u around a zero mean: spread ‖u‖ per leaf.
    neg = {k: -x for k, x in v.items()}
    want = np.mean([norm(v[k]) / norm(theta[k]) for k in shapes if k.endswith("router")])
    got = merge.router_divergence([v, neg], [1.0, 1.0], theta)
    assert got == pytest.approx(want, rel=1e-9)
    # Zero-weight offers do not count, nor do non-router leaves.
    assert merge.router_divergence([v, neg, v], [1.0, 1.0, 0.0], theta) == pytest.approx(got)
    wild = {**neg, "attn/q": 1e3 * neg["attn/q"]}
    assert merge.router_divergence([v, wild], [1.0, 1.0], theta) == pytest.approx(got)
    # Spreading the offers further apart raises it; scaling Θ up lowers it.
    far = {k: 3 * x for k, x in neg.items()}
    assert merge.router_divergence([v, far], [1.0, 1.0], theta) > got
    big = {k: 10 * x for k, x in theta.items()}
    assert merge.router_divergence([v, neg], [1.0, 1.0], big) == pytest.approx(got / 10)
    assert merge.router_divergence([v, neg], [1.0, 0.0], theta) is None  # one learner
    dense = {"attn/q": theta["attn/q"]}
    assert merge.router_divergence([{"attn/q": v["attn/q"]}] * 2, [1.0, 1.0], dense) is None


def test_chunking_does_not_change_results(monkeypatch):
    rng = np.random.default_rng(10)
    vs, w = [tree(rng) for _ in range(3)], np.array([1.0, 2.0, 0.5])
    whole = {rule: merge.merge(vs, w, rule) for rule in merge.RULES}
    monkeypatch.setattr(chunks, "CHUNK", 4)
    for rule in merge.RULES:
        chunked = merge.merge(vs, w, rule)
        assert all(np.allclose(chunked[k], whole[rule][k], rtol=1e-6) for k in SHAPES)


def test_errors():
    rng = np.random.default_rng(11)
    v, theta = tree(rng), tree(rng)
    with pytest.raises(ValueError, match="diloco.merge"):
        merge.merge([v], [1.0], "median")
    with pytest.raises(ValueError, match="diloco.merge"):
        merge.merge_outer_step(theta, [v], [1.0], "median", merge.OuterState({}), 1.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        merge.merge_mean([], [])
    with pytest.raises(ValueError, match="positive weight"):
        merge.merge_rda([v, v], [0.0, 0.0])
    with pytest.raises(ValueError, match="shape"):
        merge.merge_mean([v, {**v, "ffw/down": np.zeros(3, np.float32)}], [1.0, 1.0])
    with pytest.raises(ValueError, match="leaf names"):
        merge.merge_mean([v, {"other": np.zeros(3, np.float32)}], [1.0, 1.0])
    with pytest.raises(ValueError, match="not in the fragment"):
        outer.outer_step(theta, v, merge.OuterState({"extra": np.zeros(1)}), 1.0, 0.0)
    with pytest.raises(ValueError, match="float32"):
        as64 = {k: x.astype(np.float64) for k, x in theta.items()}
        outer.outer_step(as64, v, merge.OuterState({}), 1.0, 0.0, inplace=True)


def test_weigh_roster_scales_by_the_merged_share_and_counts_rounds_of_work():
    # Two offers of learners with 64 tokens per step (one with two rounds of work), one live
    # learner without an offer: 2 of 3 learners' weight, (1 + 2) / 3 rounds of work.
    q = merge.learner_weight(64, "tokens")
    w, scale, work = merge.weigh([256, 512], [4, 8], "tokens", "roster", 4, others=[q])
    np.testing.assert_allclose(w, [q, q])
    assert scale == pytest.approx(2 / 3) and work == pytest.approx(1.0)
    # The paper's normalisation: c_tokens² / c_steps over the merged offers only.
    w, scale, work = merge.weigh([256, 512], [4, 8], "tokens", "merged", 4, others=[q])
    np.testing.assert_allclose(w, [256**2 / 4, 512**2 / 8])
    assert scale == work == 1.0


def test_a_full_round_is_exactly_diloco_with_either_momentum_clock():
    rng = np.random.default_rng(3)
    theta, delta = tree(rng), tree(rng, 0.1)
    state = merge.OuterState({k: np.asarray(rng.standard_normal(np.shape(v)), np.float32)
                              for k, v in theta.items()})  # fmt: skip
    ref = outer.outer_step(theta, delta, state, 0.7, 0.9, work=1.0, clock="merge")
    got = outer.outer_step(theta, delta, state, 0.7, 0.9, work=1.0, clock="work")
    for k in theta:
        np.testing.assert_array_equal(ref[0][k], got[0][k])
        np.testing.assert_array_equal(ref[1].momentum[k], got[1].momentum[k])


@pytest.mark.parametrize("nesterov", [True, False])
def test_work_clock_makes_partial_merges_add_up_to_rounds(nesterov):
    """Twenty rounds of outer gradients, each delivered as one merge or as four merges of a
    quarter: with the work clock Θ follows the one-merge trajectory within ~5% (momentum
    remembers rounds of work); one momentum step per merge drifts far from it."""
    rng = np.random.default_rng(0)
    deltas = [{"w": rng.standard_normal(50).astype(np.float32)} for _ in range(20)]

    def trajectory(n: int, clock: str) -> np.ndarray:
        theta = {"w": np.zeros(50, np.float32)}
        state = merge.OuterState.zeros(theta)
        out = []
        for d in deltas:
            for _ in range(n):
                part = {"w": d["w"] / n}
                theta, state = outer.outer_step(theta, part, state, 0.7, 0.9, nesterov,
                                                work=1 / n, clock=clock)  # fmt: skip
            out.append(theta["w"].copy())
        return np.array(out)

    full = trajectory(1, "work")
    scale = np.abs(full).max()
    assert np.abs(trajectory(4, "work") - full).max() < 0.08 * scale
    assert np.abs(trajectory(4, "merge") - full).max() > 0.25 * scale


@pytest.mark.parametrize("momentum", [0.5, 0.9])
@pytest.mark.parametrize("nesterov", [True, False])
def test_work_clock_steady_state_step_per_round_is_dilocos_however_split(nesterov, momentum):
    """The same outer gradient every round, delivered as one merge or as n merges of 1/n of
    the work: once momentum has settled, Θ moves by DiLoCo's lr·Δ/(1 − μ) per round in
    every split (a look of c·μ per merge stepped 7-14% less at μ = 0.5)."""
    lr, rounds = 0.5, 400
    delta = {"w": np.linspace(-1.0, 1.0, 8).astype(np.float32)}
    want = lr / (1 - momentum) * delta["w"]
    for n in (1, 2, 3, 8):
        theta = {"w": np.zeros(8, np.float32)}
        state = merge.OuterState.zeros(theta)
        for _round in range(rounds):
            before = theta["w"].copy()
            for _ in range(n):
                part = {"w": delta["w"] / np.float32(n)}
                theta, state = outer.outer_step(theta, part, state, lr, momentum, nesterov,
                                                work=1 / n, clock="work")  # fmt: skip
        np.testing.assert_allclose(before - theta["w"], want, rtol=2e-4, err_msg=f"n={n}")


def test_fused_merge_applies_the_roster_scale():
    rng = np.random.default_rng(5)
    theta, vs = tree(rng), [tree(rng, 0.1) for _ in range(2)]
    w = np.array([1.0, 3.0])
    for rule in merge.RULES:
        delta = merge.merge(vs, w, rule)
        scaled = {k: np.float32(0.5) * v for k, v in delta.items()}
        ref, _ = outer.outer_step(theta, scaled, merge.OuterState.zeros(theta), 0.7, 0.9)
        got, _ = merge.merge_outer_step(theta, vs, w, rule, merge.OuterState.zeros(theta),
                                        0.7, 0.9, scale=0.5)  # fmt: skip
        for k in theta:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", merge.RULES)
@pytest.mark.parametrize("nesterov", [True, False])
def test_threaded_merges_are_bit_identical_and_use_the_threads(monkeypatch, rule, nesterov):
    """Spans of chunks on several threads give the same Θ, momentum and ‖Δ‖ bits as one
    thread, and the spans really run on the pool."""
    monkeypatch.setattr(chunks, "CHUNK", 5)  # 33-element leaves: 7 chunks, ragged last
    spans = []  # (thread name, span) of every span run
    plain_map = chunks.map_spans

    def recording(fn, n, threads=None):
        def span(a, b):
            spans.append((threading.current_thread().name, (a, b)))
            return fn(a, b)

        return plain_map(span, n, threads)

    monkeypatch.setattr(chunks, "map_spans", recording)
    rng = np.random.default_rng(21)
    theta, w = tree(rng), [1.0, 2.0, 0.5]
    vs = [tree(rng, scale=0.1) for _ in w]
    state = tree(rng, scale=0.01)
    results = {}
    for threads in (1, 3, 4):
        th = {k: x.copy() for k, x in theta.items()}
        st = merge.OuterState({k: x.copy() for k, x in state.items()})
        spans.clear()
        out, out_state, dn = merge.merge_outer_step(
            th, vs, w, rule, st, 0.7, 0.9, nesterov, inplace=True, return_delta_norm=True,
            threads=threads,
        )  # fmt: skip
        results[threads] = (out, out_state.momentum, dn)
        on_pool = sum(name.startswith("merge") for name, _ in spans)
        assert on_pool >= (threads if threads > 1 else 0) and (threads > 1 or not on_pool)
    for threads in (3, 4):
        out, mom, dn = results[threads]
        assert dn == results[1][2]
        for k in SHAPES:
            np.testing.assert_array_equal(out[k], results[1][0][k], err_msg=k)
            np.testing.assert_array_equal(mom[k], results[1][1][k], err_msg=k)


def test_map_spans_covers_every_chunk_once_in_order(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK", 5)
    starts = lambda a, b: [s.start for s in chunks.slices(b, a)]  # noqa: E731
    for n in (1, 5, 33, 61):
        for threads in (1, 2, 3, 8):
            assert chunks.map_spans(starts, n, threads) == list(range(0, n, 5)), (n, threads)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("held", [True, False])
def test_a_learners_rebase_delta_in_chunks_and_threads_is_exact(monkeypatch, threads, held):
    """δ = Θ_new − G (+ v̂ when Θ_new holds our offer), one chunked pass per leaf over any
    number of threads: the same bits as the plain formula, every leaf keeps its shape."""
    from decoupled_diloco.diloco.updates import rebase_delta

    monkeypatch.setattr(chunks, "CHUNK", 7)  # many chunks, ragged last one
    rng = np.random.default_rng(3)
    new, anchor, sent = tree(rng), tree(rng), tree(rng, scale=0.1)
    got = rebase_delta(anchor, new, sent if held else None, threads)
    for k in SHAPES:
        want = np.subtract(new[k], anchor[k], dtype=np.float32)
        if held:
            want = want + sent[k]
        assert got[k].shape == np.shape(new[k]) and got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], want)


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("clock", ["merge", "work"])
def test_momentum_0_steps_theta_bit_for_bit_and_leaves_the_buffer(
    monkeypatch, inplace, nesterov, clock
):
    """With momentum 0 the fused step is Θ − lr·Δ exactly, and skips the buffer (read by no
    later step while the momentum is 0): the syncer's merge then makes two passes less."""
    monkeypatch.setattr(chunks, "CHUNK", 7)  # many chunks, ragged last one
    rng = np.random.default_rng(21)
    theta, vs = tree(rng), [tree(rng, scale=0.01) for _ in range(3)]
    w = np.array([1.0, 2.0, 0.5])
    buffers = tree(rng)  # not zeros: a buffer left as it is must still hold these
    state = merge.OuterState({k: x.copy() for k, x in buffers.items()})
    expected_delta = merge.merge(vs, w, "rda")
    new, new_state = merge.merge_outer_step(
        {k: x.copy() for k, x in theta.items()}, vs, w, "rda", state, 0.7, 0.0,
        nesterov=nesterov, clock=clock, work=0.5, inplace=inplace,
    )  # fmt: skip
    for k in SHAPES:
        want = theta[k] - np.multiply(expected_delta[k], np.float32(0.7), dtype=np.float32)
        np.testing.assert_array_equal(new[k], want)
        np.testing.assert_array_equal(new_state.momentum[k], buffers[k])
    # The same merge with momentum 0.5 does move the buffer (the fast path is momentum 0's).
    moved = merge.OuterState({k: x.copy() for k, x in buffers.items()})
    merge.merge_outer_step({k: x.copy() for k, x in theta.items()}, vs, w, "rda", moved,
                           0.7, 0.5, clock=clock, work=0.5, inplace=True)  # fmt: skip
    assert not np.array_equal(moved.momentum["ffw/down"], buffers["ffw/down"])


def test_rda_turns_theta_by_each_offers_share_of_the_work():
    """RDA normalises each offer, so the steps an outer gradient holds are gone from its
    direction: with the roster's per-learner weights alone a 1-step offer (a rejoin's, a
    final one) merged beside a 24-step one turned Θ's step as much as it (cos 0.72 with
    each), moving Θ along its own gradient by twice that gradient's norm. Its direction
    weight is now its work, c_tokens²/c_steps (its share, 1/25); its radius stays linear."""
    assert list(merge.direction_weights([24 * 64, 64], [24, 1], "tokens", "roster")) == [
        24 * 64**2, 64**2
    ]  # fmt: skip
    assert list(merge.direction_weights([24 * 64, 64], [24, 1], "uniform", "roster")) == [24, 1]
    assert list(merge.direction_weights([24 * 64, 64], [24, 1], "uniform", "merged")) == [1, 1]
    plan = make_fragment_plan({"w": (64,)}, 1, "balanced", sync_every=24)
    cfg = DilocoConfig(learners=2, sync_every=24, quorum=2, grace_gamma=0.0, merge="rda",
                       outer_lr=1.0, outer_momentum=0.0, max_wait=-1.0)  # fmt: skip
    theta = {"w": np.zeros(64, np.float32)}
    s = Syncer(cfg, plan, theta)
    rng = np.random.default_rng(0)
    v_a = rng.standard_normal(64).astype(np.float32)  # 24 steps of work
    v_b = (0.2 * rng.standard_normal(64)).astype(np.float32)  # one step
    for m in (0, 1):
        s.handle(Join(m, 0, 0.0), 0.0)
    s.handle(Offer(0, 0, 0, 24, 24, 64 * 24, 0, 0.0, compression.encode({"w": v_a}, "none")), 1.0)
    s.handle(Offer(1, 0, 0, 24, 1, 64, 0, 0.0, compression.encode({"w": v_b}, "none")), 1.0)
    assert s.version[0] == 1
    delta = -s.theta[0]["w"].astype(np.float64)  # Θ_new = Θ_0 − Δ (outer lr 1, no momentum)

    def unit(x):
        return x / np.linalg.norm(x)

    u = unit(24 * unit(v_a) + unit(v_b))  # directions weighed by work
    np.testing.assert_allclose(unit(delta), u, atol=1e-5)
    # The radius: each offer's norm at its roster share (q / Q = 1/2 each), as the mean.
    assert np.linalg.norm(delta) == pytest.approx((np.linalg.norm(v_a) + np.linalg.norm(v_b)) / 2)
