#!/bin/bash
# A/B: the learner overhead with an emulated 10 ms device, before (6c98663) and after precompiling.
cd /work/main
for steps in 60 200; do
 for i in 1 2; do
  for arm in before after; do
   if [ $arm = before ]; then PP=/tmp/before; else PP=/work/main; fi
   echo "== $arm steps=$steps run=$i"
   PYTHONPATH=$PP python $PP/scripts/bench_accelerator.py --part=overhead --emulate_step_ms=10 --dtype=float32 --rounds=1 --steps=$steps --workdir=/tmp/dd_ab_$arm 2>&1 | grep -E "^ +0 |/ plain"
  done
 done
done
