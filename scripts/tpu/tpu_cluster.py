"""Pure builders of the commands that install the package, start the Ray cluster and launch a
run: the head VM gets a checkout (for configs/) and CPU jax, every TPU VM gets jax[tpu]; Ray's
head runs on the CPU VM and every host of every slice joins it. A single slice can be
installed and (re)joined on its own, without touching the head (and so a running run).
Nothing runs here.
"""

import dataclasses
import json
import posixpath
import shlex

from tpu_provision import Cloud, head_ssh, tpu_ssh
from tpu_slices import SliceSpec, head_vm_name, node_ids, one_slice

VENV = "dd-venv"  # virtualenv in the remote home directory, on the head and every TPU VM
REPO_DIR = "decoupled_diloco"  # checkout on the head VM: the driver's working directory
RAY_PORT = 6379  # Ray's default GCS port
SYNCER_RESOURCE = "syncer"  # custom Ray resource only the head VM has: pins the syncer there
RAY_ADDRESS_KEY = "ray.address"  # config key with which the Ray runtime joins a cluster
# What the launcher sets for a TPU run besides the learner count and the chips per learner.
RAY_ACCELERATOR = "--config.ray.accelerator=tpu"  # one learner per slice, on its TPU chips
CHECKPOINT_KEY = "ray.checkpoint_dir"  # where every actor writes (a path all hosts reach)
# setup.py's extra for TPU hosts and the head: gcsfs (gs:// paths) and sentencepiece.
EXTRA = "tpu"


@dataclasses.dataclass(frozen=True)
class Versions:
    """Pinned on every host. Ray refuses to join nodes whose Ray or Python versions differ (down
    to the Python patch level by default), so Python comes from uv, not from the OS image."""

    python: str = "3.11.13"
    jax: str = "0.10.2"
    ray: str = "2.60.0"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where the package comes from: a git URL (+ ref) or a local wheel copied with scp."""

    git_url: str = ""
    git_ref: str = "main"
    wheel: str = ""
    configs_dir: str = "configs"  # copied to the head along with a wheel

    def __post_init__(self):
        if bool(self.git_url) == bool(self.wheel):
            raise ValueError("give exactly one of --git-url or --wheel")
        if self.wheel and not self.wheel.endswith(".whl"):
            raise ValueError(f"--wheel={self.wheel!r}: expected a .whl file (python -m build)")


def install_script(packages: list[str], versions: Versions) -> str:
    """Shell line: a fresh ~/dd-venv on uv's Python `versions.python` with `packages` in it."""
    uv = "python3 -m uv"
    return (
        f"python3 -m pip install --user --upgrade uv && "
        f"{uv} venv --clear --python {versions.python} {VENV} && "
        f"{uv} pip install --python {VENV}/bin/python {shlex.join(packages)}"
    )


def setup_commands(
    name: str,
    num_slices: int,
    cloud: Cloud,
    source: Source,
    versions: Versions = Versions(),
    only: int | None = None,
) -> list[list[str]]:
    """Install on the head VM (first), then on every host of every slice; `only` = i: on
    every host of slice i alone (a replaced slice), never on the head."""
    nodes = list(enumerate(node_ids(name, num_slices)))
    if only is not None:
        nodes = [(only, one_slice(name, num_slices, only))]
    ray = f"ray[default]=={versions.ray}"
    head: list[list[str]] = []
    package = f"decoupled_diloco[{EXTRA}] @ "  # uv takes a path or URL after the "@"
    if source.wheel:
        wheel = f"./{posixpath.basename(source.wheel)}"
        tpu_pkg = head_pkg = package + wheel
        scp = ["gcloud", "compute", "scp", "--recurse", source.wheel, source.configs_dir]
        head.append([*scp, f"{head_vm_name(name)}:", *cloud.flags])
        head_prep = f"mkdir -p {REPO_DIR} && rm -rf {REPO_DIR}/configs && mv configs {REPO_DIR}/"
    else:
        tpu_pkg = f"{package}git+{source.git_url}@{source.git_ref}"
        head_pkg = f"{package}./{REPO_DIR}"
        url, ref = shlex.quote(source.git_url), shlex.quote(source.git_ref)
        head_prep = (
            f"(test -d {REPO_DIR}/.git || git clone {url} {REPO_DIR}) && "
            f"git -C {REPO_DIR} fetch --quiet origin {ref} && "
            f"git -C {REPO_DIR} checkout --quiet --detach FETCH_HEAD"
        )
    # A fresh VM's unattended upgrades may hold the dpkg lock for a few minutes: wait for it.
    apt_get = "sudo apt-get -o DPkg::Lock::Timeout=600"
    apt = f"{apt_get} update -q && {apt_get} install -yq git python3-pip"
    head_install = install_script([f"jax=={versions.jax}", ray, head_pkg], versions)
    head.append(head_ssh(name, cloud, f"{apt} && {head_prep} && {head_install}"))
    out = head if only is None else []
    tpu_install = install_script([f"jax[tpu]=={versions.jax}", ray, tpu_pkg], versions)
    for i, node in nodes:
        where = cloud.of_slice(i)
        if source.wheel:
            scp = ["gcloud", "compute", "tpus", "tpu-vm", "scp", source.wheel, f"{node}:"]
            out.append([*scp, "--worker=all", *where.flags])
        out.append(tpu_ssh(node, where, tpu_install))
    return out


def _ray_start(flags: str, resources: dict) -> str:
    ray = f"{VENV}/bin/ray"
    res = shlex.quote(json.dumps(resources))
    return f"{ray} stop && {ray} start {flags} --resources={res} --disable-usage-stats"


def ray_head_command(name: str, cloud: Cloud, port: int = RAY_PORT) -> list[str]:
    """(Re)starts the Ray head on the CPU VM, with the resource that pins the syncer there.
    `ray stop` first: on a cluster with a run going, that kills the run."""
    return head_ssh(name, cloud, _ray_start(f"--head --port={port}", {SYNCER_RESOURCE: 1}))


def ray_worker_command(
    node: str, spec: SliceSpec, head_ip: str, cloud: Cloud, port: int = RAY_PORT
) -> list[str]:
    """(Re)joins every host of slice `node` as {"TPU": chips per host, "<node>": 1}: the names
    Ray also auto-detects on TPU VMs, stated so they need no metadata server. A learner asks for
    its slice by `<node>`; Ray adds "TPU-<type>-head" on the slice's worker 0 and the label
    `ray.io/tpu-worker-id` on every host (from the VM metadata) by itself. Touches only this
    slice: its learner's processes die and Ray restarts them there once it has rejoined."""
    resources = {"TPU": spec.chips_per_host, node: 1}
    return tpu_ssh(node, cloud, _ray_start(f"--address={head_ip}:{port}", resources))


def ray_up_commands(
    spec: SliceSpec, name: str, num_slices: int, head_ip: str, cloud: Cloud, port: int = RAY_PORT
) -> list[list[str]]:
    """A fresh cluster: the head, then every slice. Never while a run is going (`join`)."""
    nodes = node_ids(name, num_slices)
    workers = [
        ray_worker_command(node, spec, head_ip, cloud.of_slice(i), port)
        for i, node in enumerate(nodes)
    ]
    return [ray_head_command(name, cloud, port), *workers]


def join_commands(
    spec: SliceSpec,
    name: str,
    num_slices: int,
    index: int,
    head_ip: str,
    cloud: Cloud,
    port: int = RAY_PORT,
) -> list[list[str]]:
    """(Re)joins slice `index` alone to the running cluster; the head is not touched."""
    node = one_slice(name, num_slices, index)
    return [ray_worker_command(node, spec, head_ip, cloud.of_slice(index), port)]


def check_overrides(overrides) -> None:
    """Extra arguments of `launch` may only override config keys."""
    bad = [o for o in overrides if not o.startswith("--config.") or "=" not in o]
    if bad:
        raise ValueError(f"extra arguments must be --config.<key>=<value> overrides, got {bad}")


def config_key(flag: str) -> str:
    """`--config.a.b=v` -> `a.b`."""
    return flag.removeprefix("--config.").split("=", 1)[0]


def check_not_overriding(own: list[str], overrides) -> None:
    """The launcher sets some keys from its own flags (learners from --slices, chips from
    --accelerator, ...); an override of one would come last and win, e.g. 8 learners on 4
    slices. Refused, naming the flag that sets it."""
    mine = {config_key(f): f for f in own if f.startswith("--config.")}
    clash = [o for o in overrides if config_key(o) in mine]
    if clash:
        set_by = ", ".join(mine[config_key(o)] for o in clash)
        raise ValueError(
            f"{', '.join(clash)}: the launcher sets that key itself ({set_by}) from its own "
            "flags (--slices, --accelerator, --head-ip, --ray-port, --checkpoint-dir) or the "
            "step: change those instead"
        )


def check_checkpoint_dir(path: str) -> str:
    """Learners write their checkpoints on their own TPU hosts and the syncer on the head, so
    the directory must be one they all reach: a bucket (gs://...) or an absolute path on a
    filesystem mounted on every VM."""
    if "://" not in path and not posixpath.isabs(path):
        raise ValueError(
            f"--checkpoint-dir={path!r}: give a path every VM reaches, e.g. "
            "gs://BUCKET/checkpoints/RUN (or an absolute path on a shared mount)"
        )
    return path


def main_command(
    config: str,
    workdir: str,
    num_slices: int,
    spec: SliceSpec,
    ray_address: str,
    checkpoint_dir: str,
    overrides: tuple[str, ...] = (),
    python: str = "python",
) -> list[str]:
    """The entry point with M learners, one per slice, each over the slice's `spec.chips`."""
    node_ids("learner", num_slices)  # validates the slice count
    check_checkpoint_dir(checkpoint_dir)
    check_overrides(overrides)
    own = [
        *[python, "-m", "decoupled_diloco.main", f"--config={config}", f"--workdir={workdir}"],
        "--config.runtime=ray",
        RAY_ACCELERATOR,
        f"--config.diloco.learners={num_slices}",
        f"--config.devices_per_learner={spec.chips}",
        f"--config.{RAY_ADDRESS_KEY}={ray_address}",
        f"--config.{CHECKPOINT_KEY}={checkpoint_dir}",
    ]
    check_not_overriding(own, overrides)
    return [*own, *overrides]


def driver_log(name: str) -> str:
    """The driver's log file, in the head VM's home directory."""
    return f"{name}-driver.log"


def launch_command(name: str, cloud: Cloud, main: list[str]) -> list[str]:
    """Starts `main` on the head VM from the checkout, detached from the ssh session."""
    log, pid = driver_log(name), f"{name}-driver.pid"
    # The subshell makes $! the python pid (nohup execs it); `cd` applies to the redirections.
    detached = f"(nohup {shlex.join(main)} > ../{log} 2>&1 < /dev/null & echo $! > ../{pid})"
    return head_ssh(name, cloud, f"cd {REPO_DIR} && {detached} && echo log: ~/{log}")


def status_commands(name: str, cloud: Cloud) -> list[list[str]]:
    """Queued-resource states in every zone in use, then the Ray cluster and the tail of the
    driver log."""
    qr_list = ["gcloud", "compute", "tpus", "queued-resources", "list"]
    lists = [[*qr_list, *Cloud(cloud.project, z).flags] for z in cloud.zones()]
    ray_status = f"{VENV}/bin/ray status; tail -n 20 {driver_log(name)}"
    return [*lists, head_ssh(name, cloud, ray_status)]
