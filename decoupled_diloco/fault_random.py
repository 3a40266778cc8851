"""The fault schedule's random streams: Poisson arrivals and hashed per-step noise.

Independent streams are derived from (seed, stream, ...), so enabling one kind of fault
does not move another's times; the per-step noise is a pure hash of (seed, learner, step),
so any process can recompute it without sharing a generator.
"""

import numpy as np


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A 64-bit mixing hash; uint64 arithmetic wraps on overflow, which is the point."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def hashed_normal(seed: int, learner, step) -> np.ndarray:
    """Standard normals that are a pure function of (seed, learner, step); broadcasts."""
    learner = np.asarray(learner, dtype=np.int64).astype(np.uint64)
    step = np.asarray(step, dtype=np.int64).astype(np.uint64)
    h = _splitmix64(np.full(np.broadcast(learner, step).shape, seed % 2**64, dtype=np.uint64))
    h = _splitmix64(_splitmix64(h ^ learner) ^ step)
    g = _splitmix64(h ^ np.uint64(0xD1B54A32D192ED03))
    u1 = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    u2 = (g >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng([seed % 2**63, *stream])


def poisson_times(
    rng: np.random.Generator, rate: float, horizon: float
) -> tuple[np.ndarray, np.ndarray]:
    """(arrival times in [0, horizon) of a rate-`rate` Poisson process, a uniform [0, 1) mark
    per arrival). Drawn in fixed-size chunks of exponential gaps, so a longer horizon only
    appends: a short run's timeline is a prefix of a long one's (a run and its simulation
    may use different horizons)."""
    times, marks, t = [], [], 0.0
    while t < horizon:
        arrivals = t + np.cumsum(rng.exponential(1.0 / rate, 1024))
        times.append(arrivals)
        marks.append(rng.uniform(0.0, 1.0, 1024))
        t = arrivals[-1]
    times_all, marks_all = np.concatenate(times), np.concatenate(marks)
    inside = times_all < horizon
    return times_all[inside], marks_all[inside]
