#!/usr/bin/env bash
# The accelerator checks of the quality and speed issues as prepared commands for a lent GPU
# (../.library/device: 15 minutes of device time per session, 10 per command, bare machine
# without ml-collections, results only through $OUT: at most 8 files).
#
# Here, once per session (pip can download here, not there):
#     bash scripts/device_check.sh wheels
# There, through the device tool's `run` (carry [".whl"], timeout_s 600), in this order:
#     bash scripts/device_check.sh overlap   # mid, seed 0: land vs rebase (ladder rungs, decoupled arm)
#     bash scripts/device_check.sh quality   # mid scale: streaming_sync vs decoupled, 2 seeds
#     bash scripts/device_check.sh more      # mid scale, seed 0: decoupled_lr1, dp, _km, _mom, _nag
#     bash scripts/device_check.sh overhead  # learner overhead alone (mid): decoupled, py-switch,
#                                            # syncer-proc beside plain, with cpu_share
#     bash scripts/device_check.sh fleet     # four mid learners on the GPU: syncer on a thread,
#                                            # then in a process
#     bash scripts/device_check.sh speed     # merge beside busy threads (host), learner overhead
#                                            # and fleet (mid), MFU (gemma_2b)
#     bash scripts/device_check.sh mfu       # MFU / memory (gemma_2b) alone: the rest of a lease
#     bash scripts/device_check.sh profile   # jax.profiler traces: one mid Decoupled learner, plain loop
#     bash scripts/device_check.sh gil       # py-spy: which threads hold the interpreter lock
#                                            # beside one mid Decoupled learner, and the plain loop
# Each part stops starting runs when the next would not end inside DEADLINE_S seconds (default
# 560; a run is assumed to last as long as the one before, and at least EXPECTED_RUN_S), and
# copies the tables after every run, so a part cut short still returns what ran.
# The quality parts share one run folder ($DEVICE_CHECK_DIR/q, default /tmp/device_check/q):
# on the same warm machine `more` reuses `quality`'s seed-0 runs; on a fresh one it runs
# them again.
#
# On a machine without a GPU, SMOKE=1 checks the plumbing: the tiny CPU scale, a few steps.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-}
if [[ $part == wheels ]]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  # ml-collections is the only import the device image lacks (its absl-py and PyYAML are
  # there); py-spy (a sampling profiler, one static binary) is for the `gil` part.
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .whl "ml-collections>=0.1.1" \
    "py-spy>=0.4.3"
fi
DEVICE_CHECK_DIR=${DEVICE_CHECK_DIR:-/tmp/device_check}
OUT=${OUT:-$DEVICE_CHECK_DIR/out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
DEADLINE_S=${DEADLINE_S:-560}
Q=$DEVICE_CHECK_DIR/q
if [[ ${SMOKE:-0} == 1 ]]; then
  SCALE=(--quick --set=train.steps=8 --set=train.warmup_steps=2 --set=train.eval_every=8)
else
  SCALE=(--scale=mid)
fi
python3 -c "import jax; print('devices:', jax.devices())" 2>&1 | tee -a "$OUT/$part.log"

# The next run is assumed to take as long as the last one, and at least EXPECTED_RUN_S;
# `fits` says so in the log when it would not end before the deadline.
last_run_s=0
fits() {
  local next=$((last_run_s > ${EXPECTED_RUN_S:-0} ? last_run_s : ${EXPECTED_RUN_S:-0}))
  (( SECONDS + next + 15 < DEADLINE_S )) && return 0
  echo "stopped: no time for another run" | tee -a "$OUT/$part.log"
  return 1
}

# The seconds left before DEADLINE_S, for one command's timeout; fails (saying so) under 20
# (`timeout 0` would mean no limit at all, and a negative one is an error).
left() {
  local s=$((DEADLINE_S - SECONDS))
  if ((s < 20)); then
    echo "stopped: ${s} s left before DEADLINE_S" | tee -a "$OUT/$part.log" >&2
    return 1
  fi
  echo "$s"
}

# quality ARMS SEEDS NAME: runs what the run folder lacks, then copies the table as NAME.*
quality() {
  local start=$SECONDS t
  t=$(left) || return 1
  timeout "$t" python3 experiments/quality_targets.py "${SCALE[@]}" \
    --arms="$1" --seeds="$2" --out=$Q >>"$OUT/$part.log" 2>&1
  local rc=$?
  last_run_s=$((SECONDS - start))
  for ext in md json; do
    [[ -f $Q/quality_targets.$ext ]] && cp "$Q/quality_targets.$ext" "$OUT/$3.$ext"
  done
  echo "[$SECONDS s] $1 seeds $2: rc $rc, $last_run_s s" | tee -a "$OUT/$part.log"
  return $rc
}

# gemma_2b from 16 x 1024 tokens per step (the MFU target's), the likeliest remat policy
# first: each compiles about three batches (mfu.largest_fitting_batch; a gemma_2b compile
# took 42 s on an H100, 2026-11-25), then times the largest that fits. Rows print as they
# finish, so a cut leaves the policies done.
mfu() {
  local args=(--mfu_batch=16 --remat=dots,full,none)
  [[ ${SMOKE:-0} == 1 ]] && args=(--quick)
  local t
  t=$(left) || return 1
  timeout "$t" python3 scripts/bench_accelerator.py "${args[@]}" \
    --part=mfu 2>&1 | tee -a "$OUT/speed_mfu.log"
}
# The learner's thread on the H200 (2026-11-28): host_share 0.88 where the plain loop's is
# 0.30, and Python's 5 ms switch interval ran it at 0.85 of plain against 0.70 (one round).
# Its cpu_share (CPU time over wall) says whether that host time is work of its own or
# waiting for the interpreter lock; syncer-proc takes the syncer's Python off that lock.
# 2 rounds x 200 steps of 4 arms side by side: about 2 minutes (H100, 2026-11-26: 4 arms x
# 2 rounds x 150 steps in ~2 minutes).
# The learner overhead, decoupled arms beside the plain loop. Every arm first runs once
# untimed (--warmup): the H200's 0.701 (2026-11-28) was one round whose decoupled arm, run
# first, compiled its fragments' ops inside the window; the compile_s column says what is
# left.
overhead() {
  local args=(--rounds=2 --steps=200 --arms=decoupled,py-switch,syncer-proc)
  [[ ${SMOKE:-0} == 1 ]] && args=(--quick --arms=decoupled,py-switch,syncer-proc)
  timeout $((DEADLINE_S / 2)) python3 scripts/bench_accelerator.py "${args[@]}" \
    --part=overhead 2>&1 | tee "$OUT/speed_overhead.log"
}
# Four mid learners sharing the GPU, as the quality runs do: do their merges keep H (steps
# per offer 12)? 54 s on an H100 (2026-11-26). Each argument one run: "" as configured,
# --local_syncer=process (the syncer in a process of its own, runtime/syncer_process.py:
# worse on the 2-core dev box, unmeasured beside a GPU; its merges took 76 ms on a thread
# beside four learners on the H200, 2026-11-28), --gil_switch_ms=0 (Python's switch
# interval), --fleet_arm=host-rebase (what the device rebases buy the round trip).
fleet() {
  local args=(--part=fleet)
  [[ ${SMOKE:-0} == 1 ]] && args+=(--quick --steps=60 --emulate_step_ms=8 --dtype=float32)
  for variant in "$@"; do
    fits || break
    local start=$SECONDS
    timeout $((DEADLINE_S / 6)) python3 scripts/bench_accelerator.py "${args[@]}" \
      $variant 2>&1 | tee -a "$OUT/speed_fleet.log"
    last_run_s=$((SECONDS - start))
  done
}
case $part in
  quality)
    # The mid targets' core: Decoupled K = 1 (with grace) <= 1.02x synchronous Streaming
    # DiLoCo, and the decoupled arm's seed spread <= 1%. One run per call, so that a timed-
    # out call still leaves the earlier ones' tables.
    quality streaming_sync 0 mid_2arms || exit
    quality streaming_sync,decoupled 0 mid_2arms || exit
    for arms in streaming_sync streaming_sync,decoupled; do
      fits || exit 0
      quality $arms 0,1 mid_2arms || exit
    done
    ;;
  more)
    # Outer lr 1.0 (the default before 0.75, better with mixing on the tiny CPU model:
    # experiments/README.md, section 0), <= 1.05x DP, K = M within 1% of K = 1, outer momentum 0.5 and 0.9 (the
    # latter with the mixing alpha 0.5) no worse than 0 (seed 0).
    S=streaming_sync,decoupled
    for arms in $S,decoupled_lr1 $S,decoupled_lr1,dp $S,decoupled_lr1,dp,decoupled_km \
      $S,decoupled_lr1,dp,decoupled_km,decoupled_mom \
      $S,decoupled_lr1,dp,decoupled_km,decoupled_mom,decoupled_nag; do
      fits || exit 0
      quality $arms 0 mid_5arms_seed0 || exit
    done
    ;;
  overhead)
    overhead
    ;;
  speed)
    # The host's cores alone (~20 s): a mid merge alone and beside busy Python threads, for
    # Python's switch interval and the runs' (runtime/gil.py), old and new chunk sizes.
    GIL=(--part=gil)
    [[ ${SMOKE:-0} == 1 ]] && GIL+=(--quick)
    timeout 90 python3 scripts/bench_syncer_merge.py "${GIL[@]}" 2>&1 | tee "$OUT/speed_gil.log"
    overhead
    fleet "" --local_syncer=process --gil_switch_ms=0 --fleet_arm=host-rebase
    mfu
    ;;
  fleet)
    fleet "" --local_syncer=process
    ;;
  mfu)
    mfu
    ;;
  overlap)
    # The overlap tau = 2 alone cost 4.1% at mid (H200, 2026-11-28, P = 6: 0.7481 -> 0.7785
    # with the rebase), and the decoupled arm 9.2% (0.8168, rebase). Learners now land on
    # each merge of their offer and send the steps since it with their next offer
    # (diloco.apply "land", the decoupled default since 2026-11-28): on the tiny model at 3x
    # its inner lr that took the decoupled arm from 1.039-1.054x to 1.024x and the overlap
    # rung from 2.9% to 2.0% (experiments/results/apply_land/). Does it at mid? Seed 0: the
    # ladder's overlap and land rungs side by side, then the decoupled arm (land) beside
    # its rebase twin.
    L=(experiments/quality_ladder.py "${SCALE[@]}" --seeds=0 --arms=overlap,land
      --out="$DEVICE_CHECK_DIR/overlap_land")
    fits || exit 0
    start=$SECONDS
    t=$(left) || exit 0
    timeout "$t" python3 "${L[@]}" >>"$OUT/$part.log" 2>&1
    echo "[$SECONDS s] overlap and land rungs: rc $?" | tee -a "$OUT/$part.log"
    cp "$DEVICE_CHECK_DIR/overlap_land/quality_ladder.md" "$OUT/overlap_land.md"
    last_run_s=$(((SECONDS - start) / 2))
    for arms in decoupled decoupled,decoupled_rebase; do
      fits || exit 0
      quality $arms 0 mid_land_vs_rebase || exit
    done
    # If time is left: the overlap rung with the paper's overwrite (the steps since the offer
    # dropped), on the tiny model at 3x its lr the cheapest on time (0.4% against landing's
    # 2.0%), where late merges make it lose real work (experiments/results/apply_land/).
    fits || exit 0
    t=$(left) || exit 0
    timeout "$t" python3 experiments/quality_ladder.py "${SCALE[@]}" \
      --seeds=0 --arms=overlap --set=diloco.apply=overwrite \
      --out="$DEVICE_CHECK_DIR/overlap_overwrite" >>"$OUT/$part.log" 2>&1
    echo "[$SECONDS s] overlap rung, overwrite: rc $?" | tee -a "$OUT/$part.log"
    cp "$DEVICE_CHECK_DIR/overlap_overwrite/quality_ladder.md" "$OUT/overlap_overwrite.md"
    ;;
  profile)
    # Where a Decoupled learner's thread spends its host time on the GPU (host_share 0.88
    # on the H200, 2026-11-28, where the plain loop's is 0.30; 0.2 with an emulated
    # device): a jax.profiler trace (host threads and device) of the same `mid` learner as
    # the overhead bench's, one learner, and of the plain loop, 8 steps each after warm-up.
    # Read with xprof or TensorBoard's profile plugin.
    if [[ ${SMOKE:-0} == 1 ]]; then
      M=(--config.train.steps=12 --config.train.warmup_steps=2) W=4:8
    else
      M=(--config.model.preset=mid --config.data.seq_len=256 --config.devices_per_learner=1
        --config.train.batch_size=32 --config.train.learning_rate=0.012
        --config.train.steps=140 --config.train.warmup_steps=10) W=120:128
    fi
    for cfg in tiny_decoupled tiny_dense; do
      extra=()
      [[ $cfg == tiny_decoupled ]] && extra=(--config.diloco.learners=1)
      rm -rf "$DEVICE_CHECK_DIR/prof_$cfg"
      timeout $((DEADLINE_S / 2)) python3 -m decoupled_diloco.main --config="configs/$cfg.py" \
        "${M[@]}" "${extra[@]}" --config.train.eval_every=0 --profile=$W \
        --workdir="$DEVICE_CHECK_DIR/prof_$cfg" 2>&1 | tail -5 | tee -a "$OUT/profile.log"
      tar czf "$OUT/profile_$cfg.tgz" -C "$DEVICE_CHECK_DIR/prof_$cfg" profile summary.json
      ls -la "$OUT/profile_$cfg.tgz" | tee -a "$OUT/profile.log"
      # Device busy share and the heaviest events thread by thread, readable without xprof.
      python3 scripts/trace_summary.py "$DEVICE_CHECK_DIR/prof_$cfg" --top=8 \
        >"$OUT/trace_summary_$cfg.txt" 2>&1
      head -24 "$OUT/trace_summary_$cfg.txt" | tee -a "$OUT/profile.log"
    done
    ;;
  gil)
    # The decoupled learner's host_share 0.88 on the H200 where the plain loop's is 0.30:
    # its own work, or waiting for the interpreter lock the run's other threads (data
    # reader, outbox, stager, syncer and its merge threads) hold? py-spy samples the thread
    # holding the lock (--gil) while one mid Decoupled learner and then the plain loop run
    # RUN_STEPS steps; scripts/gil_summary.py groups the samples by thread role.
    # The carried wheel's first: gil_summary.py reads class-qualified names (py-spy >= 0.4.3),
    # and matches bare ones by file where an older py-spy is all there is.
    PYSPY=/tmp/site/bin/py-spy
    [[ -x $PYSPY ]] || PYSPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    [[ -x $PYSPY ]] || { echo "no py-spy: run 'device_check.sh wheels' first" | tee -a "$OUT/gil.log"; exit 1; }
    RATE=200
    if [[ ${SMOKE:-0} == 1 ]]; then
      M=(--config.train.steps=${RUN_STEPS:-60} --config.train.warmup_steps=2)
    else
      M=(--config.model.preset=mid --config.data.seq_len=256 --config.devices_per_learner=1
        --config.train.batch_size=32 --config.train.learning_rate=0.012
        --config.train.steps=${RUN_STEPS:-3000} --config.train.warmup_steps=10)
    fi
    for cfg in tiny_decoupled tiny_dense; do
      fits || exit 0
      extra=()
      [[ $cfg == tiny_decoupled ]] && extra=(--config.diloco.learners=1)
      rm -rf "$DEVICE_CHECK_DIR/gil_$cfg"
      start=$SECONDS
      # --nonblocking: the run is not paused for each sample (what it measures stays as is).
      # SIGINT at the deadline: py-spy writes what it sampled on Ctrl-C (on SIGTERM, nothing).
      timeout -s INT -k 30 $((DEADLINE_S - SECONDS)) "$PYSPY" record --gil --nonblocking \
        --rate $RATE \
        --format raw --output "$OUT/gil_$cfg.txt" -- python3 -m decoupled_diloco.main \
        --config="configs/$cfg.py" "${M[@]}" "${extra[@]}" --config.train.eval_every=0 \
        --workdir="$DEVICE_CHECK_DIR/gil_$cfg" 2>&1 | tail -4 | tee -a "$OUT/gil.log"
      last_run_s=$((SECONDS - start))
      echo "[$SECONDS s] $cfg under py-spy: $last_run_s s" | tee -a "$OUT/gil.log"
      python3 scripts/gil_summary.py "$OUT/gil_$cfg.txt" --seconds=$last_run_s --rate=$RATE \
        --depth=4 2>&1 | tee "$OUT/gil_summary_$cfg.txt" | head -14 | tee -a "$OUT/gil.log"
    done
    ;;
  *)
    echo "usage: $0 wheels | quality | more | overhead | fleet | speed | mfu | overlap | profile | gil" >&2
    exit 2
    ;;
esac
