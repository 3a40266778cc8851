"""Local or remote (gs://...) paths for every file a run reads and writes.

Everything goes through `etils.epath`, which reaches gs:// through fsspec and gcsfs
(`pip install 'decoupled_diloco[tpu]'`). Two properties of object stores shape the helpers
here: an object cannot be appended to (gcsfs silently *overwrites* on mode "a"), and an
object appears whole when its upload ends, so a remote write needs no temp file to be
atomic. Local paths are made absolute (Ray actors and orbax resolve them from elsewhere);
remote ones are never passed to `os.path`, which would turn gs://b into a local ./gs:/b.
"""

import os
import threading

from etils import epath

# A remote append-only file (metrics.jsonl, TensorBoard events) is kept in memory and its
# object rewritten at most this often (seconds) and at close: a crash loses at most this
# much of its records, and a learner thread never waits for an upload.
REMOTE_FLUSH_SECONDS = 10.0
_INSTALL = "pip install 'decoupled_diloco[tpu]' (gcsfs)"


def is_remote(path) -> bool:
    """True for URLs (gs://, s3://, ...), False for local paths."""
    return "://" in os.fspath(path)


def resolve(path) -> epath.Path:
    """`path` as an epath: local ones absolute with ~ expanded, remote ones as they are."""
    path = os.fspath(path)
    if is_remote(path):
        return epath.Path(path)
    return epath.Path(os.path.abspath(os.path.expanduser(path)))


def check_reachable(path, what: str) -> None:
    """Raises ValueError naming `what` when `path`'s filesystem cannot be used here (gs://
    without gcsfs, an unknown scheme); touches no file."""
    path = os.fspath(path)
    if not is_remote(path):
        return
    import fsspec

    scheme = path.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as e:
        hint = _INSTALL if scheme in ("gs", "gcs") else f"a filesystem for {scheme}://"
        raise ValueError(
            f"{what}={path!r}: cannot reach {scheme}:// here ({e}); install {hint}"
        ) from e


def write_atomic(path, data: str | bytes) -> None:
    """Writes the whole file so that readers see the old or the new content, never a part."""
    path = resolve(path)
    write = path.write_text if isinstance(data, str) else path.write_bytes
    if is_remote(path):
        write(data)  # an object is replaced whole when its upload completes
        return
    # A name of its own per writer: processes on one host may write the same file at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    (tmp.write_text if isinstance(data, str) else tmp.write_bytes)(data)
    tmp.replace(path)


def move_tree(src, dst) -> None:
    """Moves a file or folder to `dst` (whose parent need not exist). On an object store,
    which has neither folders nor renames, object by object: copy, then delete."""
    src, dst = resolve(src), resolve(dst)
    if not is_remote(src):
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.rename(dst)
        return
    import fsspec

    fs, _ = fsspec.core.url_to_fs(str(src))
    fs.mv(str(src), str(dst), recursive=True)


class AppendFile:
    """An append-only byte file. Local: opened in append mode, flushed on every append.
    Remote: the content is kept in memory (starting from the existing object, so a resumed
    run continues it) and a daemon thread rewrites the object every `flush_seconds` when it
    changed; `close` writes the last of it. Thread-safe."""

    def __init__(self, path, flush_seconds: float = REMOTE_FLUSH_SECONDS):
        self.path = resolve(path)
        self.remote = is_remote(self.path)
        self._lock = threading.Lock()
        self._upload = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.remote:
            self._data = bytearray(self.path.read_bytes() if self.path.exists() else b"")
            self._dirty = not self.path.exists()  # create the object on the first flush
            self._stop = threading.Event()
            self._every = flush_seconds
            self._thread = threading.Thread(target=self._flusher, name="flush", daemon=True)
            self._thread.start()
        else:
            self._f = open(self.path, "ab")  # noqa: SIM115 (kept open while the run goes)

    def append(self, data: bytes) -> None:
        with self._lock:
            if self.remote:
                self._data += data
                self._dirty = True
            else:
                self._f.write(data)
                self._f.flush()

    def content(self) -> bytes:
        with self._lock:
            if self.remote:
                return bytes(self._data)
            return self.path.read_bytes()

    def replace_content(self, data: bytes) -> None:
        """Replaces everything written so far by `data` (e.g. dropping records to redo)."""
        with self._lock:
            if self.remote:
                self._data, self._dirty = bytearray(data), True
                return
            self._f.close()
            write_atomic(self.path, data)
            self._f = open(self.path, "ab")  # noqa: SIM115

    def flush(self) -> None:
        """Remote: uploads the content now if it changed."""
        if not self.remote:
            return
        with self._upload:  # uploads in order: an older snapshot never lands last
            with self._lock:
                if not self._dirty:
                    return
                data, self._dirty = bytes(self._data), False
            self.path.write_bytes(data)

    def _flusher(self) -> None:
        while not self._stop.wait(self._every):
            self.flush()

    def close(self) -> None:
        if self.remote:
            self._stop.set()
            self._thread.join()
            self.flush()
        else:
            with self._lock:
                self._f.close()
