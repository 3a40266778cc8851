"""A local stand-in for Google Cloud Storage, reached through the same code as gs:// is.

`fake_gcs(root)` makes every `gs://BUCKET/KEY` of this process an object under
`root/BUCKET/KEY`, for both routes a run takes to GCS:

* fsspec (what `etils.epath` uses for gs:// without TensorFlow, where gcsfs would serve):
  the "gs"/"gcs" protocols are registered to `FakeGcsFileSystem`, a local filesystem with
  the object-store rules that matter to a writer: no append (gcsfs silently overwrites on
  "a"; here it raises, so a writer relying on it is caught), no empty directories (mkdir
  is a no-op and a "directory" exists only while an object is under it), exclusive create
  ("xb", GCS's ifGenerationMatch=0), and listings named "bucket/key" like gcsfs's.
* TensorStore (orbax's array data): orbax builds a kvstore spec for gs:// paths in
  `gcs_utils.get_kvstore_for_gcs`; it is pointed at a "file" kvstore under `root`. The
  rest of orbax's GCS logic (commit-file finalisation instead of renames, GCS deletes)
  runs as on GCS; the bucket is a flat (non-HNS) bucket.
"""

import contextlib
import glob
import os
import posixpath

import fsspec
from etils.epath import backend as epath_backend
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import _registry as fsspec_registry
from orbax.checkpoint._src.path import gcs_utils


class FakeGcsFileSystem(LocalFileSystem):
    protocol = ("gs", "gcs")
    root = ""  # set by fake_gcs()

    def __init__(self, *args, **kwargs):
        kwargs.pop("finalize_on_close", None)  # what epath passes to gcsfs
        super().__init__()

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                path = path[len(prefix) :]
                break
        if not path.startswith(cls.root):  # "bucket/key", as gcsfs lists names
            path = posixpath.join(cls.root, path.lstrip("/"))
        return path.rstrip("/") or cls.root

    def _name(self, local: str) -> str:
        return posixpath.relpath(local, self.root)

    def _open(self, path, mode="rb", **kwargs):
        if "a" in mode:
            raise OSError(f"gs://{self._name(self._strip_protocol(path))}: GCS cannot append")
        if "w" in mode or "x" in mode:  # the local stand-in needs the folders GCS has not
            os.makedirs(posixpath.dirname(self._strip_protocol(path)), exist_ok=True)
        return super()._open(path, mode, **kwargs)

    def mkdir(self, path, create_parents=True, **kwargs):
        pass  # GCS has no directories: they appear with their first object

    def makedirs(self, path, exist_ok=False):
        pass

    def info(self, path, **kwargs):
        out = super().info(path, **kwargs)
        local = out["name"]
        if out["type"] == "directory" and local != self.root and not self._has_objects(local):
            raise FileNotFoundError(path)
        return {**out, "name": self._name(local)}

    def ls(self, path, detail=False, **kwargs):
        out = super().ls(path, detail=True, **kwargs)  # named and filtered by info()
        return out if detail else [e["name"] for e in out]

    def glob(self, path, **kwargs):
        found = glob.glob(self._strip_protocol(path), recursive=True)
        return sorted(self.info(p)["name"] for p in found if self.exists(p))

    def mv(self, path1, path2, recursive=True, **kwargs):
        os.makedirs(posixpath.dirname(self._strip_protocol(path2)), exist_ok=True)
        super().mv(path1, path2, recursive=recursive, **kwargs)

    @staticmethod
    def _has_objects(local_dir: str) -> bool:
        return any(files for _, _, files in os.walk(local_dir))


@contextlib.contextmanager
def fake_gcs(root: str):
    """gs:// of this process served from `root` (see the module docstring) for the body."""
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    FakeGcsFileSystem.root = root
    saved = {p: fsspec_registry.get(p) for p in FakeGcsFileSystem.protocol}
    for p in FakeGcsFileSystem.protocol:
        fsspec.register_implementation(p, FakeGcsFileSystem, clobber=True)
    kvstore, hns = gcs_utils.get_kvstore_for_gcs, gcs_utils.is_hierarchical_namespace_enabled

    def file_kvstore(ckpt_path: str) -> dict:
        bucket, key = gcs_utils.parse_gcs_path(ckpt_path, add_trailing_slash=False)
        return {"driver": "file", "path": posixpath.join(root, bucket, key)}

    gcs_utils.get_kvstore_for_gcs = file_kvstore
    gcs_utils.is_hierarchical_namespace_enabled = lambda path: False
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    FakeGcsFileSystem.clear_instance_cache()
    try:
        yield root
    finally:
        gcs_utils.get_kvstore_for_gcs, gcs_utils.is_hierarchical_namespace_enabled = kvstore, hns
        for p, cls in saved.items():
            if cls is None:
                fsspec_registry.pop(p, None)  # back to fsspec's lazy gcsfs import
            else:
                fsspec.register_implementation(p, cls, clobber=True)
        epath_backend.fsspec_backend._get_filesystem.cache_clear()
