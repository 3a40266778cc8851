"""The Ray cluster a run uses: connect or start one, and where learners and the syncer go.

Placement (pure functions, testable without a cluster):
- CPU (`ray.accelerator = "cpu"`, development and CI): every learner is a process with its
  own fake CPU devices (`--xla_force_host_platform_device_count=<devices_per_learner>`).
- TPU (`"tpu"`): learner m is the slice whose hosts carry the custom resource named by the
  m-th slice id (scripts/tpu registers `{"TPU": chips per host, "<node-id>": 1}` on every
  host); a slice of h hosts is h processes running the same program (multi-controller JAX:
  when h > 1 a world of this slice's hosts alone, jax_world.py), each asking for one
  host's `{"TPU": chips, "<node-id>": 1}`. Process `host` of a multi-host learner is pinned
  to TPU worker `host` with the node label `ray.io/tpu-worker-id` (Ray sets it from the TPU
  VM metadata), because JAX numbers a slice's processes by TPU worker id too: host 0, the
  one that owns the learner's link to the syncer, is then JAX process 0, the one
  `SliceLink` broadcasts from.
- The syncer goes where the custom resource `syncer` is (the head CPU VM) when the cluster
  has it; anywhere otherwise.

Importing this module does not import Ray; the runtime imports it lazily.
"""

import contextlib
import os
import re
import sys
import time
import warnings

from decoupled_diloco.config import RayConfig
from decoupled_diloco.preflight import FatalRunError

WORKER_ID_LABEL = "ray.io/tpu-worker-id"  # Ray's node label: a TPU VM's worker index
SYNCER_RESOURCE = "syncer"  # the custom resource scripts/tpu puts on the head VM
_STANDARD = {"CPU", "GPU", "TPU", "memory", "object_store_memory", SYNCER_RESOURCE}
LOOPBACK = "127.0.0.1"  # where a single-host cluster listens
_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray may bind the loopback address
START_WAITS_S = (5.0, 15.0)  # seconds before the 2nd and 3rd attempt to start Ray


def connect(
    cfg: RayConfig, verbose: bool, init=None, sleep=time.sleep, waits_s=START_WAITS_S
) -> bool:
    """Connects the driver; returns True when it started a local cluster it must stop.

    An already connected driver (e.g. a test session's shared cluster) is reused as is. A
    start that fails (on a loaded host Ray's 30 s limit for its node to register, fixed in
    Ray's code, can pass) is retried after each of `waits_s` seconds, with a line on stderr
    each time; then `FatalRunError` says what to do. `init` replaces `ray.init` in tests.
    """
    import ray

    if ray.is_initialized():
        return False
    kw = init_kwargs(cfg, verbose)
    if not cfg.address:
        os.makedirs(cfg.temp_dir, exist_ok=True)
    init = init or ray.init
    attempts = len(waits_s) + 1
    for attempt in range(1, attempts + 1):
        try:
            with warnings.catch_warnings(), _loopback_only(not cfg.address), _sigterm_kept():
                # Ray starts its daemons with fork+exec, which JAX (already up in the driver)
                # warns about; the children exec at once and never run JAX.
                warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
                init(**kw)
            return not cfg.address
        except Exception as e:  # Ray raises plain Exception, RuntimeError, ConnectionError...
            why = _one_line(e)
            if ray.is_initialized():
                ray.shutdown()  # whatever half started goes before the next attempt
        if attempt < attempts:
            wait = waits_s[attempt - 1]
            print(
                f"Ray did not start (attempt {attempt}/{attempts}): {why}; retrying in "
                f"{wait:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            sleep(wait)
    where = (
        f"the cluster at ray.address={cfg.address!r}"
        if cfg.address
        else f"a local cluster (logs: {cfg.temp_dir}/session_latest/logs)"
    )
    raise FatalRunError(
        f"Ray did not start after {attempts} attempts ({where}); last error: {why}. On a "
        "loaded host free CPU and memory, or start a cluster first (`ray start --head`) and "
        "pass --config.ray.address"
    )


def init_kwargs(cfg: RayConfig, verbose: bool) -> dict:
    """`ray.init` arguments: join `ray.address`, or start a cluster of this one host that
    listens on the loopback interface only, with no dashboard and without the per-node
    Prometheus metrics exporter (it has no authentication)."""
    kw = dict(include_dashboard=False, log_to_driver=verbose, configure_logging=verbose)
    if cfg.address:
        return dict(address=cfg.address, **kw)
    return dict(
        num_cpus=cfg.num_cpus or os.cpu_count(),
        _temp_dir=cfg.temp_dir,
        _node_ip_address=LOOPBACK,
        _system_config={"enable_metrics_collection": False},
        **kw,
    )


@contextlib.contextmanager
def _sigterm_kept():
    """`ray.init` makes a SIGTERM exit the driver at once (its handler calls sys.exit, and
    its core worker's logs the signal first): the run's own, which stops it as a Ctrl-C
    does (cli.STOP_SIGNALS), is put back. Main thread only (elsewhere Ray sets none)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


@contextlib.contextmanager
def _loopback_only(enabled: bool):
    """While Ray starts a single-host cluster: let it bind 127.0.0.1. On Linux `ray.init`
    replaces a loopback `_node_ip_address` by the host's outward address unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which its daemons read from the environment and
    the driver's `ray_constants` read when Ray was imported (so both are set here)."""
    if not enabled:
        yield
        return
    from ray._private import ray_constants

    old_env = os.environ.get(_LOCAL_ONLY_ENV)
    old_flag = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[_LOCAL_ONLY_ENV] = "0"
    if old_flag is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop(_LOCAL_ONLY_ENV, None)
        else:
            os.environ[_LOCAL_ONLY_ENV] = old_env
        if old_flag is not None:
            ray_constants.ENABLE_RAY_CLUSTER = old_flag


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


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
    numbers by value, so learner m gets the m-th slice (`dd-2` before `dd-10`). The hosts of
    a multi-host slice must carry the worker ids 0..h-1 (`WORKER_ID_LABEL`): learner
    processes are pinned to them.
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
    return dict(sorted(out.items(), key=lambda item: _natural(item[0])))


def _natural(slice_id: str) -> list:
    """A sort key that orders the numbers inside names by value: dd-2 before dd-10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", slice_id)]


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
    hosts = {layout["slice"]: layout["hosts"] for layout in out}
    if len(set(hosts.values())) > 1:
        # Each host of a learner reads a sub-shard of its learner's shard (data/pipeline.py):
        # learners with other host counts would cut the windows differently and overlap.
        raise ValueError(
            f"the learners' TPU slices span different numbers of hosts ({hosts}): every "
            "learner's slice must have as many hosts (the same topology)"
        )
    return out


def slice_coordinator(nodes: list[dict], slice_id: str) -> str | None:
    """The address of TPU worker 0 of slice `slice_id` in `ray.nodes()`: the coordinator of
    the slice's own JAX world (jax_world.py); None while that host has not joined.
    Looked up by each learner process when it starts, so a replaced slice's new VMs count."""
    for node in nodes:
        res, labels = node.get("Resources", {}), node.get("Labels", {})
        on_slice = node.get("Alive", True) and res.get(slice_id, 0) > 0
        if on_slice and str(labels.get(WORKER_ID_LABEL)) == "0":
            return node.get("NodeManagerAddress")
    return None
