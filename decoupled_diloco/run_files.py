"""What a run keeps in its workdir beside its logs and checkpoints, so that its model can be
used without the command that trained it (decoupled_diloco/loading.py):

  <workdir>/run_config.json   the validated run config, every section as its dataclass
  <workdir>/tokenizer.model   the sentencepiece model (data.tokenizer = "sentencepiece";
                              byte-level runs need no file)

Paths may be local or remote (gs://...: etils.epath, through gcsfs where installed). A
driver that trained a sentencepiece model also shares it with the other hosts of a Ray run
(`with_shared_tokenizer`).
"""

import dataclasses
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
    """The RunConfig `config_to_json` wrote (keys a newer version removed are ignored)."""
    sections = {name: _section(dc, d[name]) for name, dc in _SECTIONS.items() if name in d}
    rest = {k: v for k, v in d.items() if k not in _SECTIONS}
    return RunConfig(**sections, **rest)


def write(workdir: str, run: RunConfig, tokenizer: Tokenizer | None = None) -> None:
    """Writes the run's config and, for sentencepiece runs, its tokenizer (`tokenizer`, or
    the one of the run's corpus) into its workdir."""
    if tokenizer is None and run.data.tokenizer == "sentencepiece":
        from decoupled_diloco.data import get_tokenizer

        tokenizer = get_tokenizer(run.data)
    root = paths.resolve(workdir)
    root.mkdir(parents=True, exist_ok=True)
    config = json.dumps(config_to_json(run), indent=1, sort_keys=True)
    paths.write_atomic(root / RUN_CONFIG, config)  # a resumed run rewrites it
    if isinstance(tokenizer, SentencePieceTokenizer):
        paths.write_atomic(root / TOKENIZER, tokenizer.model_proto)


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
        text = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e}): a damaged run record") from e
    return config_from_json(text)


def read_tokenizer(path: str, data: DataConfig) -> Tokenizer:
    """The tokenizer the run at `path` trained with."""
    if data.tokenizer == "byte":
        return ByteTokenizer()
    file = epath.Path(path) / TOKENIZER
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: the run's sentencepiece model is missing")
    return SentencePieceTokenizer(file.read_bytes())
