"""Which JAX world (`jax.distributed`) a process joins: always stated explicitly.

A learner is one fault domain, so its processes form a world of their own: the hosts of its
TPU slice and nothing else. Left to itself, `jax.distributed.initialize()` reads the world
from the TPU VM: its worker number and the slice's worker list from the GCE metadata, and,
on slices created as one multislice request, `MEGASCALE_*` (slice id, slice count,
coordinator), from the environment or the metadata's `tpu-env`. The world then spans every
slice: learners would share one fate (one slice's failure stops all of them) and slice s's
hosts would be processes s*h..s*h+h-1, not 0..h-1. So no process here relies on that
detection: the coordinator, the process count and the process id are computed by the
runtime and passed as arguments, with detection switched off, and `MEGASCALE_*` is removed
from the process's environment before the TPU runtime starts (so libtpu does not set up a
cross-slice network either).

- a multi-host Ray learner: its slice's hosts, coordinator on the slice's TPU worker 0
  (`ray/cluster.py slice_coordinator`), process id = TPU worker id;
- the data-parallel baseline over a multi-host slice (runtime "local"): the `distributed.*`
  config keys, which scripts/tpu/launch.py fills per host.

Call `initialize` before anything asks JAX for its devices.
"""

import dataclasses
import os
import re
from collections.abc import MutableMapping

COORDINATOR_PORT = 8482  # the port JAX itself uses for a TPU slice's coordinator
MEGASCALE_PREFIX = "MEGASCALE_"  # env vars of a multislice request (cross-slice DCN world)
_ADDRESS = re.compile(r"[^\s:/]+:\d{1,5}|\[[0-9a-fA-F:]+\]:\d{1,5}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The `distributed.*` section: one multi-host JAX world for a run of runtime "local" (the
    data-parallel baseline over a multi-host TPU slice). Every process of the world runs the
    same command with its own `process_id`."""

    coordinator_address: str = ""  # "host:port" of process 0; "" = a single process (default)
    num_processes: int = 1  # processes (hosts) in the world; 1 = no jax.distributed
    process_id: int = 0  # this process's index in [0, num_processes); TPU: the worker id
    initialization_timeout: int = 300  # seconds to wait for every process to connect

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    def validate(self) -> None:
        if self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"distributed.process_id must be in [0, {self.num_processes - 1}] "
                f"(distributed.num_processes={self.num_processes}), got {self.process_id}"
            )
        if self.enabled and not _ADDRESS.fullmatch(self.coordinator_address):
            raise ValueError(
                "distributed.num_processes > 1 needs distributed.coordinator_address = "
                f"'host:port' of process 0, got {self.coordinator_address!r}"
            )
        port = int(self.coordinator_address.rsplit(":", 1)[1]) if self.enabled else 1
        if not 1 <= port <= 65535:  # the pattern takes 5 digits; 0 would bind anywhere
            raise ValueError(
                f"distributed.coordinator_address={self.coordinator_address!r}: the port must "
                "be in [1, 65535] (the other processes connect to it; they would wait "
                f"distributed.initialization_timeout={self.initialization_timeout} s)"
            )
        if not self.enabled and self.coordinator_address:
            raise ValueError(
                f"distributed.coordinator_address={self.coordinator_address!r} is set but "
                "distributed.num_processes is 1: set the number of processes of the world"
            )
        if self.initialization_timeout < 1:
            raise ValueError(
                "distributed.initialization_timeout must be >= 1 s, got "
                f"{self.initialization_timeout}"
            )

    def world(self) -> "World":
        return World(self.coordinator_address, self.num_processes, self.process_id)


@dataclasses.dataclass(frozen=True)
class World:
    """One JAX world: `num_processes` processes, this one `process_id`, process 0 serving the
    coordinator at `coordinator_address` ("host:port")."""

    coordinator_address: str
    num_processes: int
    process_id: int

    def initialize_kwargs(self, timeout_s: int = 300) -> dict:
        """Arguments of `jax.distributed.initialize`: all explicit, detection off."""
        return dict(
            coordinator_address=self.coordinator_address,
            num_processes=self.num_processes,
            process_id=self.process_id,
            cluster_detection_method="deactivate",
            initialization_timeout=timeout_s,
        )


SINGLE = World("", 1, 0)  # a process alone: no jax.distributed


def slice_world(coordinator_host: str, hosts: int, host: int, port: int = COORDINATOR_PORT):
    """The world of one slice of `hosts` hosts seen from its host `host` (= TPU worker id):
    coordinator on the slice's worker 0, whatever slice or multislice it belongs to."""
    if hosts == 1 and host == 0:
        return SINGLE
    if hosts < 1 or not 0 <= host < hosts:
        raise ValueError(f"host {host} of a slice of {hosts} hosts: need 0 <= host < hosts")
    if not coordinator_host:
        raise ValueError("no address for the slice's TPU worker 0 (the JAX coordinator)")
    return World(f"{coordinator_host}:{port}", hosts, host)


def scrub_megascale(env: MutableMapping[str, str]) -> list[str]:
    """Removes the multislice variables from `env`; returns the names removed."""
    names = sorted(k for k in env if k.startswith(MEGASCALE_PREFIX))
    for k in names:
        del env[k]
    return names


def initialize(world: World, timeout_s: int = 300, init=None) -> None:
    """Removes `MEGASCALE_*` from this process's environment (a single-host slice of a
    multislice request must not join the others either), then joins `world` (nothing more for
    a single process). `init` replaces `jax.distributed.initialize` in tests. Raises when JAX
    ends up in another world."""
    scrub_megascale(os.environ)
    if world.num_processes == 1:
        return
    import jax

    (init or jax.distributed.initialize)(**world.initialize_kwargs(timeout_s))
    if init is None:
        check(world, jax.process_count(), jax.process_index())


def check(world: World, process_count: int, process_index: int) -> None:
    """The world JAX reports must be the one asked for (fate sharing stays inside it)."""
    if (process_count, process_index) != (world.num_processes, world.process_id):
        raise RuntimeError(
            f"jax.distributed joined a world of {process_count} processes as process "
            f"{process_index}; expected {world.num_processes} processes, this one "
            f"{world.process_id} (coordinator {world.coordinator_address})"
        )
