"""The lock that lets one process at a time run the run in a workdir (runtime/workdir.py).

Local workdir: `fcntl.flock` on <workdir>/run.lock, which the kernel releases when the
process dies however it dies, so a killed run never leaves a stale lock.

Remote workdir (gs://...): an object store has no locks, and a killed process cannot
remove anything, so the lock is a *lease*: run.lock is created only if absent (GCS's
ifGenerationMatch=0, fsspec mode "xb"; two starters cannot both create it), holds the
holder's host, pid and a `renewed` wall time that a daemon thread rewrites every
`RENEW_SECONDS`, and is deleted when the run ends. A lock not renewed for
`LEASE_SECONDS` belongs to a dead process and is taken over. Limits, stated: the lease
trusts the hosts' clocks to agree within minutes; a holder stalled (not dead) past the
lease can lose its lock to a new process, which it then reports (`lost`) but cannot undo.
"""

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time

from decoupled_diloco import paths

LOCK = "run.lock"
LEASE_SECONDS = 300.0  # a remote lock not renewed for this long is a dead holder's
RENEW_SECONDS = 30.0  # how often a live holder renews its remote lock


class WorkdirBusyError(RuntimeError):
    """Another process is running the run in this workdir."""


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


@contextlib.contextmanager
def lock(workdir: str):
    """Holds the workdir's lock for the body; raises WorkdirBusyError if someone has it."""
    if paths.is_remote(workdir):
        lease = Lease(workdir)
        lease.acquire()
        try:
            yield lease
        finally:
            lease.release()
        return
    holder = _holder()
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, LOCK)
    with open(path, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise WorkdirBusyError(
                f"{workdir} is in use by another run ({f.read().strip() or 'unknown holder'}); "
                "wait for it to end or use another --workdir"
            ) from None
        f.truncate(0)
        f.write(json.dumps(holder))
        f.flush()
        try:
            yield None
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


class Lease:
    """The remote workdir lock (see the module docstring)."""

    def __init__(self, workdir: str):
        self.path = paths.resolve(workdir) / LOCK
        self.holder = {**_holder(), "token": os.urandom(8).hex()}
        self.lost: dict | None = None  # who took the lock over while we held it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        if not self._create():
            other = self._read() or {}  # {}: released meanwhile, or not a lease record
            age = time.time() - float(other.get("renewed", 0.0))
            if age < LEASE_SECONDS:
                raise WorkdirBusyError(
                    f"{self.path.parent} is in use by another run (host {other.get('host')}, "
                    f"pid {other.get('pid')}, lock renewed {age:.0f} s ago); wait for it to end "
                    f"or use another --workdir (a dead run's lock expires {LEASE_SECONDS:.0f} s "
                    f"after its last renewal, or delete {self.path})"
                )
            logging.warning("taking over %s: its holder %s stopped renewing it", self.path, other)
            self.path.unlink(missing_ok=True)
            if not self._create():  # another starter took it over first
                raise WorkdirBusyError(f"{self.path.parent} was just taken by another run")
        self._thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self._thread.start()

    def _create(self) -> bool:
        import fsspec

        fs, _ = fsspec.core.url_to_fs(str(self.path))
        try:
            with fs.open(str(self.path), "xb") as f:
                f.write(self._record())
        except FileExistsError:
            return False
        return True

    def _record(self) -> bytes:
        return json.dumps({**self.holder, "renewed": time.time()}).encode()

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # a half-written or foreign file: treat as a dead holder's
            return {}

    def _ours(self) -> bool:
        now = self._read()
        if now is not None and now.get("token") != self.holder["token"]:
            self.lost = now
            return False
        return True

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            try:
                if not self._ours():
                    logging.error("lost the workdir lock %s to %s", self.path, self.lost)
                    return
                self.path.write_bytes(self._record())
            except Exception as e:
                # An object store's passing error (a timeout, a 503) must not end the
                # renewals: the lease would run out under a live run, and the next starter
                # take the workdir over while it still writes there. The next try is
                # RENEW_SECONDS away, well within LEASE_SECONDS.
                logging.warning(
                    "could not renew the workdir lock %s (%s); trying again", self.path, e
                )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._ours():
            self.path.unlink(missing_ok=True)
