"""Simulator parameters: every timing knob, its default, where the default comes from.

One setting serves every cell of the goodput table (any N, any method, any M); nothing is
fitted to the paper's numbers. Each field's `help` metadata says whether its default is the
paper's setting, sourced, or an assumption, and why; it is also the help of the
`python -m decoupled_diloco.simulate` flag of the same name. Each assumption also carries a
`plausible` (low, high) range, which experiments/goodput_sensitivity.py sweeps. In short:

  chip_mtbf_years      1      paper; cluster MTBF = MTBF / N (26 s at 1.2M chips)
  slice_chips          64     source: a TPU v4/v5p 4x4x4 cube, what one chip failure takes out
  replace_s            30 s   assumption: a hot spare cube is patched in (the repair of the
                              failed one is the fleet's business, not the job's allocation)
  detect_s             5 s    assumption: heartbeat / collective timeout
  reconfig_s           10 s   assumption: elastic re-mesh from the compilation cache
  restart_s            30 s   assumption: non-elastic relaunch of the whole job
  restore_s            20 s   assumption: restore from an in-memory (peer) snapshot
  checkpoint_cost_s    0.5 s  assumption: a data-parallel step's stall per snapshot
  checkpoint_interval  auto   source: Young's optimum sqrt(2 * cost * job MTBF)
  step_noise_std       1%     assumption: per-step, per-slice step-time jitter
  step_s, H, P, K      2 s, 24, 24, 1   paper's H, P, K; step time: assumption

`experiments/README.md` (goodput section) has the sensitivity table of every assumption.
"""

import dataclasses

from decoupled_diloco.fault_spec import MAX_SLOWDOWN, MAX_SPEED_NOISE

METHODS = ("dp", "elastic_dp", "decoupled")

YEAR_S = 365.0 * 24 * 3600
# A fragment holds at least one parameter leaf (diloco/fragments.py), and no model has this
# many; the simulator keeps an array per fragment.
MAX_FRAGMENTS = 10_000
# Steps in the horizon: a time's step index (t / step_s) is exact in float64 and int64
# below 2**53; past it the cast overflows.
MAX_STEPS = 2**53
# The bounds of the fault schedule's own log-normal noise and slowdowns (fault_spec.py).
MAX_LOG_STD, MAX_SLOW_FACTOR = MAX_SPEED_NOISE, MAX_SLOWDOWN


def _p(default, help_text: str, plausible: tuple | None = None):
    meta = {"help": help_text}
    if plausible is not None:
        meta["plausible"] = plausible
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class SimParams:
    """Hardware, recovery and algorithm timings of one simulated run (seconds unless named)."""

    seed: int = _p(
        0,
        "Seed of the chip-failure trace and the speed-noise samples. Not used with "
        "--fault_spec, whose schedule has its own seed (an error if given with it).",
    )
    horizon_days: float = _p(
        14.0,
        "Simulated wall time in days. Two weeks gives ~46k failures at 1.2M chips, so the "
        "seed-to-seed spread of goodput is well under a point.",
    )
    chip_mtbf_years: float = _p(
        1.0,
        "[paper] Mean time between failures of one chip, in years. Failures are independent "
        "exponential clocks, sampled as one Poisson process of rate N/MTBF.",
        (0.5, 2.0),
    )
    slice_chips: int = _p(
        64,
        "[source: TPU v4, Jouppi et al., ISCA 2023] Chips per slice, the unit a chip failure "
        "takes out: one 4x4x4 cube, the block the optical circuit switches swap. A "
        "data-parallel replica spans whole slices, so an elastic job drops the slice.",
        (16, 256),
    )
    replace_s: float = _p(
        30.0,
        "[assumption] Failure -> a replacement slice ready to join the job: a hot spare cube "
        "(powered, health-checked) patched in by the optical switches, its hosts starting "
        "the job's processes, i.e. what a relaunch does (restart_s). The failed cube goes "
        "to repair outside the job, for every method alike. Non-elastic DP waits for it; "
        "elastic jobs run on without the slice and re-add its replacement at the next "
        "reconfiguration. 8 h here models a fleet without spares (the slice's own repair).",
        (0.0, 8 * 3600.0),
    )
    detect_s: float = _p(
        5.0,
        "[assumption] Failure detection: heartbeat / collective timeout before anyone "
        "reacts (a few missed 1 s heartbeats).",
        (1.0, 30.0),
    )
    reconfig_s: float = _p(
        10.0,
        "[assumption] Elastic reconfiguration pause: rebuild the mesh without (or with "
        "returned) slices, load the program compiled for that shape from the compilation "
        "cache, re-shard the data pipeline; survivors keep their parameters.",
        (2.0, 60.0),
    )
    step_s: float = _p(
        2.0,
        "[assumption] Training step time of a large pre-training job. On an elastic failure "
        "the in-flight step is discarded (half a step of work lost on average).",
        (1.0, 8.0),
    )
    restart_s: float = _p(
        30.0,
        "[assumption] Non-elastic relaunch: tear down, start every process, initialise "
        "collectives, load the compiled program from cache.",
        (10.0, 300.0),
    )
    restore_s: float = _p(
        20.0,
        "[assumption; mechanism: Gemini 1.0 report, recovery from an intact in-memory "
        "replica] Restore after a relaunch (and a learner's rejoin): read the latest "
        "in-memory snapshot from host RAM or a peer replica and broadcast it.",
        (5.0, 120.0),
    )
    checkpoint_cost_s: float = _p(
        0.5,
        "[assumption] Data-parallel snapshot stall: the part of an in-memory checkpoint that "
        "blocks the step (the device -> host copy not hidden behind compute). Charged to "
        "non-elastic DP, the only method that rolls back to snapshots: elastic survivors "
        "keep the state, learners' state lives with the syncer.",
        (0.05, 5.0),
    )
    checkpoint_interval_s: float = _p(
        0.0,
        "Data-parallel snapshot interval; 0 = Young's first-order optimum (Young, CACM 1974; "
        "Daly 2006) sqrt(2 * checkpoint_cost_s * job MTBF), at least one step: a job that "
        "fails more often snapshots more often. A failure loses the work since the last one.",
    )
    sync_period_s: float = _p(
        48.0,
        "[paper's H = 24 steps of step_s] Decoupled DiLoCo: time between two offers of the "
        "same fragment. A learner that loses its whole state loses on average half of it.",
    )
    fragments: int = _p(
        24, f"[paper] P: fragments, offered on staggered schedules (at most {MAX_FRAGMENTS:,})."
    )
    quorum: int = _p(
        1,
        "[paper] K: minimum quorum. The global model advances while >= K learners run and "
        "the syncer is up. Learners never wait for it (max_wait = 0).",
    )
    chip_speed_std: float = _p(
        0.0,
        "Constant per-chip speed spread (log-normal std of the step-time factor). A slice "
        "runs at its slowest chip; synchronous jobs run at their slowest slice. 0: TPU "
        "clocks are fixed, and a chronically slow chip is a failure (drained, replaced).",
    )
    step_noise_std: float = _p(
        0.01,
        "[assumption; stragglers at scale: Lin et al., OSDI 2025] Per-step, per-slice "
        "step-time jitter (log-normal std): host input pipeline, network congestion, "
        "thermal throttling. A synchronous group waits every step for its slowest slice, "
        "so a job of S slices loses ~std * sqrt(2 ln S): a DP job of 1.2M chips (3.9%) "
        "about as much as a learner of 75k (3.2%); a decoupled learner never waits for "
        "others.",
        (0.0, 0.03),
    )
    slow_fraction: float = _p(
        0.0,
        "Heterogeneous learners: this fraction of learners (the last ones; for DP the same "
        "chips) runs slow_factor times slower.",
    )
    slow_factor: float = _p(1.0, "Step-time multiplier of the slow learners (1.18 = 18% slower).")

    @property
    def horizon_s(self) -> float:
        return self.horizon_days * 24 * 3600

    @property
    def chip_mtbf_s(self) -> float:
        return self.chip_mtbf_years * YEAR_S


def plausible_ranges() -> dict[str, tuple]:
    """{field: (low, high)} of every assumption with a plausible range (the sweep's axes)."""
    return {
        f.name: f.metadata["plausible"]
        for f in dataclasses.fields(SimParams)
        if "plausible" in f.metadata
    }


def validate_sim_params(p: SimParams) -> None:
    """Raises ValueError naming the offending field (the CLI flag of the same name)."""
    positive = ("horizon_days", "chip_mtbf_years", "step_s", "sync_period_s", "slow_factor")
    for name in positive:
        if not getattr(p, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(p, name)}")
    non_negative = ("replace_s", "detect_s", "reconfig_s", "restart_s", "restore_s")
    non_negative += ("checkpoint_cost_s", "checkpoint_interval_s")
    non_negative += ("chip_speed_std", "step_noise_std")
    for name in non_negative:
        if not getattr(p, name) >= 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(p, name)}")
    # Every time and factor is finite, except the two that mean "never" when infinite
    # (inf or a huge value made the goodput NaN, or left a knob without effect):
    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        if f.name not in ("chip_mtbf_years", "replace_s") and not abs(value) < float("inf"):
            raise ValueError(f"{f.name} must be finite, got {value}")
    for name in ("chip_speed_std", "step_noise_std"):  # log-normal stds (the paper's: 0.10)
        if getattr(p, name) > MAX_LOG_STD:
            raise ValueError(f"{name} must be at most {MAX_LOG_STD:g}, got {getattr(p, name)}")
    if p.slow_factor > MAX_SLOW_FACTOR:
        raise ValueError(f"slow_factor must be at most {MAX_SLOW_FACTOR:g}, got {p.slow_factor}")
    for name in ("slice_chips", "fragments", "quorum"):
        if int(getattr(p, name)) != getattr(p, name) or getattr(p, name) < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {getattr(p, name)}")
    if p.fragments > MAX_FRAGMENTS:
        raise ValueError(
            f"fragments must be at most {MAX_FRAGMENTS:,} (a fragment is at least one "
            f"parameter leaf), got {p.fragments:,}"
        )
    if not p.horizon_s / p.step_s < MAX_STEPS:
        raise ValueError(
            f"step_s ({p.step_s:g} s) leaves {p.horizon_s / p.step_s:.3g} steps in the "
            f"{p.horizon_days:g}-day horizon, past the 2**53 a step count holds: use a "
            "longer step_s or a shorter horizon_days"
        )
    if not 0 <= p.slow_fraction <= 1:
        raise ValueError(f"slow_fraction must be in [0, 1], got {p.slow_fraction}")
    if int(p.seed) != p.seed or not 0 <= p.seed < 2**63:  # (-5 ran as 2**63 - 5's trace)
        raise ValueError(f"seed must be an integer in [0, 2**63), got {p.seed}")
