"""Runs scripts/bench_accelerator.py with its flags, printing every XLA backend compilation
(and persistent-cache retrieval) with the compiling thread and the project's innermost
frames: which thread compiles what, and when.

    python experiments/results/learner_overhead_emulated/precompile_ab/trace_compiles.py \
        --part=overhead --emulate_step_ms=10 --dtype=float32 --rounds=1 --steps=60
"""

import runpy
import sys
import threading
import time
import traceback

from jax import monitoring

T0 = time.perf_counter()


def listen(event: str, seconds: float, **kwargs) -> None:
    if "backend_compile" not in event and "cache_retrieval" not in event:
        return
    ours = [
        f
        for f in traceback.extract_stack()
        if "decoupled_diloco" in f.filename or "bench_acc" in f.filename
    ]
    where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in ours[::-1][:3])
    print(
        f"COMPILE {time.perf_counter() - T0:7.2f}s {threading.current_thread().name:10s} "
        f"{seconds * 1e3:6.1f}ms {event.split('/')[-1]} {where}",
        flush=True,
    )


monitoring.register_event_duration_secs_listener(listen)
sys.argv = ["bench_accelerator.py", *sys.argv[1:]]
runpy.run_path("scripts/bench_accelerator.py", run_name="__main__")
