"""Cloud TPU v5e / v5p slice shapes: chips, hosts, runtime version and the Ray resources they get.

Facts, from the Cloud TPU docs ("TPU v5e", "TPU v5p", "TPU software versions") and Ray's TPU
accelerator manager (`ray/_private/accelerators/tpu.py`):

- v5e is named `v5litepod-N` with N = chips (one TensorCore per chip). Slices of 1, 4 or 8 chips
  are one VM holding all of them; larger slices (16..256) are VMs of 4 chips each.
- v5p is named `v5p-N` with N = TensorCores = 2 x chips, 4 chips per VM; `v5p-8` is one VM.
- Runtime (OS image) versions for JAX: `v2-alpha-tpuv5-lite` (v5e), `v2-alpha-tpuv5` (v5p).
- A Ray node started on a TPU VM auto-registers `{"TPU": chips on the VM}`, `{<node id>: 1}`
  (the TPU node, i.e. slice, name) and, on worker 0 only, `{"TPU-<accelerator type>-head": 1}`.
"""

import dataclasses
import re

V5E_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)  # chips; a v5e pod has 256
V5P_MAX_CORES = 12_288  # the largest schedulable v5p slice: 6144 chips (96 cubes)
HOST_CHIPS = 4  # chips per VM of every multi-host v5e slice and of every v5p slice


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str  # marketing name, for messages
    runtime_version: str  # default --runtime-version
    cores_per_chip: int  # the N in "<prefix>-N" counts TensorCores


GENERATIONS = {
    "v5litepod": Generation("v5e", "v2-alpha-tpuv5-lite", cores_per_chip=1),
    "v5p": Generation("v5p", "v2-alpha-tpuv5", cores_per_chip=2),
}


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """One TPU slice of a given accelerator type."""

    accelerator_type: str  # e.g. "v5litepod-16", "v5p-32"
    generation: str  # a key of GENERATIONS
    chips: int  # chips in the slice = devices of one learner's mesh
    chips_per_host: int  # chips each TPU VM (Ray node) sees

    @property
    def hosts(self) -> int:
        """TPU VMs in the slice (processes of one learner)."""
        return self.chips // self.chips_per_host

    @property
    def runtime_version(self) -> str:
        return GENERATIONS[self.generation].runtime_version

    @property
    def ray_head_resource(self) -> str:
        """Ray's auto-registered resource of the slice's worker 0, e.g. "TPU-v5p-16-head"."""
        return f"TPU-{self.accelerator_type}-head"


def parse_accelerator(accelerator_type: str) -> SliceSpec:
    """`v5litepod-N` or `v5p-N` -> its SliceSpec; ValueError naming --accelerator otherwise."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator_type or "")
    if not m or m.group(1) not in GENERATIONS:
        raise ValueError(
            f"--accelerator={accelerator_type!r}: expected v5litepod-N (TPU v5e, N chips) or "
            "v5p-N (TPU v5p, N TensorCores = 2 x chips), e.g. v5litepod-16 or v5p-32"
        )
    generation, n = m.group(1), int(m.group(2))
    if generation == "v5litepod":
        if n not in V5E_SIZES:
            raise ValueError(
                f"--accelerator={accelerator_type!r}: v5e slices have {V5E_SIZES} chips"
            )
        per_host = n if n <= 8 else HOST_CHIPS  # 1-, 4- and 8-chip slices are a single VM
        return SliceSpec(accelerator_type, generation, chips=n, chips_per_host=per_host)
    if n < 8 or n % 8 or n > V5P_MAX_CORES:
        raise ValueError(
            f"--accelerator={accelerator_type!r}: v5p-N counts TensorCores (2 per chip, 4 chips "
            f"per host), so N must be a multiple of 8 in [8, {V5P_MAX_CORES}]"
        )
    return SliceSpec(accelerator_type, generation, chips=n // 2, chips_per_host=HOST_CHIPS)


_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def check_name(name: str) -> str:
    """A resource-name prefix valid for Compute Engine once "-qr"/"-head"/"-<i>" is appended."""
    if not _NAME.fullmatch(name or "") or len(name) > 40:
        raise ValueError(
            f"--name={name!r}: use lowercase letters, digits and hyphens, starting with a letter, "
            "not ending with a hyphen, at most 40 characters"
        )
    return name


def node_ids(name: str, num_slices: int) -> list[str]:
    """TPU node (slice) ids `<name>-0 .. <name>-<M-1>`."""
    if not isinstance(num_slices, int) or num_slices < 1:
        raise ValueError(f"--slices={num_slices!r}: need at least one slice (one per learner)")
    return [f"{name}-{i}" for i in range(num_slices)]


def one_slice(name: str, num_slices: int, index: int) -> str:
    """The node id of slice `index` (--slice) of the M slices (--slices)."""
    nodes = node_ids(name, num_slices)
    if not 0 <= index < num_slices:
        raise ValueError(
            f"--slice={index}: must be in [0, {num_slices - 1}] (--slices={num_slices})"
        )
    return nodes[index]


def queued_resource_ids(name: str, num_slices: int) -> list[str]:
    """One queued resource per slice: each slice is granted, preempted and replaced alone.

    There is deliberately no multislice request (`--node-count`): its slices are one
    all-or-nothing allocation, and its hosts get `MEGASCALE_*` settings with which
    `jax.distributed` and the TPU runtime join every slice into one world, so that one slice's
    failure stops every learner (decoupled_diloco/jax_world.py)."""
    return [f"{node}-qr" for node in node_ids(name, num_slices)]


_ZONE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]")


def check_zones(zones: list[str]) -> list[str]:
    """Zone names like us-central2-b; ValueError naming the flag otherwise."""
    bad = [z for z in zones if not _ZONE.fullmatch(z)]
    if bad or not zones:
        raise ValueError(
            f"--zone/--zones: {bad or zones!r} are not zone names like us-west4-a (a region and "
            "a letter; `gcloud compute tpus locations list` lists them)"
        )
    return zones


def head_vm_name(name: str) -> str:
    """The CPU VM running the Ray head, the syncer actor and the driver."""
    return f"{name}-head"
