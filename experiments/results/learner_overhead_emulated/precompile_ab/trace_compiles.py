import sys, runpy, traceback, threading, time
from jax import monitoring
T0 = time.perf_counter()
def listen(event, dur, **kw):
    if 'backend_compile' not in event and 'cache_retrieval' not in event: return
    st = [f for f in traceback.extract_stack() if 'decoupled_diloco' in f.filename or 'bench_acc' in f.filename]
    where = ' < '.join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in st[::-1][:3])
    print(f"COMPILE {time.perf_counter()-T0:7.2f}s {threading.current_thread().name:10s} {dur*1e3:6.1f}ms {event.split('/')[-1]} {where}", flush=True)
monitoring.register_event_duration_secs_listener(listen)
sys.argv = ['bench_accelerator.py'] + sys.argv[1:]
runpy.run_path('scripts/bench_accelerator.py', run_name='__main__')
