"""What a run keeps in its workdir beside its logs and checkpoints, so that its model can be
used without the command that trained it (decoupled_diloco/loading.py):

  <workdir>/run_config.json   the validated run config, every section as its dataclass
  <workdir>/tokenizer.model   the sentencepiece model (data.tokenizer = "sentencepiece";
                              byte-level runs need no file)
  <workdir>/corpus.json       what the corpus held when the run started (per split: documents,
                              characters, a sha256 of names and texts): a resume must read
                              the same corpus and tokenize it the same way (`check_corpus`)

Paths may be local or remote (gs://...: etils.epath, through gcsfs where installed). A
driver that trained a sentencepiece model also shares it with the other hosts of a Ray run
(`with_shared_tokenizer`).
"""

import dataclasses
import hashlib
import json
import typing

from etils import epath

from decoupled_diloco import faults, models, paths, sharding
from decoupled_diloco.config import RayConfig, RunConfig
from decoupled_diloco.data import ByteTokenizer, DataConfig, SentencePieceTokenizer, Tokenizer
from decoupled_diloco.diloco.config import DilocoConfig
from decoupled_diloco.jax_world import DistributedConfig
from decoupled_diloco.train.optimizer import TrainConfig

RUN_CONFIG = "run_config.json"
TOKENIZER = "tokenizer.model"
# sha256 of TOKENIZER as the run wrote it: a model swapped or damaged since is named, not
# used (runs from before 2026-11-29 have none, and are read unchecked).
TOKENIZER_SHA256 = "tokenizer.model.sha256"
CORPUS = "corpus.json"
# run_config.json's own key holding a sha256 of the rest of it (canonical JSON): one byte
# damaged in a key name would otherwise drop that key quietly, and a model read back with
# the default (an attention pattern, a soft-cap) scores another architecture. Records from
# before 2026-11-30 have none, and are read unchecked.
DIGEST_KEY = "sha256"
_SECTIONS = {
    "model": models.ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "mesh": sharding.MeshConfig,
    "diloco": DilocoConfig,
    "faults": faults.FaultSpec,
    "ray": RayConfig,
    "distributed": DistributedConfig,
}


def config_to_json(run: RunConfig) -> dict:
    return dataclasses.asdict(run)


class DamagedRecordError(ValueError):
    """A run_config.json record whose content is not what its digest says."""


def _digest(record: dict) -> str:
    rest = {k: v for k, v in record.items() if k != DIGEST_KEY}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _tuples(value, hint):
    """JSON lists back to the tuples (of tuples) a dataclass field holds."""
    if typing.get_origin(hint) is tuple and isinstance(value, list):
        args = typing.get_args(hint)
        inner = args[0] if args and args[-1] is Ellipsis else None
        return tuple(_tuples(v, inner) for v in value)
    return value


def _section(dc, values: dict):
    hints = typing.get_type_hints(dc)
    known = {f.name for f in dataclasses.fields(dc)}
    return dc(**{k: _tuples(v, hints[k]) for k, v in values.items() if k in known})


def config_from_json(d: dict) -> RunConfig:
    """The RunConfig `config_to_json` wrote (keys a newer version removed are ignored); a
    record whose digest (`DIGEST_KEY`) does not match its content is refused."""
    if DIGEST_KEY in d and d[DIGEST_KEY] != _digest(d):
        raise DamagedRecordError(
            f"does not match the {DIGEST_KEY} recorded in it: a damaged run record (one byte "
            "of a key's name makes its value the default: another model)"
        )
    sections = {name: _section(dc, d[name]) for name, dc in _SECTIONS.items() if name in d}
    rest = {k: v for k, v in d.items() if k not in _SECTIONS and k != DIGEST_KEY}
    return RunConfig(**sections, **rest)


def recorded(run: RunConfig) -> RunConfig:
    """`run` as run_config.json records it: local corpus and checkpoint paths absolute, so
    `evaluate`, `load` and a resume read them from wherever they start (a relative one was
    found only from the directory the run started in)."""
    where = {k: str(paths.resolve(getattr(run.data, k)))
             for k in ("path", "tfds_data_dir") if getattr(run.data, k)}  # fmt: skip
    ray = run.ray
    if ray.checkpoint_dir:  # a Ray run's checkpoints, found again the same way
        ray = dataclasses.replace(ray, checkpoint_dir=str(paths.resolve(ray.checkpoint_dir)))
    return dataclasses.replace(run, data=dataclasses.replace(run.data, **where), ray=ray)


def write(workdir: str, run: RunConfig, tokenizer: Tokenizer | None = None) -> None:
    """Writes the run's config and, for sentencepiece runs, its tokenizer (`tokenizer`, or
    the one of the run's corpus) into its workdir."""
    if tokenizer is None and run.data.tokenizer == "sentencepiece":
        from decoupled_diloco.data import get_tokenizer

        tokenizer = get_tokenizer(run.data)
    root = paths.resolve(workdir)
    root.mkdir(parents=True, exist_ok=True)
    record = config_to_json(recorded(run))
    config = json.dumps({**record, DIGEST_KEY: _digest(record)}, indent=1, sort_keys=True)
    paths.write_atomic(root / RUN_CONFIG, config)  # a resumed run rewrites it
    if isinstance(tokenizer, SentencePieceTokenizer):
        paths.write_atomic(root / TOKENIZER, tokenizer.model_proto)
        digest = hashlib.sha256(tokenizer.model_proto).hexdigest()
        paths.write_atomic(root / TOKENIZER_SHA256, digest + "\n")


def _tokenizer_bytes(directory) -> bytes:
    """The run's sentencepiece model file, checked against the digest written with it."""
    file = epath.Path(directory) / TOKENIZER
    data = file.read_bytes()
    recorded = epath.Path(directory) / TOKENIZER_SHA256
    if recorded.exists():
        then, now = recorded.read_text().strip(), hashlib.sha256(data).hexdigest()
        if then != now:
            raise ValueError(
                f"{file} is not the sentencepiece model the run wrote (sha256 {now[:12]}..., "
                f"recorded {then[:12]}... in {TOKENIZER_SHA256}): it was replaced or damaged "
                "since; put the run's own model back (the model's embeddings belong to its "
                "vocabulary)"
            )
    return data


def check_corpus(workdir: str, data: DataConfig, force: bool) -> list[str]:
    """A run resumes on the corpus and with the tokenizer it started with.

    The first attempt records its corpus (`CORPUS`; a record without a `RUN_CONFIG`, of a
    start that failed before its run began, is replaced). A resume whose corpus differs (a file
    added, edited or removed under data.path, another Python's stdlib) is refused unless
    `force`, which accepts it, records the new corpus and returns ["corpus"] (else []).
    A resume whose tokenizer is not the workdir's `TOKENIZER` byte for byte (a sentencepiece
    model trained again on a changed corpus, or by another sentencepiece version) is refused
    even with `force`: the model's embeddings belong to the old vocabulary, and
    data.spm_model_path=<workdir>/tokenizer.model keeps it. Loads the corpus (cached, so the
    run reuses it); writes only the corpus record.
    """
    from decoupled_diloco.data import load_corpus

    corpus, root = load_corpus(data), paths.resolve(workdir)
    saved = root / TOKENIZER
    spm = isinstance(corpus.tokenizer, SentencePieceTokenizer) and saved.exists()
    if spm and corpus.tokenizer.model_proto != _tokenizer_bytes(root):
        raise ValueError(
            f"{workdir}'s run trained with the sentencepiece model in {saved}, and this "
            "config's tokenizer is another one (its corpus or sentencepiece changed): the "
            "model cannot continue on another vocabulary; resume with "
            f"--config.data.spm_model_path={saved} --force_resume to keep the run's own"
        )
    record, now = root / CORPUS, corpus.fingerprint
    # Without a run config no run started here (a start that failed before its runtime
    # wrote one, e.g. a Ray cluster short of slices): its corpus record binds nothing.
    begun = (root / RUN_CONFIG).exists()
    then = json.loads(record.read_text()) if record.exists() and begun else None
    if then is not None and (problem := corpus_record_problem(then)):
        raise ValueError(
            f"{record} holds {problem}: repair or remove it (a run "
            "without it records its corpus anew), or use another --workdir"
        )
    if then == now:
        return []
    if then is not None and not force:
        where = data.path or data.tfds_name or data.source
        raise ValueError(
            f"{workdir}'s run started on another corpus than {where!r} holds now "
            f"({_corpus_change(then, now)}): resume it on the files it started with, use "
            "another --workdir, or pass --force_resume to continue on these"
        )
    root.mkdir(parents=True, exist_ok=True)
    paths.write_atomic(record, json.dumps(now, indent=1, sort_keys=True))
    return [] if then is None else ["corpus"]


def corpus_changed(workdir: str, data: DataConfig) -> str | None:
    """What changed in the corpus `data` reads since the run in `workdir` recorded it (its
    `CORPUS`), or None: unchanged, or no usable record (an export, an older workdir)."""
    from decoupled_diloco.data import load_corpus

    record = epath.Path(workdir) / CORPUS
    if not record.exists():
        return None
    try:
        then = json.loads(record.read_text())
    except ValueError:
        return None
    if corpus_record_problem(then):
        return None
    now = load_corpus(data).fingerprint
    return None if then == now else _corpus_change(then, now)


def corpus_record_problem(record) -> str | None:
    """What is wrong with a `CORPUS` file's contents (None: a corpus record)."""
    if not isinstance(record, dict) or not record:
        return "not a corpus record (an object of splits)"
    for split, entry in record.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
            return f"a corpus record whose split {split!r} has no sha256"
        counts = [entry.get(k, 0) for k in ("documents", "characters")]
        if not all(isinstance(c, int) and c >= 0 for c in counts):
            return f"a corpus record whose split {split!r} has counts that are not integers >= 0"
    return None


def _corpus_change(then: dict, now: dict) -> str:
    def size(split: dict) -> str:
        chars = f", {split['characters']:,} characters" if "characters" in split else ""
        return f"{split.get('documents', 0):,} documents{chars}"

    parts = []
    for name in sorted(set(then) | set(now)):
        a, b = then.get(name, {}), now.get(name, {})
        if a != b:
            same = size(a) == size(b)
            parts.append(
                f"{name}: {size(b)} as then, other contents"
                if same
                else f"{name}: {size(a)} then, {size(b)} now"
            )
    return "; ".join(parts)


def with_shared_tokenizer(run: RunConfig, directory: str) -> RunConfig:
    """`run` for processes on other hosts: a sentencepiece model that this process (the
    driver) trained on the corpus is saved as `directory`/tokenizer.model (a path every host
    reaches, e.g. gs://...) and named by `data.spm_model_path`, so no learner host trains
    its own. Runs with a byte tokenizer or a given model are returned as they are."""
    if run.data.tokenizer != "sentencepiece" or run.data.spm_model_path:
        return run
    from decoupled_diloco.data import get_tokenizer

    path = paths.resolve(directory) / TOKENIZER
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.write_atomic(path, get_tokenizer(run.data).model_proto)
    data = dataclasses.replace(run.data, spm_model_path=str(path))
    return dataclasses.replace(run, data=data)


def read_config(path: str) -> RunConfig:
    file = epath.Path(path) / RUN_CONFIG
    if not file.exists():
        raise FileNotFoundError(
            f"{file} not found: {path} is not a run's workdir or an exported model (runs "
            "write it when they start)"
        )
    try:
        record = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}): a damaged run record") from e
    if not isinstance(record, dict):
        raise ValueError(f"{file} holds a JSON {type(record).__name__}, not a run's config: a "
                         "damaged run record")  # fmt: skip
    try:
        config = config_from_json(record)
        models.validate_model_config(config.model)  # (what building the model reads)
    except DamagedRecordError as e:
        raise ValueError(f"{file} {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"{file} does not hold a config this version reads ({e}): a "
                         "damaged run record, or one of another version") from e  # fmt: skip
    return config


def read_tokenizer(path: str, data: DataConfig) -> Tokenizer:
    """The tokenizer the run at `path` trained with."""
    if data.tokenizer == "byte":
        return ByteTokenizer()
    file = epath.Path(path) / TOKENIZER
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: the run's sentencepiece model is missing")
    data = _tokenizer_bytes(path)
    try:
        return SentencePieceTokenizer(data)
    except (RuntimeError, OSError) as e:  # sentencepiece: "could not parse ModelProto"
        raise ValueError(f"{file} is not a readable sentencepiece model ({e})") from e
