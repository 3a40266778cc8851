"""Simulator parameters: every timing knob, its default and the reasoning behind it.

The defaults are chosen once for every cell of the goodput table (any N, any method, any M);
nothing is fitted per cell. Each field's `help` metadata (the reasoning, in full) is also the
help of the `python -m decoupled_diloco.simulate` flag of the same name. In short:

  chip_mtbf_years   1      paper's setting; cluster MTBF = MTBF / N (26 s at 1.2M chips)
  slice_chips       64     a 4x4x4 TPU cube: what one chip failure takes out of a DP job
  chip_return_s     8 h    repair turnaround of a failed slice (one shift); an elastic job
                           runs 64 * 8 h / 1 y = 5.8% short of chips
  detect_s          5 s    collective / heartbeat timeout
  reconfig_s        11 s   elastic re-mesh from the compilation cache; with detect_s the one
                           knob the elastic numbers hinge on, set once at the 1.2M cell
  step_s            2 s    in-flight step lost on an elastic failure
  restart_s         30 s   non-elastic relaunch onto hot spares
  restore_s         20 s   in-memory checkpoint restore and broadcast
  checkpoint_interval_s 10 s   asynchronous in-memory snapshot every 5 steps
  sync_period_s     48 s   H = 24 steps between offers of one fragment; P = 24 fragments
  quorum            1      K (paper)
  speed spreads     0      the headline table isolates failures

`experiments/README.md` (goodput section) explains the calibration and its limits.
"""

import dataclasses

METHODS = ("dp", "elastic_dp", "decoupled")

YEAR_S = 365.0 * 24 * 3600


def _p(default, help_text: str):
    return dataclasses.field(default=default, metadata={"help": help_text})


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
        "Mean time between failures of one chip, in years (the paper's setting). Failures "
        "are independent exponential clocks, sampled as one Poisson process of rate N/MTBF.",
    )
    slice_chips: int = _p(
        64,
        "Chips per slice, the unit a chip failure takes out: one 4x4x4 TPU cube (v4/v5p), "
        "the smallest block the optical circuit switches can swap. A data-parallel "
        "replica spans whole slices, so an elastic job drops the slice, not the chip.",
    )
    chip_return_s: float = _p(
        8 * 3600.0,
        "Time until a failed slice is back in service (drain, diagnose, replace the failed "
        "host or tray, burn-in, re-admit): 8 h, one repair shift, inside the hours-to-a-day "
        "turnaround of data-centre fleets. It sets the capacity an elastic job runs "
        "without: slice_chips * chip_return_s / MTBF = 5.8% of the chips at the defaults.",
    )
    detect_s: float = _p(
        5.0,
        "Failure detection: collective/heartbeat timeout before anyone reacts (a hung "
        "all-reduce is noticed within seconds on a healthy interconnect).",
    )
    reconfig_s: float = _p(
        11.0,
        "Elastic reconfiguration pause: rebuild the mesh without (or with returned) slices, "
        "load the program already compiled for that shape from the compilation cache, "
        "re-shard the data pipeline; survivors keep their parameters, so nothing is "
        "restored. Order of ten seconds; detect_s + reconfig_s = 16 s was set once so "
        "elastic DP at 1.2M chips matches the paper, every other cell follows.",
    )
    step_s: float = _p(
        2.0,
        "Training step time. On an elastic failure the in-flight step is discarded "
        "(on average half a step of work is lost).",
    )
    restart_s: float = _p(
        30.0,
        "Non-elastic relaunch: tear down, re-schedule the whole job onto hot spares, start "
        "processes, initialise collectives, load the compiled program from cache.",
    )
    restore_s: float = _p(
        20.0,
        "Checkpoint restore after a relaunch: read the in-memory/peer checkpoint and "
        "broadcast it (multi-tier checkpointing keeps the latest state in host RAM).",
    )
    checkpoint_interval_s: float = _p(
        10.0,
        "Data-parallel checkpoint interval: asynchronous in-memory snapshots every 5 steps, "
        "the favourable end of practice; a failure loses the work since the last one.",
    )
    hot_spares: bool = _p(
        True,
        "Chip-MTBF mode only: non-elastic DP relaunches onto hot-spare slices, so it "
        "waits for the relaunch, not for the repair. With a FaultSpec the schedule's "
        "restart time is authoritative (the failed learner itself must be back).",
    )
    sync_period_s: float = _p(
        48.0,
        "Decoupled DiLoCo: time between two offers of the same fragment (H = 24 steps of "
        "step_s). A learner that loses its whole state loses on average half of it.",
    )
    fragments: int = _p(24, "P: fragments, offered on staggered schedules (paper: 24).")
    quorum: int = _p(
        1,
        "K: minimum quorum. The global model advances while >= K learners run and the "
        "syncer is up (paper: K = 1). Learners never wait for it (max_wait = 0).",
    )
    chip_speed_std: float = _p(
        0.0,
        "Constant per-chip speed spread (log-normal std of the step-time factor). A slice "
        "runs at its slowest chip; synchronous jobs run at their slowest slice. 0 for the "
        "headline table, which isolates failures.",
    )
    step_noise_std: float = _p(
        0.0,
        "Per-step, per-slice step-time noise (log-normal std); synchronous jobs wait for "
        "the slowest slice every step, decoupled learners only for their own slices.",
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


def validate_sim_params(p: SimParams) -> None:
    """Raises ValueError naming the offending field (the CLI flag of the same name)."""
    positive = ("horizon_days", "chip_mtbf_years", "step_s", "checkpoint_interval_s")
    positive += ("sync_period_s", "slow_factor")
    for name in positive:
        if not getattr(p, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(p, name)}")
    non_negative = ("chip_return_s", "detect_s", "reconfig_s", "restart_s", "restore_s")
    non_negative += ("chip_speed_std", "step_noise_std")
    for name in non_negative:
        if not getattr(p, name) >= 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(p, name)}")
    for name in ("slice_chips", "fragments", "quorum"):
        if int(getattr(p, name)) != getattr(p, name) or getattr(p, name) < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {getattr(p, name)}")
    if not 0 <= p.slow_fraction <= 1:
        raise ValueError(f"slow_fraction must be in [0, 1], got {p.slow_fraction}")
