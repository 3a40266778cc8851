"""`load`: a run's (or an exported model's) config, tokenizer and global parameters.

    import decoupled_diloco
    model = decoupled_diloco.load("/tmp/dd_dec")           # the run's latest global model
    model = decoupled_diloco.load("/tmp/dd_dec", step=200)  # the last one saved by step 200
    logits, _ = model.forward(tokens_BT)

For DiLoCo-family runs the global model is Θ, read from the syncer shards' checkpoints
(`checkpoints/syncer_<s>/`, or `ray.checkpoint_dir`); for data-parallel runs it is the
learner's parameters (`checkpoints/learner_0/`). Checkpoints keep the last two saves
(`step` picks among them; the error lists what is there). An exported model
(`python -m decoupled_diloco.export`) loads the same way from its own directory.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from decoupled_diloco import integrity, models, paths, run_files
from decoupled_diloco.checkpoint import CorruptCheckpointError, quiet_failed_read_leftovers
from decoupled_diloco.config import RunConfig
from decoupled_diloco.data import Tokenizer
from decoupled_diloco.diloco.fragment_members import join_members
from decoupled_diloco.fragment_checkpoint import MANIFEST, FragmentCheckpointer

EXPORT_MARKER = "export.json"  # written by decoupled_diloco/export.py
PARAMS = "params"  # an export's orbax checkpoint of the flat parameters


@dataclasses.dataclass
class Model:
    """A loaded global model: flat float32 numpy params keyed by leaf name."""

    config: RunConfig
    tokenizer: Tokenizer
    params: dict[str, np.ndarray]
    source: str  # where the params came from, e.g. "syncer checkpoints #12 (learner step 300)"
    step: int | None = None  # the learner step they hold (None: an export that did not say)
    # (the arrays of `params` that `device_params` copied, and their device copy)
    _on_device: tuple | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def nested(self) -> dict:
        """The params as the model's nested dict (`models.forward` takes it)."""
        return models.unflatten_params(self.params)

    def device_params(self) -> dict:
        """The nested params on the default device: copied there once and kept while
        `params` holds the same arrays, so repeated `forward` calls do not move every
        parameter again (seconds per call for a 2B model). The copied arrays are made
        read-only; to change the model, assign a new array to a key of `params` (the next
        call copies again)."""
        held = self._on_device[0] if self._on_device is not None else {}
        if held.keys() != self.params.keys() or any(
            held[k] is not v for k, v in self.params.items()
        ):
            for v in self.params.values():
                if isinstance(v, np.ndarray):
                    v.flags.writeable = False  # an in-place edit would leave the copy stale
            self._on_device = None  # (the old copy's device memory goes first)
            self._on_device = (dict(self.params), jax.device_put(self.nested()))
        return self._on_device[1]

    def forward(self, tokens_BT) -> tuple[jax.Array, dict]:
        """logits_BTV (float32) and aux of the model on int tokens [B, T] (any array-like)."""
        rows = tokens_BT if isinstance(tokens_BT, list | tuple) else []
        lengths = {len(r) for r in rows if isinstance(r, list | tuple | np.ndarray)}
        if len(lengths) > 1:
            raise ValueError(
                f"tokens must be [batch, length] with rows of one length, got lengths "
                f"{sorted(lengths)}; pad them, or run one prompt at a time (decoupled_diloco."
                "sample handles prompts of different lengths)"
            )
        ids = np.asarray(tokens_BT)
        if ids.ndim != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {ids.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"tokens must be integer ids, got dtype {ids.dtype}")
        vocab = self.config.model.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            # (an id past the table reads NaN on device, a negative one wraps around)
            raise ValueError(
                f"token ids must lie in [0, {vocab}) (the model's vocabulary), got "
                f"{ids.min()}..{ids.max()}"
            )
        return _forward(self.config.model, self.device_params(), jnp.asarray(ids, jnp.int32))


_forward = jax.jit(models.forward, static_argnums=0)


def load(path: str, step: int | None = None) -> Model:
    """The global model of the run (or export) at `path`; `step`: the newest checkpoint saved
    at or before that learner step instead of the newest one."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise TypeError(f"step must be a learner step (an int) or None, not {step!r}")
    if step is not None and step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    # Absolute (orbax refuses a relative checkpoint path), with ~ expanded: every read below
    # goes through it.
    root = paths.resolve(path)
    if (root / EXPORT_MARKER).exists():
        return _checked(_load_export(root, step), root)
    if (root / PARAMS).exists() and not (root / "checkpoints").exists():
        raise ValueError(
            f"{path} is an unfinished export (its {EXPORT_MARKER}, written last, is missing): "
            "export the run again"
        )
    config = run_files.read_config(str(root))
    tokenizer = run_files.read_tokenizer(str(root), config.data)
    # Where the run saved: a Ray run's actors under `ray.checkpoint_dir` when it is set, the
    # local runtime always under the workdir (it reads no ray.* key).
    ray_dir = config.ray.checkpoint_dir if config.runtime == "ray" else ""
    ckpt_dir = paths.resolve(ray_dir or root / "checkpoints")
    if config.uses_syncer:
        params, source, reached = _syncer_theta(ckpt_dir, config, step)
    else:
        params, source, reached = _learner_params(ckpt_dir / "learner_0", config, step)
    return _checked(Model(config, tokenizer, params, source, reached), root)


def _checked(model: Model, root: epath.Path) -> Model:
    """The model, once its parameters are those its config's model has, leaf for leaf and
    shape for shape: a Θ or an export read without a target tree (and a config edited
    since) ran a truncated model without a word (extra leaves are ignored by `forward`) or
    failed deep in it."""
    want = {k: tuple(v.shape) for k, v in models.flatten_params(
        models.param_shapes(model.config.model)).items()}  # fmt: skip
    got = {k: tuple(np.shape(v)) for k, v in model.params.items()}
    if got == want:
        return model
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    shaped = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
    parts = [f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
             f"{len(extra)} not in the model (e.g. {extra[0]})" if extra else "",
             f"{len(shaped)} of another shape (e.g. {shaped[0]}: {got[shaped[0]]}, the model's "
             f"{want[shaped[0]]})" if shaped else ""]  # fmt: skip
    raise ValueError(
        f"{root}: the parameters of {model.source} do not fit the model its run_config.json "
        f"describes: {'; '.join(p for p in parts if p)} (a config or a checkpoint from "
        "another run?)"
    )


def _at_or_before(step: int | None) -> str:
    return "" if step is None else f" at or before step {step}"


def _manager(directory: epath.Path) -> ocp.CheckpointManager:
    if not directory.exists():
        raise FileNotFoundError(f"no checkpoints at {directory}")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
    level = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # orbax warns that a read-only manager is read-only
    try:
        return ocp.CheckpointManager(directory, options=options)
    finally:
        logging.set_verbosity(level)


def _restore(manager, n: int, arrays=None) -> tuple[dict, dict]:
    quiet_failed_read_leftovers()
    restore = ocp.args.StandardRestore(arrays) if arrays is not None else ocp.args.StandardRestore()
    out = manager.restore(n, args=ocp.args.Composite(arrays=restore, meta=ocp.args.JsonRestore()))
    reason = integrity.check(out["arrays"], out["meta"])
    if reason:  # read-only here: the run's own restore sets bad steps aside
        raise CorruptCheckpointError(f"{manager.directory}/{n}: {reason}")
    return out["arrays"], out["meta"]


def _syncer_theta(ckpt_dir: epath.Path, config: RunConfig, step: int | None):
    """Θ from every syncer shard: each shard's newest checkpoint (at or before `step`) that
    verifies; a newer one that does not is skipped with a warning and named in `source`.
    Returns (Θ, source, the newest learner step the picked checkpoints had seen)."""
    params, picked, reached_steps = {}, [], []
    for shard in range(config.diloco.syncer_shards):
        directory = ckpt_dir / f"syncer_{shard}"
        if not directory.exists():
            raise FileNotFoundError(f"no checkpoints at {directory}")
        ckpt = FragmentCheckpointer(str(directory), read_only=True)
        saves = ckpt.all_steps()
        if not saves:
            raise FileNotFoundError(f"syncer shard {shard}: no checkpoint in {ckpt_dir}")
        refused, reached = {}, {}  # (save number: why refused)
        for n in saves:
            try:
                reached[n] = _learner_step(ckpt, n)
            except CorruptCheckpointError as e:
                refused[n] = str(e)
        ok = sorted((n for n in reached if step is None or reached[n] <= step), reverse=True)
        if not ok and not refused:
            raise ValueError(
                f"no syncer checkpoint at or before step {step}: shard {shard} keeps saves "
                f"{saves} at learner steps {[reached[n] for n in saves]}"
            )
        for n in ok:
            try:
                parts, _ = ckpt.read(n, momentum=False)
            except CorruptCheckpointError as e:
                refused[n] = str(e)
                continue
            for arrays, _ in parts.values():
                params.update({k: np.asarray(v, np.float32) for k, v in arrays["theta"].items()})
            # Only saves after the one used were passed over: an unreadable manifest of an
            # older one read "1 newer refused, an older one is used" beside the newest.
            passed = [why for m, why in sorted(refused.items()) if m > n]
            picked.append(f"#{n} (learner step {reached[n]})" + _refused_note(passed))
            reached_steps.append(reached[n])
            break
        else:
            ckpt.close()
            raise CorruptCheckpointError(
                f"syncer shard {shard}: no checkpoint{_at_or_before(step)} can be trusted: "
                + "; ".join(refused[m] for m in sorted(refused))
            )
        ckpt.close()
    source = "syncer checkpoints " + ", ".join(picked)
    return join_members(params), source, max(reached_steps)


def _refused_note(refused: list[str]) -> str:
    """Logs the newer checkpoints a load passed over; the note for the model's `source`."""
    for why in refused:
        logging.warning("checkpoint refused, an older one is used: %s", why)
    return f" [{len(refused)} newer refused: {'; '.join(refused)}]" if refused else ""


def _learner_step(ckpt: FragmentCheckpointer, n: int) -> int:
    """The newest learner step the registry of syncer checkpoint n had seen."""
    path = ckpt.path / str(n) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        learners = manifest["meta"].get("learners", {}).values()
        return max((e[2] for e in learners), default=0)
    except Exception as e:  # a checkpoint whose manifest cannot be read is refused
        raise CorruptCheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from e


def _learner_params(directory: epath.Path, config: RunConfig, step: int | None):
    """A data-parallel run's parameters, restored onto this host's first device."""
    from decoupled_diloco.train import optimizer as optim
    from decoupled_diloco.train.step import TrainState

    manager = _manager(directory)
    saves = manager.all_steps()
    ok = [n for n in saves if step is None or n <= step]
    if not saves:
        raise FileNotFoundError(f"no learner checkpoint in {directory}: the run saved none yet")
    if not ok:
        raise ValueError(f"no learner checkpoint at or before step {step}: kept {saves}")
    params = models.param_shapes(config.model)
    opt = optim.make_inner_optimizer(config.train)
    opt_state = jax.eval_shape(opt.init, params)
    abstract = TrainState(jax.ShapeDtypeStruct((), np.int32), params, opt_state)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract
    )
    refused = []
    for n in sorted(ok, reverse=True):
        try:
            state, _ = _restore(manager, n, abstract)
        except Exception as e:  # unreadable files are refused like bad bytes
            # (orbax's errors carry TensorStore's whole state, ~60 lines: its first line)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            why = str(e) if isinstance(e, CorruptCheckpointError) else f"{directory}/{n}: {first}"
            refused.append(why)
            continue
        manager.close()
        flat = models.flatten_params(jax.device_get(state.params))
        source = f"learner step {n}" + _refused_note(refused)
        return {k: np.asarray(v, np.float32) for k, v in flat.items()}, source, n
    manager.close()
    if refused and all(_MISFIT.search(why) for why in refused):
        raise ValueError(
            f"{directory}: the learner checkpoints{_at_or_before(step)} hold parameters that "
            f"do not fit the model its run_config.json describes (a config or a checkpoint "
            f"from another run?): " + "; ".join(refused)
        )
    raise CorruptCheckpointError(
        f"no learner checkpoint{_at_or_before(step)} can be trusted: " + "; ".join(refused)
    )


# How orbax (0.11-0.12) refuses a restore into another tree or other shapes than it saved:
# intact files of another model, not damage (the error says so; another wording reads as
# damage, as before).
_MISFIT = re.compile(r"tree structures do not match|is not compatible with the stored shape")


def _load_export(root: epath.Path, step: int | None) -> Model:
    try:
        info = json.loads((root / EXPORT_MARKER).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{root / EXPORT_MARKER} is not the export's record ({e})") from e
    if not isinstance(info, dict):
        raise ValueError(f"{root / EXPORT_MARKER} is not the export's record (not an object)")
    exported = info.get("step")
    if exported is not None and (isinstance(exported, bool) or not isinstance(exported, int)):
        raise ValueError(f"{root / EXPORT_MARKER}: its step must be an int or null, got "
                         f"{exported!r}")  # fmt: skip
    if step is not None and exported is None:
        raise ValueError(f"{root} does not record the step it holds: load it without --step")
    if step is not None and exported > step:
        raise ValueError(f"{root} is an export of step {exported}, after step {step}")
    config = run_files.read_config(str(root))
    tokenizer = run_files.read_tokenizer(str(root), config.data)
    manager = _manager(root / PARAMS)
    n = manager.latest_step()
    try:
        if n is None:
            raise CorruptCheckpointError(f"{root / PARAMS} holds no saved parameters: the "
                                         "export is damaged; export the run again")  # fmt: skip
        arrays, _ = _restore(manager, n)
    except CorruptCheckpointError:
        raise
    except Exception as e:
        # Damaged orbax files fail in orbax's own read, whose errors name neither the export
        # nor the damage (bad bytes in its metadata: "'utf-8' codec can't decode byte 0xff");
        # refused as the run's learner checkpoints are (its first line: TensorStore's errors
        # carry ~60 lines of state).
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise CorruptCheckpointError(
            f"{root / PARAMS}/{n} cannot be read ({type(e).__name__}: {first}): the export is "
            "damaged; export the run again"
        ) from e
    finally:
        manager.close()
    params = {k: np.asarray(v, np.float32) for k, v in arrays.items()}
    return Model(config, tokenizer, params, f"export of {info.get('source', '?')}", exported)
