"""A `jax.profiler` trace of a few learner steps (`main.py --profile=START:STOP`).

The trace holds learner steps START..STOP-1 (0-based: the steps taken before each is
START, ..., STOP-1), so `--profile=10:13` skips compilation and warm-up and captures three
steps. It is written to <workdir>/profile (TensorBoard's profile plugin or xprof reads it).

A jax.profiler trace is process-wide, so there is one profiler per process, installed by
the entry point (`install`); learner loops call the module's `step` before dispatching
each step, a no-op when none is installed. With several learners in one process (the local
runtime), the first learner to reach START owns the trace, which then shows every learner
thread and device, and it stops the trace when it reaches STOP. Importing this module does
not import JAX (main.py's flags stay fast).
"""

import threading


def parse_steps(text: str) -> tuple[int, int]:
    """ "START:STOP" -> (START, STOP) with 0 <= START < STOP; ValueError otherwise."""
    parts = text.split(":")
    try:
        start, stop = (int(p) for p in parts)
    except ValueError:
        message = f"--profile must be START:STOP learner steps, e.g. 10:13; got {text!r}"
        raise ValueError(message) from None
    if not 0 <= start < stop:
        raise ValueError(f"--profile={text}: needs 0 <= START < STOP")
    return start, stop


def check_steps(text: str, run) -> tuple[int, int]:
    """`parse_steps`, and the window fits the run: a local run's learners (this process's)
    and at most train.steps; ValueError otherwise."""
    start, stop = parse_steps(text)
    if run.runtime != "local":
        raise ValueError("--profile traces this process's learners: runtime 'local' only")
    if stop > run.train.steps:
        raise ValueError(f"--profile={text} ends after train.steps ({run.train.steps})")
    return start, stop


class StepProfiler:
    """Traces learner steps [start, stop) into `directory` (module doc)."""

    def __init__(self, directory: str, start: int, stop: int):
        self.directory, self.start, self.stop = directory, start, stop
        self.owner = None  # the learner that started the trace
        self.done = False
        self._lock = threading.Lock()

    @property
    def tracing(self) -> bool:
        return self.owner is not None and not self.done

    def step(self, m: int, step: int, ready=None) -> None:
        """Learner `m` is about to dispatch step `step` (steps taken so far). `ready`
        (optional) blocks until the learner's dispatched steps have run, so their device
        work is in the trace before it stops."""
        with self._lock:
            if self.done:
                return
            if self.owner is None and self.start <= step < self.stop:
                import jax

                if ready is not None:  # the steps before START have run: not in the trace
                    ready()
                jax.profiler.start_trace(self.directory)
                self.owner = m
            elif self.owner == m and step >= self.stop:
                if ready is not None:
                    ready()
                self._stop()

    def close(self) -> None:
        """Stops a trace the run ended inside (fewer steps than STOP, a lost learner); says
        so when no trace began (every learner resumed past START, or stopped before it)."""
        with self._lock:
            if self.tracing:
                self._stop()
            elif self.owner is None and not self.done:
                from absl import logging

                logging.warning(
                    "--profile=%d:%d: no learner of this process took a step in that window "
                    "(resumed past it, or stopped before it): no trace was written",
                    self.start, self.stop,
                )  # fmt: skip
                self.done = True

    def _stop(self) -> None:
        import jax

        jax.profiler.stop_trace()
        self.done = True


_ACTIVE: StepProfiler | None = None


def install(profiler: StepProfiler | None) -> None:
    """Makes `profiler` this process's (None: none)."""
    global _ACTIVE
    _ACTIVE = profiler


def step(m: int, step_index: int, ready=None) -> None:
    """`StepProfiler.step` of the installed profiler; nothing when none is installed."""
    if _ACTIVE is not None:
        _ACTIVE.step(m, step_index, ready)


def close() -> None:
    """Stops the installed profiler's trace if it is still running, and uninstalls it."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.close()
    _ACTIVE = None
