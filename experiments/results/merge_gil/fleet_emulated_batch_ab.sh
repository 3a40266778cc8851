# The batching A/B of README.md: `before` is a worktree of the commit before
# Syncer.handle_batch (git worktree add /tmp/ab/before 5a8b8e0), `after` this checkout.
for i in 1 2 3; do
  for arm in before after; do
    if [ $arm = before ]; then dir=/tmp/ab/before; else dir=/work/main; fi
    echo "=== run $i $arm"
    (cd $dir && PYTHONPATH=$dir python scripts/bench_accelerator.py --part=fleet --emulate_step_ms=10.4 --dtype=float32 --steps=200 --workdir=/tmp/ab/wd_$arm 2>&1 | grep -E "fleet / plain|steps per offer|merge delay|merges |offer to merge|lock wait")
  done
done
