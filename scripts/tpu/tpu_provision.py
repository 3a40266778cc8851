"""Pure builders of the gcloud commands that create, inspect and delete the TPU slices and the
CPU head VM. Each returns argv lists for `subprocess.run` (no local shell); nothing runs here.
"""

import dataclasses

from tpu_slices import SliceSpec, head_vm_name, node_ids, one_slice, queued_resource_ids

QUEUED = ["gcloud", "compute", "tpus", "queued-resources"]
TPU_VM = ["gcloud", "compute", "tpus", "tpu-vm"]
INSTANCES = ["gcloud", "compute", "instances"]


@dataclasses.dataclass(frozen=True)
class Cloud:
    """Where resources live; every gcloud command gets both flags explicitly."""

    project: str
    zone: str

    def __post_init__(self):
        for key in ("project", "zone"):
            if not getattr(self, key):
                raise ValueError(f"--{key} is required (no gcloud default is assumed)")

    @property
    def flags(self) -> list[str]:
        return [f"--zone={self.zone}", f"--project={self.project}"]


def queued_resource_commands(
    spec: SliceSpec,
    name: str,
    num_slices: int,
    cloud: Cloud,
    runtime_version: str = "",
    spot: bool = False,
    reserved: bool = False,
    multislice: bool = False,
    valid_until_duration: str = "",
    only: int | None = None,
) -> list[list[str]]:
    """`gcloud compute tpus queued-resources create` for M slices named `<name>-<i>`.

    Default: one queued resource per slice, so each slice is provisioned, preempted and
    replaced on its own (the failure isolation Decoupled DiLoCo relies on). `multislice`
    requests all M in one resource (`--node-count`: all or nothing; gcloud needs M >= 2).
    `only` = i: slice i alone (re-creating a preempted slice).
    """
    if spot and reserved:
        raise ValueError("--spot and --reserved are exclusive: pick one provisioning model")
    nodes = node_ids(name, num_slices)
    if multislice and num_slices < 2:
        raise ValueError("--multislice needs --slices >= 2 (gcloud --node-count > 1), got 1")
    _check_only(name, num_slices, multislice, only)
    flags = [
        f"--accelerator-type={spec.accelerator_type}",
        f"--runtime-version={runtime_version or spec.runtime_version}",
        *cloud.flags,
    ]
    flags += ["--spot"] if spot else []
    flags += ["--reserved"] if reserved else []
    flags += [f"--valid-until-duration={valid_until_duration}"] if valid_until_duration else []
    qrs = queued_resource_ids(name, num_slices, multislice)
    if multislice:
        count = [f"--node-count={num_slices}", f"--node-prefix={name}"]
        return [[*QUEUED, "create", qrs[0], *count, *flags]]
    pairs = list(zip(qrs, nodes, strict=True))
    if only is not None:
        pairs = [pairs[only]]
    return [[*QUEUED, "create", qr, f"--node-id={node}", *flags] for qr, node in pairs]


def _check_only(name: str, num_slices: int, multislice: bool, only: int | None) -> None:
    if only is None:
        return
    one_slice(name, num_slices, only)
    if multislice:
        raise ValueError(
            "--slice works on slices created one queued resource each; a --multislice "
            "request is all or nothing (delete and re-create it whole)"
        )


def head_vm_command(name: str, cloud: Cloud, machine_type: str, disk_size: str) -> list[str]:
    """The CPU VM of the Ray head, the syncer and the driver. On-demand (no --spot): it holds the
    global parameters Θ and the outer optimizer state, and only checkpoints protect them."""
    image = ["--image-family=ubuntu-2204-lts", "--image-project=ubuntu-os-cloud"]
    size = [f"--machine-type={machine_type}", f"--boot-disk-size={disk_size}"]
    return [*INSTANCES, "create", head_vm_name(name), *cloud.flags, *size, *image]


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
    multislice: bool = False,
    keep_head: bool = False,
    only: int | None = None,
) -> list[list[str]]:
    """Deletes the queued resources together with their TPU VMs (--force), then the head VM;
    `only` = i: slice i's queued resource alone, never the head. No --quiet on purpose:
    gcloud asks for confirmation before each deletion."""
    _check_only(name, num_slices, multislice, only)
    qrs = queued_resource_ids(name, num_slices, multislice)
    if only is not None:
        qrs = [qrs[only]]
    out = [[*QUEUED, "delete", qr, *cloud.flags, "--force"] for qr in qrs]
    if not keep_head and only is None:
        out.append([*INSTANCES, "delete", head_vm_name(name), *cloud.flags])
    return out
