"""The Ray cluster a run uses: connect or start one, and where learners and the syncer go.

Placement (pure functions, testable without a cluster):
- CPU (`ray.accelerator = "cpu"`, development and CI): every learner is a process with its
  own fake CPU devices (`--xla_force_host_platform_device_count=<devices_per_learner>`).
- TPU (`"tpu"`): learner m is the slice whose hosts carry the custom resource named by the
  m-th slice id (scripts/tpu registers `{"TPU": chips per host, "<node-id>": 1}` on every
  host); a slice of h hosts is h processes running the same program (multi-controller JAX,
  `jax.distributed.initialize()` inside the slice only when h > 1), each asking for one
  host's `{"TPU": chips, "<node-id>": 1}`. Process `host` of a multi-host learner is pinned
  to TPU worker `host` with the node label `ray.io/tpu-worker-id` (Ray sets it from the TPU
  VM metadata), because JAX numbers a slice's processes by TPU worker id too: host 0, the
  one that owns the learner's link to the syncer, is then JAX process 0, the one
  `SliceLink` broadcasts from.
- The syncer goes where the custom resource `syncer` is (the head CPU VM) when the cluster
  has it; anywhere otherwise.

Importing this module does not import Ray; the runtime imports it lazily.
"""

import os
import warnings

from decoupled_diloco.config import RayConfig

WORKER_ID_LABEL = "ray.io/tpu-worker-id"  # Ray's node label: a TPU VM's worker index
SYNCER_RESOURCE = "syncer"  # the custom resource scripts/tpu puts on the head VM
_STANDARD = {"CPU", "GPU", "TPU", "memory", "object_store_memory", SYNCER_RESOURCE}


def connect(cfg: RayConfig, verbose: bool) -> bool:
    """Connects the driver; returns True when it started a local cluster it must stop.

    An already connected driver (e.g. a test session's shared cluster) is reused as is.
    """
    import ray

    if ray.is_initialized():
        return False
    kw = dict(include_dashboard=False, log_to_driver=verbose, configure_logging=verbose)
    with warnings.catch_warnings():
        # Ray starts its daemons with fork+exec, which JAX (already up in the driver) warns
        # about; the children exec at once and never run JAX.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
        if cfg.address:
            ray.init(address=cfg.address, **kw)
            return False
        os.makedirs(cfg.temp_dir, exist_ok=True)
        ray.init(num_cpus=cfg.num_cpus or os.cpu_count(), _temp_dir=cfg.temp_dir, **kw)
    return True


def cpu_env(devices_per_learner: int) -> dict[str, str]:
    """Environment of a CPU learner process: exactly its own fake devices, no accelerator."""
    return {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_learner}",
        "JAX_PLATFORMS": "cpu",
        **_cache_env(),
    }


def _cache_env() -> dict[str, str]:
    # Learner processes share the driver's persistent compilation cache (when it set one).
    cache = os.environ.get("DD_COMPILATION_CACHE")
    return {"DD_COMPILATION_CACHE": cache} if cache else {}


def syncer_options(cluster_resources: dict, shards: int, max_restarts: int) -> dict:
    """Actor options of a syncer shard: host CPU only, on the `syncer` node if there is one."""
    opts = dict(
        num_cpus=0,
        max_restarts=max_restarts,
        max_task_retries=0,
        max_concurrency=8,
        runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", **_cache_env()}},
    )
    if cluster_resources.get(SYNCER_RESOURCE, 0) > 0:
        opts["resources"] = {SYNCER_RESOURCE: cluster_resources[SYNCER_RESOURCE] / shards}
    return opts


def learner_options(
    accelerator: str,
    devices_per_learner: int,
    max_restarts: int,
    layout: dict | None = None,
    host: int = 0,
) -> dict:
    """Actor options of process `host` of one learner; `layout` = {"slice": id, "hosts": h,
    "chips": per host} on TPU (`learner_hosts`)."""
    opts = dict(max_restarts=max_restarts, max_task_retries=0, max_concurrency=8)
    if accelerator == "cpu":
        opts.update(num_cpus=0, runtime_env={"env_vars": cpu_env(devices_per_learner)})
    else:
        opts.update(
            num_cpus=0,
            resources={"TPU": layout["chips"], layout["slice"]: 1},
            runtime_env={"env_vars": _cache_env()},
        )
        if layout["hosts"] > 1:  # host h on TPU worker h = JAX process h (also on a restart)
            opts["label_selector"] = {WORKER_ID_LABEL: str(host)}
    return opts


def tpu_slices(nodes: list[dict]) -> dict[str, dict]:
    """Slices of a cluster from `ray.nodes()`: slice id -> {"hosts": h, "chips": per host}.

    A TPU host's slice id is its one custom resource besides the standard ones, Ray's
    per-node `node:<ip>` / `accelerator_type:*` and the `TPU-*-head` marker. Sorted by id,
    so learner m gets the m-th slice. The hosts of a multi-host slice must carry the worker
    ids 0..h-1 (`WORKER_ID_LABEL`): learner processes are pinned to them.
    """
    out: dict[str, dict] = {}
    workers: dict[str, list] = {}
    for node in nodes:
        res = node.get("Resources", {})
        if not node.get("Alive", True) or res.get("TPU", 0) <= 0:
            continue
        ids = [
            k
            for k in res
            if k not in _STANDARD
            and not k.startswith(("node:", "accelerator_type:"))
            and not (k.startswith("TPU-") and k.endswith("-head"))
        ]
        if len(ids) != 1:
            raise ValueError(f"TPU host {node.get('NodeManagerAddress')} has slice ids {ids}")
        entry = out.setdefault(ids[0], {"hosts": 0, "chips": int(res["TPU"])})
        entry["hosts"] += 1
        workers.setdefault(ids[0], []).append(node.get("Labels", {}).get(WORKER_ID_LABEL))
    for slice_id, entry in out.items():
        found = sorted(map(str, workers[slice_id]))
        if entry["hosts"] > 1 and found != sorted(map(str, range(entry["hosts"]))):
            raise ValueError(
                f"TPU slice {slice_id}: its {entry['hosts']} hosts have {WORKER_ID_LABEL} "
                f"labels {found}, expected 0..{entry['hosts'] - 1} (Ray reads them from the "
                "TPU VM metadata; a slice whose hosts have not all joined is incomplete)"
            )
    return dict(sorted(out.items()))


def learner_hosts(slices: dict[str, dict], num_learners: int, chips: int) -> list[dict]:
    """Learner m's slice and host layout; ValueError when the cluster has too few slices or
    the first M slices do not have `chips` chips each (devices_per_learner)."""
    if len(slices) < num_learners:
        raise ValueError(
            f"diloco.learners={num_learners} but the Ray cluster has {len(slices)} TPU slices "
            f"({sorted(slices)}): one learner per slice"
        )
    out = [{"slice": s, **slices[s]} for s in list(slices)[:num_learners]]
    for layout in out:
        if layout["hosts"] * layout["chips"] != chips:
            raise ValueError(
                f"TPU slice {layout['slice']} has {layout['hosts']} hosts x {layout['chips']} "
                f"chips in the Ray cluster, devices_per_learner is {chips}: have all its "
                "hosts joined?"
            )
    return out
