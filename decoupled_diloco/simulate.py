r"""Goodput simulator command line.

    python -m decoupled_diloco.simulate --method=decoupled --chips=1200000 --learners=8 \
        --chip_mtbf_years=1 --seed=0 --json

prints one JSON object with (at least) goodput, uptime, downtime_seconds and failures. Every
timing parameter of `decoupled_diloco.simulator.SimParams` is a flag of the same name; its
help text gives the default's reasoning (`--helpfull` lists them).

To predict a real run, pass its fault schedule: `--fault_spec=path.json` (or an inline JSON
object) holding `FaultSpec` fields, e.g.

    python -m decoupled_diloco.simulate --method=decoupled --chips=4 --learners=4 \
        --fault_spec='{"seed": 0, "chip_mtbf_hours": 0.2, "restart_delay_s": 5}' \
        --horizon_days=0.01 --restore_s=0.5 --json

Then each learner is one unit of faults.chips_per_learner chips and crashes, restarts,
joins, leaves and syncer crashes come from the same `FaultSchedule` the run replays; set
the timing flags to the CPU run's measured step, rejoin and restore times (for DP also
--checkpoint_interval_s, the run's interval, and --checkpoint_cost_s, its synchronous save
time: 0 for an asynchronous one). The schedule
also brings its own seed ("seed" in the spec) and speeds, so the flags of the chip-MTBF
failure model (`CHIP_MTBF_ONLY`: --seed, --chip_mtbf_years, --slice_chips, ...) have no
effect with --fault_spec; giving one of them explicitly is an error rather than silently
ignored, as is a timing flag the method does not read with a schedule
(`UNREAD_WITH_SPEC`: a decoupled learner's crash is its own schedule's restart).
"""

import dataclasses
import json
import os
import sys

from absl import flags

from decoupled_diloco import cli, faults
from decoupled_diloco.simulator import METHODS, SimParams, simulate
from decoupled_diloco.simulator.params import validate_sim_params

flags.DEFINE_enum("method", "decoupled", METHODS, "dp | elastic_dp | decoupled.")
flags.DEFINE_integer("chips", 1_200_000, "N: chips in the job (divisible by --learners).")
flags.DEFINE_integer(
    "learners",
    1,
    "M: Decoupled DiLoCo learners of N/M chips (dp, elastic_dp: chip groups "
    "for --slow_fraction; 1 otherwise).",
)
flags.DEFINE_bool("json", False, "Print one JSON object instead of a readable summary.")
flags.DEFINE_string(
    "fault_spec",
    "",
    "A FaultSpec as a JSON file path or an inline JSON object; replaces "
    "the chip-MTBF failure model by that schedule (one unit per learner).",
)

_DEFINE = {int: flags.DEFINE_integer, float: flags.DEFINE_float, bool: flags.DEFINE_bool}
for _f in dataclasses.fields(SimParams):
    _DEFINE[type(_f.default)](_f.name, _f.default, _f.metadata["help"])

FLAGS = flags.FLAGS

# SimParams fields only the chip-MTBF failure model reads; a FaultSpec replaces them.
CHIP_MTBF_ONLY = (
    "seed",
    "chip_mtbf_years",
    "slice_chips",
    "replace_s",
    "chip_speed_std",
    "step_noise_std",
    "slow_fraction",
    "slow_factor",
)


# SimParams fields a method does not read (its own failure handling has no use for them).
UNREAD_BY = {
    "dp": ("reconfig_s", "sync_period_s", "fragments", "quorum"),
    "elastic_dp": ("sync_period_s", "fragments", "quorum"),
    "decoupled": ("checkpoint_cost_s", "checkpoint_interval_s"),
}


def _refuse_ignored(names, given: list[str], why: str) -> None:
    """ValueError naming the flags of `names` among the explicitly `given` ones, which would
    be ignored `why` ("them" in it becomes "it" for one flag)."""
    ignored = [name for name in names if name in given]
    if ignored:
        flags_ = ", ".join(f"--{n}" for n in ignored)
        why = why if len(ignored) > 1 else why.replace("them", "it")
        raise ValueError(f"{flags_} would be ignored {why}")


def check_method_flags(method: str, given: list[str]) -> None:
    """The explicitly `given` flags must all be read by `method` (ValueError naming them)."""
    _refuse_ignored(
        UNREAD_BY.get(method, ()), given, f"with --method={method}: it does not read them"
    )


# SimParams fields a method does not read with --fault_spec, where each learner is one unit
# and the schedule's restart times (restart_delay_s) are a crashed learner's relaunch: an
# elastic job detects and reconfigures around it but relaunches nothing, and a decoupled
# learner's crash stops no other (its step_s only places a schedule in steps in time).
UNREAD_WITH_SPEC = {
    "dp": (),
    "elastic_dp": ("restart_s",),
    "decoupled": ("restart_s", "detect_s", "reconfig_s"),
}


def check_fault_spec_flags(given: list[str], method: str = "dp", unit: str = "seconds") -> None:
    """With --fault_spec, the explicitly `given` flags must not include CHIP_MTBF_ONLY ones,
    nor what `method` does not read with a schedule (`UNREAD_WITH_SPEC`; `unit`: the
    spec's)."""
    chip_mtbf = ('with --fault_spec: the fault schedule replaces the chip-MTBF model (set '
                 '"seed", speeds and crashes in the spec instead)')  # fmt: skip
    _refuse_ignored(CHIP_MTBF_ONLY, given, chip_mtbf)
    unread = list(UNREAD_WITH_SPEC[method])
    if method == "decoupled" and unit != "steps":
        unread.append("step_s")
    alone = "; no other learner stops for it" if method == "decoupled" else ""
    one_unit = (f"with --fault_spec and --method={method}: each learner is one unit, down from "
                f'its crash to its restart in the schedule ("restart_delay_s"), then '
                f"--restore_s{alone}")  # fmt: skip
    _refuse_ignored(unread, given, one_unit)


def load_fault_spec(text: str) -> faults.FaultSpec:
    """A FaultSpec from an inline JSON object or a JSON file path; a ValueError naming
    --fault_spec (and the file) when it cannot be read."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--fault_spec: the inline JSON object does not parse ({e})") from e
    elif os.path.isdir(text):
        raise ValueError(f"--fault_spec={text} is a folder, not a JSON file")
    elif os.path.exists(text):
        try:
            with open(text, encoding="utf-8") as f:
                data = json.load(f)
        except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError, no access
            raise ValueError(f"--fault_spec={text}: not a JSON object ({e})") from e
    else:
        raise ValueError(f"fault_spec is neither a JSON object nor an existing file: {text!r}")
    if not isinstance(data, dict):
        raise ValueError(f"--fault_spec={text}: holds a JSON {type(data).__name__}, not an object")
    return faults.fault_spec_from_dict(data)


# Decoupled DiLoCo's simulation builds each learner's timeline from the whole trace, so its
# time grows as learners x (units + events / 20): units are slices (learners with
# --fault_spec), walked in Python, events each failure and return, compared in numpy;
# STEPS_PER_S of these a second on one slow core (40,000 learners of 30 chips: 1.8e9, 2 min;
# 1.2M learners of one chip would take a day). Beyond MAX_LEARNER_UNITS (~2 h) the
# command refuses (most likely learners and chips mixed up); beyond NOTE_LEARNER_UNITS (half
# a minute) it says how long it will take.
STEPS_PER_S = 1.5e7
MAX_LEARNER_UNITS = 1e11
NOTE_LEARNER_UNITS = 5e8


def check_size(method: str, chips: int, learners: int, p: SimParams, spec) -> None:
    """A ValueError naming --learners when the simulation would run for more than ~2 hours;
    a note on stderr when for half a minute or more. Other limits (memory, divisibility):
    `simulate`'s."""
    if method != "decoupled" or learners < 1 or chips < learners or p.slice_chips < 1:
        return  # one timeline for every chip (or simulate's own error)
    if spec is None:
        units = learners * -(-(chips // learners) // p.slice_chips)
        events = 2 * chips * p.horizon_s / p.chip_mtbf_s if p.chip_mtbf_s > 0 else 0
        what = f"slices of at most --slice_chips={p.slice_chips}"
    else:
        units, events, what = learners, 0, "learners"
    work = learners * (units + events / 20)
    size = (f"--learners={learners:,} of --chips={chips:,}: each learner's timeline walks the "
            f"whole trace, {units:,} units ({what}), {work:.2g} steps in all")  # fmt: skip
    seconds = work / STEPS_PER_S
    took = f"~{seconds / 3600:.0f} h" if seconds > 7200 else f"~{seconds / 60:.0f} min"
    if work > MAX_LEARNER_UNITS:
        raise ValueError(
            f"{size}, {took} (at most {MAX_LEARNER_UNITS:.0e}, ~2 h): simulate fewer "
            "learners (M learners of N/M chips: --chips is the whole job's)"
        )
    if work > NOTE_LEARNER_UNITS:
        print(f"{size}: {took}", file=sys.stderr, flush=True)


def main(argv):
    cli.refuse_stray_arguments(argv)
    params = SimParams(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(SimParams)})
    try:
        validate_sim_params(params)  # (a bad horizon first: the size check divides by it)
        check_method_flags(FLAGS.method, [n for n in UNREAD_BY[FLAGS.method] if FLAGS[n].present])
        spec = None
        if FLAGS.fault_spec:
            spec = load_fault_spec(FLAGS.fault_spec)
            given = [f.name for f in dataclasses.fields(SimParams) if FLAGS[f.name].present]
            check_fault_spec_flags(given, FLAGS.method, spec.unit)
        check_size(FLAGS.method, FLAGS.chips, FLAGS.learners, params, spec)
        if spec is not None:
            # before any arithmetic on it, over the timeline it is drawn on (--horizon_days)
            faults.validate_fault_spec(spec, FLAGS.learners, horizon_s=params.horizon_s)
        result = simulate(FLAGS.method, FLAGS.chips, FLAGS.learners, params, spec)
    except ValueError as e:
        sys.exit(f"error: {e}")  # (a UsageError would print every flag's help above it)
    if FLAGS.json:
        print(json.dumps(result.to_dict()))
        return
    print(
        f"{result.method} N={result.chips:,} M={result.learners} seed={result.seed} "
        f"over {result.horizon_s / 86400:g} days:\n"
        f"  goodput   {result.goodput:.1%}\n"
        f"  uptime    {result.uptime:.2%} (downtime {result.downtime_seconds:,.0f} s)\n"
        f"  failures  {result.failures:,} (recoveries {result.recoveries:,})"
    )


if __name__ == "__main__":
    cli.run_script(main)
