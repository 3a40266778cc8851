"""Pure builders of the commands that launch the data-parallel baseline on one TPU slice: the
paper's central comparison (Decoupled DiLoCo vs. plain DP at equal tokens) on TPU.

No Ray and no syncer: every host of the slice runs the same entry point with the local
runtime and one learner over every chip of the slice. On a multi-host slice the hosts form
one JAX world with explicit arguments (decoupled_diloco/jax_world.py): process id =
TPU worker id (one `ssh --worker=<w>` each), coordinator on worker 0's internal IP. The config
file is copied to every host (TPU hosts have the package, not the repository's configs/).
Nothing runs here.
"""

import posixpath
import shlex

from tpu_cluster import VENV, check_not_overriding, check_overrides
from tpu_provision import TPU_VM, Cloud
from tpu_slices import SliceSpec, one_slice

COORDINATOR_PORT = 8482  # = decoupled_diloco.jax_world.COORDINATOR_PORT
WORKER0_IP_PLACEHOLDER = "WORKER0_IP"


def check_workdir(path: str) -> str:
    """Every host checkpoints into <workdir>/checkpoints: one path all of them reach."""
    if "://" not in path and not posixpath.isabs(path):
        raise ValueError(
            f"--workdir={path!r}: give a path every host of the slice reaches, e.g. "
            "gs://BUCKET/runs/RUN (or an absolute path on a shared mount)"
        )
    return path


def worker0_ip_command(node: str, cloud: Cloud) -> list[str]:
    """Prints the internal IP of TPU worker 0 of slice `node` (the JAX coordinator)."""
    fmt = "--format=value(networkEndpoints[0].ipAddress)"
    return [*TPU_VM, "describe", node, *cloud.flags, fmt]


def dp_main_command(
    config: str,
    workdir: str,
    spec: SliceSpec,
    worker: int,
    worker0_ip: str,
    overrides: tuple[str, ...] = (),
    python: str = f"{VENV}/bin/python",
) -> list[str]:
    """The entry point on TPU worker `worker`: DP over all `spec.chips` chips of the slice."""
    check_workdir(workdir)
    check_overrides(overrides)
    path, _, arg = config.partition(":")
    remote_config = posixpath.basename(path) + (f":{arg}" if arg else "")
    cmd = [
        *[python, "-m", "decoupled_diloco.main", f"--config={remote_config}"],
        f"--workdir={workdir}",
        "--config.runtime=local",
        "--config.diloco.learners=1",
        "--config.diloco.sync_every=0",  # no syncer: plain data-parallel training
        "--config.devices_per_learner=0",  # every chip of the slice (of the world)
    ]
    if spec.hosts > 1:
        cmd += [
            f"--config.distributed.coordinator_address={worker0_ip}:{COORDINATOR_PORT}",
            f"--config.distributed.num_processes={spec.hosts}",
            f"--config.distributed.process_id={worker}",
        ]
    check_not_overriding(cmd, overrides)
    return [*cmd, *overrides]


def dp_log(name: str, worker: int) -> str:
    return f"{name}-dp-{worker}.log"


def dp_commands(
    spec: SliceSpec,
    name: str,
    num_slices: int,
    index: int,
    config: str,
    workdir: str,
    worker0_ip: str,
    cloud: Cloud,
    overrides: tuple[str, ...] = (),
) -> list[list[str]]:
    """Copies the config file to every host of slice `index`, then starts the entry point on
    each host, detached (log: ~/<name>-dp-<worker>.log on that host)."""
    node = one_slice(name, num_slices, index)
    where = cloud.of_slice(index)
    path = config.partition(":")[0]
    scp = [*TPU_VM, "scp", path, f"{node}:", "--worker=all", *where.flags]
    out = [scp]
    for w in range(spec.hosts):
        main = dp_main_command(config, workdir, spec, w, worker0_ip, overrides)
        log = dp_log(name, w)
        detached = f"(nohup {shlex.join(main)} > {log} 2>&1 < /dev/null &) && echo log: ~/{log}"
        out.append([*TPU_VM, "ssh", node, f"--worker={w}", *where.flags, f"--command={detached}"])
    return out
