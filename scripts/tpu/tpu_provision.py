"""Pure builders of the gcloud commands that create, inspect and delete the TPU slices and the
CPU head VM. Each returns argv lists for `subprocess.run` (no local shell); nothing runs here.
"""

import dataclasses

from tpu_slices import (
    SliceSpec,
    check_zones,
    head_vm_name,
    node_ids,
    one_slice,
    queued_resource_ids,
)

QUEUED = ["gcloud", "compute", "tpus", "queued-resources"]
# Every VM may call every Cloud API its service account's IAM roles allow: the default
# access scopes of a Compute Engine VM read Cloud Storage only, and the syncer (head VM) and
# the learners (TPU VMs) write checkpoints, the run's records and a tokenizer to the bucket.
SCOPES = "--scopes=cloud-platform"
TPU_VM = ["gcloud", "compute", "tpus", "tpu-vm"]
INSTANCES = ["gcloud", "compute", "instances"]


@dataclasses.dataclass(frozen=True)
class Cloud:
    """Where resources live; every gcloud command gets its zone and project explicitly.

    `zone` holds the head VM, and every slice unless `slice_zones` is given (--zones): slice i
    is then placed in `slice_zones[i % len(slice_zones)]`, so learners can sit in different
    zones and regions (the paper's cross-region setting; the syncer stays on the head)."""

    project: str
    zone: str
    slice_zones: tuple[str, ...] = ()

    def __post_init__(self):
        for key in ("project", "zone"):
            if not getattr(self, key):
                raise ValueError(f"--{key} is required (no gcloud default is assumed)")
        check_zones([self.zone, *self.slice_zones])

    @property
    def flags(self) -> list[str]:
        return [f"--zone={self.zone}", f"--project={self.project}"]

    def zone_of(self, index: int) -> str:
        """The zone of slice `index`."""
        return self.slice_zones[index % len(self.slice_zones)] if self.slice_zones else self.zone

    def of_slice(self, index: int) -> "Cloud":
        """Where slice `index` lives (its commands take this Cloud's flags)."""
        return Cloud(self.project, self.zone_of(index))

    def zones(self, num_slices: int | None = None) -> list[str]:
        """Distinct zones in use, the head's first: all of `slice_zones` when `num_slices` is
        None, else those of slices 0..num_slices-1."""
        n = len(self.slice_zones) if num_slices is None else num_slices
        used = [self.zone, *(self.zone_of(i) for i in range(n))]
        return list(dict.fromkeys(used))


def queued_resource_commands(
    spec: SliceSpec,
    name: str,
    num_slices: int,
    cloud: Cloud,
    runtime_version: str = "",
    spot: bool = False,
    reserved: bool = False,
    valid_until_duration: str = "",
    only: int | None = None,
) -> list[list[str]]:
    """`gcloud compute tpus queued-resources create` for M slices named `<name>-<i>`, each in
    its zone (`cloud.zone_of(i)`).

    One queued resource per slice, so each slice is provisioned, preempted and replaced on its
    own (the failure isolation Decoupled DiLoCo relies on). `only` = i: slice i alone
    (re-creating a preempted slice).
    """
    if spot and reserved:
        raise ValueError("--spot and --reserved are exclusive: pick one provisioning model")
    nodes = node_ids(name, num_slices)
    if only is not None:
        one_slice(name, num_slices, only)
    flags = [
        f"--accelerator-type={spec.accelerator_type}",
        f"--runtime-version={runtime_version or spec.runtime_version}",
    ]
    extra = [SCOPES, "--spot"] if spot else [SCOPES]
    extra += ["--reserved"] if reserved else []
    extra += [f"--valid-until-duration={valid_until_duration}"] if valid_until_duration else []
    qrs = queued_resource_ids(name, num_slices)
    out = []
    for i, (qr, node) in enumerate(zip(qrs, nodes, strict=True)):
        if only is None or i == only:
            where = cloud.of_slice(i).flags
            out.append([*QUEUED, "create", qr, f"--node-id={node}", *flags, *where, *extra])
    return out


def head_vm_command(name: str, cloud: Cloud, machine_type: str, disk_size: str) -> list[str]:
    """The CPU VM of the Ray head, the syncer and the driver. On-demand (no --spot): it holds the
    global parameters Θ and the outer optimizer state, and only checkpoints protect them."""
    image = ["--image-family=ubuntu-2204-lts", "--image-project=ubuntu-os-cloud"]
    size = [f"--machine-type={machine_type}", f"--boot-disk-size={disk_size}"]
    return [*INSTANCES, "create", head_vm_name(name), *cloud.flags, *size, *image, SCOPES]


def head_ssh(name: str, cloud: Cloud, script: str) -> list[str]:
    """Runs the shell line `script` on the head VM (in its login home directory)."""
    return ["gcloud", "compute", "ssh", head_vm_name(name), *cloud.flags, f"--command={script}"]


def tpu_ssh(node: str, cloud: Cloud, script: str) -> list[str]:
    """Runs the shell line `script` on every host (worker) of TPU slice `node`."""
    return [*TPU_VM, "ssh", node, "--worker=all", *cloud.flags, f"--command={script}"]


def head_ip_command(name: str, cloud: Cloud) -> list[str]:
    """Prints the head VM's internal IP (TPU VMs reach it over the VPC network)."""
    fmt = "--format=get(networkInterfaces[0].networkIP)"
    return [*INSTANCES, "describe", head_vm_name(name), *cloud.flags, fmt]


def delete_commands(
    name: str,
    num_slices: int,
    cloud: Cloud,
    keep_head: bool = False,
    only: int | None = None,
) -> list[list[str]]:
    """Deletes the queued resources together with their TPU VMs (--force), each in its zone,
    then the head VM; `only` = i: slice i's queued resource alone, never the head. No --quiet
    on purpose: gcloud asks for confirmation before each deletion."""
    if only is not None:
        one_slice(name, num_slices, only)
    out = [
        [*QUEUED, "delete", qr, *cloud.of_slice(i).flags, "--force"]
        for i, qr in enumerate(queued_resource_ids(name, num_slices))
        if only is None or i == only
    ]
    if not keep_head and only is None:
        out.append([*INSTANCES, "delete", head_vm_name(name), *cloud.flags])
    return out
