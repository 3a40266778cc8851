"""What every command-line entry point does first (before JAX starts): XLA flags (fake CPU
devices to partition between learners, no CUDA graphs on a GPU), quiet logs, and the
persistent compilation cache. Importing this module does not import JAX."""

import contextlib
import os
import signal
import threading
import time

CPU_DEVICES = 8

# XLA:GPU replays a jitted program as a CUDA graph ("command buffers") and records library
# calls (cuBLAS, cuDNN) into it by stream capture. With several threads dispatching to one GPU
# at once (learners sharing it; each learner's outbox copies beside its step) the capture
# broke on an NVIDIA H200 (jax 0.11.2, 2026-11-28): 2 of 6 runs of four `mid` learners died
# with CUDA_ERROR_ILLEGAL_INSTRUCTION after "Failed to trace command buffer: cublasLtMatmul",
# and the run that had died finished with the graphs off (its tokens/s as those of the runs
# with them). Only the GPU backend reads the flag; XLA_FLAGS that name it win.
NO_CUDA_GRAPHS = "--xla_gpu_enable_command_buffer="


def xla_flags(cpu_devices: int | None = CPU_DEVICES) -> None:
    """XLA_FLAGS before JAX starts: `cpu_devices` fake CPU devices
    (`--xla_force_host_platform_device_count`; only the CPU backend reads it; None: JAX's
    one) and no CUDA graphs (`NO_CUDA_GRAPHS`), each unless XLA_FLAGS already sets it."""
    flags = os.environ.get("XLA_FLAGS", "")
    add = []
    if cpu_devices is not None and "--xla_force_host_platform_device_count" not in flags:
        add.append(f"--xla_force_host_platform_device_count={cpu_devices}")
    if "--xla_gpu_enable_command_buffer" not in flags:
        add.append(NO_CUDA_GRAPHS)
    os.environ["XLA_FLAGS"] = " ".join([flags, *add]).strip()


def start(verbosity_flag_present: bool = False) -> None:
    """Inside `main`: quiet absl logs (orbax is chatty at INFO) and the compilation cache."""
    from absl import logging

    from decoupled_diloco import compile_cache

    if not verbosity_flag_present:
        logging.set_verbosity(logging.WARNING)
    compile_cache.enable()


CONFIG_DOCS = (
    "config keys, defaults and allowed values: decoupled_diloco/config.py (default_config) "
    "and the dataclass each section names; any key is set with --config.<section>.<key>=VALUE"
)


# After an error in a config file that does not exist, or does not run (not one of its keys).
MISSING_CONFIG = (
    "the shipped configs are in the repository's configs/; a relative --config path is read "
    "from the current directory"
)


def config_hint(e: BaseException) -> str:
    """What to read after config error `e`: where the keys are documented, or, for a
    missing file, where the shipped ones are (a file that does not run says so itself)."""
    if isinstance(e, OSError) and "Attempted" in str(e):
        return MISSING_CONFIG
    if isinstance(e, AttributeError) and "has no attribute 'get_config" in str(e):
        return ""
    if isinstance(e, ImportError | NameError | SyntaxError):
        return ""
    return CONFIG_DOCS


def one_line(e: BaseException) -> str:
    """A flag or config-file error as one readable line."""
    text = str(e).strip().strip("'\"").replace("\\n", "\n").replace("\\'", "'")
    if isinstance(e, AttributeError) and "has no attribute 'get_config" in text:
        return "the config file defines no get_config() (configs/*.py show the form)"
    if isinstance(e, AttributeError | KeyError):  # ml_collections: an unknown key
        key, _, hint = text.partition("\n")
        return f"unknown config key {key.strip(chr(39))}" + (f" ({hint.strip()})" if hint else "")
    if isinstance(e, OSError) and "Attempted" in text:  # ml_collections: a missing file
        missing = [ln.strip() for ln in text.splitlines() if ln.strip().endswith(".py")]
        return f"config file {missing[0] if missing else '?'} not found"
    return text.splitlines()[0] if text else type(e).__name__


_CONFIG_ERRORS = (
    AttributeError,
    ImportError,
    KeyError,
    NameError,
    OSError,
    SyntaxError,
    TypeError,
    ValueError,
)  # a config file that does not run, a key or value it does not take


def _config_error(e: BaseException, argv: list[str]) -> str:
    """`one_line(e)`, an unknown key named by its whole dotted path as the flag gave it
    (ml_collections names only its last part)."""
    line = one_line(e)
    prefix = "unknown config key "
    if line.startswith(prefix):
        key = line[len(prefix) :].split(" ", 1)[0]
        for arg in argv:
            name = arg.split("=", 1)[0].lstrip("-")
            if name.startswith("config.") and name.endswith(f".{key}"):
                return prefix + name[len("config.") :] + line[len(prefix) + len(key) :]
    return line


# How XLA says it ran out of device memory (accelerators), or of host memory (XLA:CPU).
_OOM_MARKS = ("RESOURCE_EXHAUSTED", "Out of memory")


def out_of_memory(e: BaseException | None) -> str | None:
    """The first line of an XLA out-of-memory error `e` was raised from, if any."""
    oom = cause(e, lambda x: any(mark in str(x) for mark in _OOM_MARKS))
    if oom is None:
        return None
    lines = str(oom).splitlines()
    return next(ln for ln in lines if any(m in ln for m in _OOM_MARKS)).strip()[:300]


def cause(e: BaseException | None, match) -> BaseException | None:
    """`e` or the first exception it was raised from for which `match` is true."""
    while e is not None and not match(e):
        e = e.__cause__
    return e


def exit_if_out_of_memory(e: BaseException, advice: str) -> None:
    """Exits with one line (what XLA said, then `advice`) when `e` is an out-of-memory
    error; returns otherwise."""
    import sys

    oom = out_of_memory(e)
    if oom is not None:
        sys.exit(f"error: out of memory ({oom}): {advice}")


def refuse_stray_arguments(argv: list[str]) -> None:
    """Exits with one line when the command line holds words that are not flags: absl
    hands them to `main` in `argv`, where they would be silently ignored (a flag written
    without its dashes, a prompt's second word left unquoted)."""
    import sys

    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]} (flags start with --; quote a value "
                 "that holds spaces)")  # fmt: skip


def run(main, define_flags) -> None:
    """absl's app.run for an entry point whose flags `define_flags` defines (a config
    flag reads its --config.* overrides as it is defined: a typo is one line there too)."""
    import sys

    from absl import app

    try:
        define_flags()
    except _CONFIG_ERRORS as e:
        sys.exit(_config_exit(e, sys.argv))
    app.run(main, flags_parser=parse_flags)


def run_script(main) -> None:
    """absl's app.run for a script, an experiment or a tool without a config flag: its
    --help exits 0 (absl's own exits 1, which reads as a failure in a shell or CI)."""
    from absl import app

    app.run(main, flags_parser=lambda argv: parse_flags(argv, config_docs=False))


def parse_flags(argv: list[str], config_docs: bool = True) -> list[str]:
    """absl's flag parsing, with config errors as one line (exit 2) and --help (exit 0)
    pointing at where the config keys are documented (`config_docs`)."""
    import sys

    from absl import app

    if any(a in ("--help", "-h", "--helpshort", "--helpfull") for a in argv[1:]):
        app.parse_flags_with_usage([argv[0]])
        from absl import flags

        print(flags.FLAGS.main_module_help() if argv[1:] != ["--helpfull"] else flags.FLAGS)
        if config_docs:
            print(f"\n{CONFIG_DOCS}")
        sys.exit(0)
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as e:  # absl's own report, but for a value a config file could not set
        file_error = _config_file_error(str(e))
        if file_error:
            sys.exit(f"error: {file_error}\n{CONFIG_DOCS}")
        sys.exit(f"FATAL Flags parsing error: {e}\n"
                 "Pass --helpshort or --helpfull to see help on flags.")  # fmt: skip
    except _CONFIG_ERRORS as e:
        sys.exit(_config_exit(e, argv))


def _config_exit(e: BaseException, argv: list[str]) -> str:
    hint = config_hint(e)
    return f"error: {_config_error(e, argv)}" + (f"\n{hint}" if hint else "")


def _config_file_error(text: str) -> str | None:
    """The exception line of the traceback ml_collections puts into a flag error when a
    config file's get_config raised a TypeError or ValueError (e.g. a str assigned to an int
    key), naming the file; None for any other flag error."""
    head, marker, trace = text.partition("Error whilst parsing config file:")
    if not marker:
        return None
    last = next((ln.strip() for ln in reversed(trace.splitlines()) if ln.strip()), "")
    where = head.strip().removeprefix("flag ").rstrip(":")  # "--config=path"
    return f"{where}: {last}" if where else last


# A Ctrl-C's signal may reach the process twice within moments (`timeout -s INT` signals the
# process and then its group); the run takes the second for the user's second Ctrl-C, which
# stops at once instead of saving.
REPEAT_INTERRUPT_S = 1.0


# Set by a Ctrl-C `one_interrupt_per_press` raised, cleared by whoever handles it
# (`interrupt_handled`): a KeyboardInterrupt raised while the main thread runs a garbage-
# collection callback (JAX's) is reported as "Exception ignored" and lost, and the run
# trained on; the runtimes' watch loops raise it again (`raise_pending_interrupt`).
_PENDING_INTERRUPT = threading.Event()


def raise_pending_interrupt() -> None:
    """KeyboardInterrupt if a Ctrl-C was raised and nothing handled it (it was lost)."""
    if _PENDING_INTERRUPT.is_set():
        raise KeyboardInterrupt


def interrupt_handled() -> None:
    _PENDING_INTERRUPT.clear()


# The signals that stop a run as a Ctrl-C does: SIGINT (the terminal), SIGTERM (`kill`, a
# scheduler or a VM shutting down; a launcher's background job, whose SIGINT a
# non-interactive shell ignores, is stopped with it: scripts/tpu).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _ours(signum: int, over_any: bool) -> bool:
    """Whether this thread may take `signum`: only the main thread, over the interpreter's
    own disposition (SIGINT: Python's handler; SIGTERM: the default) or, `over_any`, over
    any Python handler (one of ours). A signal someone ignores stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return False
    now = signal.getsignal(signum)
    if over_any:
        return now not in (signal.SIG_IGN, signal.SIG_DFL, None)
    return now is (signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


@contextlib.contextmanager
def _each_press(on_press, signals):
    """Inside: each of `signals` calls `on_press()` once per press: a repeat within
    REPEAT_INTERRUPT_S of the last press it took is the same one (`timeout -s INT` signals
    the process, then its group; a Ctrl-C and a SIGTERM moments apart are one stop too)."""
    last = [-float("inf")]

    def handler(signum, frame):
        now = time.monotonic()
        if now - last[0] >= REPEAT_INTERRUPT_S:
            last[0] = now
            on_press()

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, handler_before in previous.items():
            signal.signal(s, signal.SIG_DFL if handler_before is None else handler_before)


@contextlib.contextmanager
def interrupts_deferred(notice: str, pressed: bool = False):
    """Inside, on the main thread: a Ctrl-C does not cut short what runs (the end of a run:
    the syncer's last merges and checkpoints, closing the learners' checkpointers); it
    prints `notice` and is recorded in the yielded state's `pressed`. The next one (or the
    first, given `pressed`: the run was interrupted already) raises KeyboardInterrupt,
    a stop at once; a repeat within REPEAT_INTERRUPT_S is the same press."""
    import sys
    import types

    state = types.SimpleNamespace(pressed=pressed)
    signals = [s for s in STOP_SIGNALS if _ours(s, over_any=True)]
    if not signals:
        yield state
        return

    def on_press():
        if state.pressed:
            raise KeyboardInterrupt
        state.pressed = True
        print(notice, file=sys.stderr, flush=True)

    with _each_press(on_press, signals):
        yield state


@contextlib.contextmanager
def one_interrupt_per_press(taken=STOP_SIGNALS):
    """Inside: SIGINT raises KeyboardInterrupt as Python's own handler does, except within
    REPEAT_INTERRUPT_S of the last one it raised (the same Ctrl-C arriving again: ignored);
    so does SIGTERM, which would otherwise end the process without a save (`taken`: the
    signals to take). Only on the main thread, and for each signal only over the
    interpreter's own disposition (else not it)."""
    signals = [s for s in taken if _ours(s, over_any=False)]
    if not signals:
        yield
        return

    def on_press():
        _PENDING_INTERRUPT.set()
        raise KeyboardInterrupt

    _PENDING_INTERRUPT.clear()
    try:
        with _each_press(on_press, signals):
            yield
    finally:
        _PENDING_INTERRUPT.clear()
