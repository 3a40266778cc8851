"""A learner's device mesh and the one logical-axis rules table.

Every learner owns a `jax.sharding.Mesh` over an explicit list of devices, so several
learners can own disjoint subsets of one host's (or one pod's) devices. Inside a mesh the
axes are:

  data    pure data parallelism (params replicated),
  fsdp    data parallelism with parameters and optimizer state sharded (ZeRO-3 style),
  tensor  Megatron-style tensor parallelism over heads / ffw hidden / vocab,
  expert  expert parallelism for MoE layers (batch is also split over it).

The model names each parameter dimension with a *logical* axis (see
`models.param_logical_axes`); `LOGICAL_RULES` maps logical axes to mesh axes. A dimension
that is not divisible by its mesh axis stays replicated rather than failing, because tiny
CPU models routinely have e.g. 4 kv heads on an 8-way tensor axis.

Activations are placed by the same table: inside `constraint_mesh(mesh)` (which a train step
enters while it is traced), `constrain(x, logical_axes)` pins an intermediate to the rules'
sharding; outside it `constrain` is the identity, so model code runs unchanged on one device.
The dense path pins its residual stream, q/k/v, ffw hidden and logits with it (rows over the
batch axes), without which the FSDP-sharded embedding left activations split over d_model and
every device computed the whole global batch. The MoE layer uses it to move dispatched tokens
to the devices holding their expert (an all-to-all) instead of letting XLA all-gather every
expert's weights onto every device.
"""

import contextlib
import dataclasses
import math
import types
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp", "expert"),
    # Batch dim of expert-major (dispatched) MoE activations: the expert axis is taken by
    # their expert dim, so rows are split over the pure data axes only.
    "dispatch_batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "expert": "expert",
    "head_dim": None,
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The `mesh.*` section: a learner's own mesh; -1 on one axis = all remaining devices."""

    data: int = -1  # pure data-parallel axis (devices)
    fsdp: int = 1  # parameter-sharded data-parallel axis
    tensor: int = 1  # tensor-parallel axis (heads, ffw hidden, vocab)
    expert: int = 1  # expert-parallel axis (MoE)


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """Resolves the -1 axis; raises ValueError naming `mesh.<axis>` on a mismatch."""
    sizes = {a: getattr(cfg, a) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        names = " and ".join(f"mesh.{a}" for a in free)
        hint = ""
        if "data" in free and cfg.data == MeshConfig.data:  # the default, likely not set
            other = next(a for a in free if a != "data")
            hint = (
                f" (mesh.data is -1 by default, taking the devices the other axes leave: "
                f"set mesh.data=1 for mesh.{other} to take them all)"
            )
        raise ValueError(f"{names} are all -1; at most one mesh axis may be -1{hint}")
    for a, s in sizes.items():
        if not isinstance(s, int) or s == 0 or s < -1:
            raise ValueError(f"mesh.{a} must be a positive integer or -1, got {s!r}")
    if num_devices < 1:
        raise ValueError(f"mesh: a learner needs at least one device, got {num_devices}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            others = [f"mesh.{a}={s}" for a, s in sizes.items() if s > 1]
            product = " * ".join(others) + (f" = {fixed}" if len(others) > 1 else "")
            raise ValueError(
                f"mesh.{free[0]}=-1: {num_devices} devices per learner are not divisible by "
                f"the other mesh axes ({product})"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        used = " * ".join(f"mesh.{a}={s}" for a, s in sizes.items())
        raise ValueError(f"{used} = {fixed} devices, but each learner has {num_devices}")
    return tuple(sizes[a] for a in MESH_AXES)


def make_mesh(devices: Sequence[jax.Device], cfg: MeshConfig = MeshConfig()) -> Mesh:
    """A mesh over exactly `devices` (in the given order) with axes `MESH_AXES`."""
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES)


def learner_devices(devices: Sequence[jax.Device], per_learner: int, m: int) -> list:
    """Learner m's devices: disjoint groups of `per_learner`; with more learners than
    groups, learners share the groups round-robin."""
    groups = max(len(devices) // per_learner, 1)
    g = m % groups
    return list(devices[g * per_learner : (g + 1) * per_learner])


def batch_axis_size(mesh: Mesh) -> int:
    """How many ways a batch is split inside `mesh`."""
    rule = LOGICAL_RULES["batch"]
    return math.prod(mesh.shape[a] for a in rule)


def logical_to_spec(
    logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh
) -> PartitionSpec:
    """PartitionSpec for one array: logical axes mapped by the rules table.

    A mesh axis is used at most once per array, and only when it divides the dimension.
    """
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {logical} do not match shape {shape}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical, shape, strict=True):
        rule = LOGICAL_RULES.get(name) if name is not None else None
        axes = (rule,) if isinstance(rule, str) else tuple(rule or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
        if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0:
            used.update(axes)
            spec.append(axes[0] if len(axes) == 1 else axes)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def param_shardings(params_shapes, logical_axes, mesh: Mesh):
    """Tree of NamedSharding matching `params_shapes` (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(
        lambda x, axes: NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh)),
        params_shapes,
        logical_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def whole_on_axes(params_shapes, logical_axes, shape: Sequence[int]) -> dict[str, tuple]:
    """For each parameter-splitting mesh axis (fsdp, tensor, expert) of more than one device
    in a mesh of `shape` (MESH_AXES order): (share of the parameters the rules would split
    over it that stay whole on it, because it does not divide their dimension, those
    parameters' names). Shares are of elements."""
    sizes = dict(zip(MESH_AXES, shape, strict=True))
    mesh = types.SimpleNamespace(shape=sizes)  # (what logical_to_spec reads of a Mesh)

    def mesh_axes(entries) -> set[str]:  # the mesh axes rules or spec entries name
        return {a for e in entries for a in ((e,) if isinstance(e, str) else e or ())}

    paths, _ = jax.tree_util.tree_flatten_with_path(params_shapes)
    axes_of = jax.tree.leaves(logical_axes, is_leaf=lambda x: isinstance(x, tuple))
    leaves = []  # (name, elements, axes the rules would split it over, axes that split it)
    for (path, leaf), logical in zip(paths, axes_of, strict=True):
        meant = mesh_axes(LOGICAL_RULES.get(a) for a in logical if a is not None)
        split = mesh_axes(logical_to_spec(logical, leaf.shape, mesh))
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        leaves.append((name, math.prod(leaf.shape), meant, split))
    out = {}
    for axis in ("fsdp", "tensor", "expert"):
        meant = [(name, n, axis in split) for name, n, rules, split in leaves if axis in rules]
        if sizes[axis] == 1 or not meant:
            continue
        whole = [(name, n) for name, n, was_split in meant if not was_split]
        share = sum(n for _, n in whole) / sum(n for _, n, _ in meant)
        out[axis] = (share, [name for name, _ in whole])
    return out


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a [B, T] token batch: B over the batch axes, T replicated."""
    return NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"], None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def constraint_mesh(mesh: Mesh | None):
    """Context in which `constrain` shards activations over `mesh` (None: a no-op context).

    Enters only the abstract mesh, so it may be used inside a function being jitted; jit the
    function with shardings on the same `mesh`.
    """
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """`x` pinned to the rules' sharding of `logical` (one name per dim) over the context mesh.

    The identity outside `constraint_mesh` (or `jax.set_mesh`), e.g. in single-device tests.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    manual = jax.sharding.AxisType.Manual
    if manual in mesh.axis_types:  # inside a shard_map: its manual axes are already split
        kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        sizes = {a: 1 if kinds[a] == manual else n for a, n in mesh.shape.items()}
        mesh = types.SimpleNamespace(shape=sizes)
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical, x.shape, mesh))
