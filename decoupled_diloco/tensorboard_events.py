"""TensorBoard event files of a run's metrics rows, without TensorFlow or any other package.

    <workdir>/tensorboard/learner_<m>/events.out.tfevents.*   each learner's rows
    <workdir>/tensorboard/global/events.out.tfevents.*        the global model's evaluations

`tensorboard --logdir=<workdir>/tensorboard` (local or gs://) shows one run per learner plus
"global": every numeric field of a metrics.jsonl row is a scalar of the same name (loss,
eval_loss, tokens_per_second, ...) at the row's step. Each process writes files of its own
(a resumed run starts new ones). A run's first row in a file, and a row whose step is
before the last one (a restarted learner process), comes after a SessionLog START at its
step, at which TensorBoard drops the points its earlier files hold at that step and after:
the steps a resume redoes are drawn once.

The format is small enough to write directly: a file is a sequence of TFRecords (u64 length,
masked CRC-32C of the length, the bytes, masked CRC-32C of the bytes) each holding an `Event`
protobuf (tensorboard/compat/proto/event.proto); the first says which file version it is.
Only the fields written here are encoded: Event {1: wall_time double, 2: step int64,
3: file_version string, 5: summary Summary, 7: session_log SessionLog}, Summary {1: repeated
Value}, Value {1: tag string, 2: simple_value float}, SessionLog {1: status enum, START=1}.
"""

import math
import os
import socket
import struct
import threading
import time

from decoupled_diloco import paths

FILE_VERSION = b"brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord holding `data`."""
    length = struct.pack("<Q", len(data))
    return (
        length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))
    )


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 on the wire: negative numbers as two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    """`value` as a little-endian float32; one past float32's range is inf of its sign, as a
    float32 cast gives (struct raised OverflowError, which stopped the thread writing)."""
    try:
        return struct.pack("<f", value)
    except OverflowError:
        return struct.pack("<f", math.copysign(math.inf, value))


def event(
    wall_time: float,
    step: int = 0,
    scalars: dict | None = None,
    version=b"",
    start: bool = False,
) -> bytes:
    """A serialised Event: the file-version header, `scalars` {tag: value} at `step`, or
    (`start`) a SessionLog START at `step`: TensorBoard drops the points the run's earlier
    files hold at `step` and after (a resumed run redoes those steps)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if version:
        out += _field(3, version)
    if start:
        out += _field(7, b"\x08\x01")  # session_log {status: START}
    if scalars:
        values = b"".join(
            _field(1, _field(1, tag.encode()) + b"\x15" + _float32(value))
            for tag, value in scalars.items()
        )
        out += _field(5, values)
    return out


def scalars_of(row: dict) -> dict[str, float]:
    """The numeric fields of a metrics row (not its learner, step or attempt), as floats."""
    out = {}
    for key, value in row.items():
        if key in ("learner", "step", "attempt") or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and not (isinstance(value, int) and abs(value) > 2**53):
            out[key] = float(value)
    return out


class EventFile:
    """One event file, local or remote (appended through paths.AppendFile)."""

    _count = 0
    _count_lock = threading.Lock()

    def __init__(self, folder):
        with EventFile._count_lock:  # two files of one process in one second stay apart
            EventFile._count += 1
            n = EventFile._count
        # TensorBoard reads a run's files in name order: a process's files in the order it
        # made them (the count zero-padded), a resumed run's after the earlier ones' (time).
        name = (
            f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{n:06d}"
        )
        self.file = paths.AppendFile(paths.resolve(folder) / name)
        self.file.append(record(event(time.time(), version=FILE_VERSION)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.file.append(record(event(time.time(), step, values)))

    def start(self, step: int) -> None:
        """Points at `step` and after, written before (this run's earlier files, or this
        one), are superseded: a SessionLog START, which TensorBoard purges them at."""
        self.file.append(record(event(time.time(), step, start=True)))

    def close(self) -> None:
        self.file.close()


class RunWriter:
    """The event files of a run's metrics rows, one per learner and one for "global"."""

    def __init__(self, workdir):
        self.root = paths.resolve(workdir) / "tensorboard"
        self._files: dict[str, EventFile] = {}
        self._last: dict[str, int] = {}  # run -> the last step written to its file
        self._lock = threading.Lock()

    def row(self, row: dict) -> None:
        learner = row.get("learner")
        values = scalars_of(row)
        if learner is None or "step" not in row or not values:
            return
        run = "global" if learner == "global" else f"learner_{learner}"
        step = int(row["step"])
        with self._lock:
            if run not in self._files:
                self._files[run] = EventFile(self.root / run)
            if run not in self._last or step < self._last[run]:
                # A (re)start: this process's first row of the run (a resume redoes the
                # steps past its checkpoints, which earlier files may hold), or a step back
                # (a restarted Ray learner process): TensorBoard drops the older points.
                self._files[run].start(step)
            self._last[run] = step
            self._files[run].scalars(step, values)

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def read_scalars(path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in an event file written here, checking each
    record's CRCs (a reader for tests and tools; TensorBoard reads the same files)."""
    data, out, i = paths.resolve(path).read_bytes(), [], 0
    while i < len(data):
        (length,) = struct.unpack_from("<Q", data, i)
        if struct.unpack_from("<I", data, i + 8)[0] != masked_crc(data[i : i + 8]):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        body = data[i + 12 : i + 12 + length]
        if struct.unpack_from("<I", data, i + 12 + length)[0] != masked_crc(body):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        i += 16 + length
        out += _decode_event(body)
    return out


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        n |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return n, i


def _fields(buf: bytes):
    """(field number, wire type, value) of a serialised message (types 0, 1, 2, 5)."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        elif wire == 2:
            size, i = _read_varint(buf, i)
            value, i = buf[i : i + size], i + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def _decode_event(buf: bytes) -> list[tuple[int, str, float]]:
    step, found = 0, []
    for number, _, value in _fields(buf):
        if number == 2:
            step = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 5:
            for _, _, v in _fields(value):
                tag, simple = "", math.nan
                for n, _, x in _fields(v):
                    if n == 1:
                        tag = x.decode()
                    elif n == 2:
                        simple = struct.unpack("<f", x)[0]
                found.append((tag, simple))
    return [(step, tag, value) for tag, value in found]
