"""Objects between two processes of one host: a pipe for the pickle, shared memory for arrays.

A `Wire` is one process's end. `send(kind, obj, **meta)` pickles `obj` with protocol 5;
every numpy buffer of at least `INLINE_BYTES` leaves the pickle (out of band) and is copied
into one shared-memory segment of the sender's pool, and the pipe carries only the pickle,
the segment's name and where each buffer lies in it. The receiver copies the buffers out
into one array of its own, acknowledges, and the sender reuses the segment for a later
message. Both copies are numpy copies, which run without the interpreter lock: a process
whose threads keep the lock busy (learners dispatching steps) moves a fragment of tens of
MB with a few short holds of it, where pickling through the pipe would hold it for the whole
copy and a pipe write loop would take it back once per 64 KiB.

Where the shared-memory file system has no room for a new segment (a container's /dev/shm
is often 64 MB), a message goes whole through the pipe instead: slower (pickled under the
lock), never lost. A sender keeps up to `_MAX_IDLE` idle segments for reuse and unlinks the
rest, and all of its own at `close` (a killed process's are unlinked by multiprocessing's
resource tracker, or by `close(unlink_mapped=True)` on the peer; when the tracker was killed
with it, a kill -9 of the whole process group, by the next run's `sweep_orphans`, which
knows them by their names: `ddw_<pid namespace>_<owner pid>_<random>`); a receiver keeps up to
`_MAX_MAPPED` of its peer's segments mapped, so a segment reused for the next fragment costs
no page faults.

One thread may `recv` at a time; any thread may `send`. Acknowledgements leave from a thread
of their own, so a receiver never blocks on the pipe's other direction: two ends that both
receive on one thread and send on another cannot wait on each other.
"""

import collections
import contextlib
import errno
import io
import math
import os
import pickle
import queue
import secrets
import threading
import time
from multiprocessing import shared_memory

import numpy as np
from absl import logging

INLINE_BYTES = 1 << 16  # smaller buffers stay inside the pickle
_ALIGN = 64  # bytes: each buffer starts on a cache line of the segment
_FIRST_USER_DTYPE = 256  # numpy's NPY_USERDEF: dtypes registered by other packages
_SHM_DIR = "/dev/shm"
_SHM_HEADROOM = 16 << 20  # bytes of /dev/shm left to others when a segment is created
_MAX_IDLE = 8  # idle segments a sender keeps for reuse; older ones are unlinked
_MAX_MAPPED = 16  # segments of the peer a receiver keeps mapped
_GRAIN = 1 << 20  # segment sizes are rounded up to this, so fragments of near sizes share them


def _pid_namespace() -> str:
    """This process's pid namespace (an inode number; "0" where /proc has none): a segment
    name's owner pid means something only inside it."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


_PREFIX = "ddw_"


def _segment_name() -> str:
    return f"{_PREFIX}{_pid_namespace()}_{os.getpid()}_{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (someone else's process: alive)
        return True
    return True


def sweep_orphans(shm_dir: str = _SHM_DIR) -> int:
    """Unlinks the wire segments whose owner process is gone (killed together with its
    resource tracker); only those of this pid namespace, whose pids this process can
    check. Returns how many."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    gone, here = 0, _pid_namespace()
    for name in names:
        parts = name[len(_PREFIX) :].split("_") if name.startswith(_PREFIX) else []
        if len(parts) != 3 or parts[0] != here or not parts[1].isdigit():
            continue
        if _alive(int(parts[1])):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm_dir, name))
            gone += 1
    if gone:
        logging.info("removed %d shared-memory segments of killed processes from %s", gone,
                     shm_dir)  # fmt: skip
    return gone


def _shm_free_bytes() -> float:
    """Free bytes where POSIX shared memory lives (Linux: /dev/shm); unknown = unbounded."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:
        return math.inf
    return st.f_bavail * st.f_frsize


def _reserve(seg: shared_memory.SharedMemory) -> bool:
    """Backs a new segment's pages now; False when the file system has no room for them.
    The free-space check before it is no reservation: senders that pass it together (the
    shards' forwarders, a syncer process's replies) wrote more than there was, and the
    first write past the end killed the process with SIGBUS. (Where the platform cannot
    reserve, the check alone stands, as before.)"""
    fallocate, fd = getattr(os, "posix_fallocate", None), getattr(seg, "_fd", -1)
    if fallocate is None or fd < 0:
        return True
    try:
        fallocate(fd, 0, seg.size)
    except OSError as e:
        return e.errno != errno.ENOSPC  # (a file system without fallocate: unreserved)
    return True


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _from_bytes(buf, dtype: np.dtype, shape: tuple) -> np.ndarray:
    return np.frombuffer(buf, dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    """numpy leaves arrays of dtypes it does not know (ml_dtypes' bfloat16, int4, float8: the
    compressed wire formats) inside the pickle; these leave it as raw bytes too."""

    def reducer_override(self, obj):
        if (
            type(obj) is np.ndarray
            and obj.dtype.num >= _FIRST_USER_DTYPE
            and obj.flags.c_contiguous
            and obj.nbytes >= INLINE_BYTES
        ):
            raw = pickle.PickleBuffer(obj.reshape(-1).view(np.uint8))
            return _from_bytes, (raw, obj.dtype, obj.shape)
        return NotImplemented


class WireClosedError(EOFError):
    """The peer closed its end or its process died."""


class Wire:
    def __init__(self, conn):
        self.conn = conn
        self._send_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._free: list[shared_memory.SharedMemory] = []  # our idle ones, oldest first
        self._lent: dict[str, shared_memory.SharedMemory] = {}  # ours the peer has not acked
        # the peer's we have mapped, least recently used first
        self._mapped: collections.OrderedDict[str, shared_memory.SharedMemory] = (
            collections.OrderedDict()
        )
        self.bytes_sent = 0  # out-of-band bytes, both ways (for the tests and benchmarks)
        self.bytes_received = 0
        self.inline_fallbacks = 0  # messages sent inside the pickle for want of shared memory
        self._acks: queue.Queue = queue.Queue()
        self._ack_thread: threading.Thread | None = None

    # --- sending ----------------------------------------------------------------------
    def send(self, kind: str, obj=None, **meta) -> None:
        """Sends `obj` (anything picklable) tagged `kind`, with keyword metadata."""
        buffers: list[memoryview] = []

        def out_of_band(b: pickle.PickleBuffer) -> bool:
            raw = b.raw()
            if raw.nbytes < INLINE_BYTES:
                return True  # in band
            buffers.append(raw)
            return False

        out = io.BytesIO()
        _Pickler(out, protocol=5, buffer_callback=out_of_band).dump(obj)
        data = out.getvalue()
        spans, total = [], 0  # (offset, bytes) of each buffer in the segment
        for raw in buffers:
            spans.append((total, raw.nbytes))
            total = _round_up(total + raw.nbytes, _ALIGN)
        seg = self._segment(total) if buffers else None
        if buffers and seg is None:  # no room in shared memory: everything in the pickle
            data, buffers, spans = pickle.dumps(obj, protocol=5), [], []
            self.inline_fallbacks += 1
        for raw, (off, n) in zip(buffers, spans, strict=True):
            dst = np.frombuffer(seg.buf, np.uint8, n, off)
            np.copyto(dst, np.frombuffer(raw, np.uint8))  # without the interpreter lock
        seg_name = seg.name if buffers else None
        if buffers:
            self.bytes_sent += total
        try:
            with self._send_lock:
                self.conn.send((kind, meta, data, seg_name, spans))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            raise WireClosedError(f"the peer of this wire is gone ({e})") from e

    def _segment(self, nbytes: int) -> shared_memory.SharedMemory | None:
        """A segment of at least `nbytes` from the pool, or a new one; None when the shared
        memory file system has no room for a new one (a container's /dev/shm is often
        64 MB: writing past it would kill the process with SIGBUS, not raise)."""
        size = _round_up(max(nbytes, 1), _GRAIN)
        with self._pool_lock:
            fits = [s for s in self._free if s.size >= size]
            if fits:  # the smallest idle one that fits
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                self._lent[seg.name] = seg
                return seg
        if _shm_free_bytes() < size + _SHM_HEADROOM:
            return None
        seg = shared_memory.SharedMemory(_segment_name(), create=True, size=size)
        if not _reserve(seg):
            _release(seg, unlink=True)
            return None
        with self._pool_lock:
            self._lent[seg.name] = seg
        return seg

    def _acked(self, name: str) -> None:
        with self._pool_lock:
            seg = self._lent.pop(name, None)
            if seg is None:
                return
            self._free.append(seg)
            old = self._free.pop(0) if len(self._free) > _MAX_IDLE else None
        if old is not None:  # the pool stays bounded (the peer's mapping goes the same way)
            _release(old, unlink=True)

    # --- receiving --------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> tuple[str, dict, object] | None:
        """(kind, meta, obj) of the next message; None if none came within `timeout` s
        (None: wait for one). Raises WireClosedError when the peer is gone."""
        while True:
            try:
                if timeout is not None and not self.conn.poll(timeout):
                    return None
                kind, meta, data, seg_name, spans = self.conn.recv()
            except (EOFError, OSError) as e:
                raise WireClosedError(f"the peer of this wire is gone ({e!r})") from e
            if kind == "_ack":
                self._acked(meta["segment"])
                continue
            buffers = []
            if seg_name is not None:
                seg = self._mapped.get(seg_name)
                if seg is None:
                    seg = self._mapped[seg_name] = shared_memory.SharedMemory(name=seg_name)
                    if len(self._mapped) > _MAX_MAPPED:  # one the sender no longer uses, likely
                        _release(self._mapped.popitem(last=False)[1], unlink=False)
                self._mapped.move_to_end(seg_name)
                end = spans[-1][0] + spans[-1][1]
                own = np.empty(end, np.uint8)
                np.copyto(own, np.frombuffer(seg.buf, np.uint8, end))  # lock-free copy
                self.bytes_received += end
                self._ack(seg_name)  # the sender may reuse it now
                buffers = [memoryview(own[off : off + n]) for off, n in spans]
            return kind, meta, pickle.loads(data, buffers=buffers)

    def _ack(self, seg_name: str) -> None:
        if self._ack_thread is None:
            self._ack_thread = threading.Thread(target=self._send_acks, name="wire-acks",
                                                daemon=True)  # fmt: skip
            self._ack_thread.start()
        self._acks.put(seg_name)

    def _send_acks(self) -> None:
        while True:
            name = self._acks.get()
            if name is None:
                return
            try:
                self.send("_ack", segment=name)
            except WireClosedError:
                return

    def settle(self, timeout: float) -> bool:
        """Receives (and drops) messages until the peer has acknowledged every segment this
        end sent, or `timeout` s passed: a process that is about to exit calls it after its
        last message, so its segments outlive the peer's copy of them. True when settled."""
        deadline = time.monotonic() + timeout
        while True:
            with self._pool_lock:
                if not self._lent:
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self.recv(min(left, 0.1))
            except WireClosedError:
                return False

    # --- the end ----------------------------------------------------------------------
    def close(self, unlink_mapped: bool = False) -> None:
        """Closes the pipe, unmaps the peer's segments and unlinks this end's own (and the
        peer's too with `unlink_mapped`: a peer that died cannot)."""
        self._acks.put(None)
        with contextlib.suppress(OSError):
            self.conn.close()
        with self._pool_lock:
            own = list(self._lent.values()) + self._free
            self._lent.clear()
            self._free = []
        for seg in own:
            _release(seg, unlink=True)
        for seg in self._mapped.values():
            _release(seg, unlink=unlink_mapped)
        self._mapped.clear()


def _release(seg: shared_memory.SharedMemory, unlink: bool) -> None:
    """Unmaps a segment (a view still in use keeps it mapped) and unlinks it if asked."""
    with contextlib.suppress(BufferError):
        seg.close()
    if unlink:
        with contextlib.suppress(FileNotFoundError):
            seg.unlink()
