"""A learner spread over several hosts reads its batch per host: each host's devices must
hold their own, equally many rows. A mesh whose tensor axis runs across hosts (or a batch not
divisible by the hosts) failed only on the cluster, at the first batch, inside the prefetch
thread (a restart, three times over for a Ray learner); `--check_config --check_hosts=N`
(what scripts/tpu runs before it starts anything) and a Ray learner's start-up refuse it."""

import itertools
import types

import jax
import pytest

from decoupled_diloco import preflight, sharding, transfer


def _run(mesh: sharding.MeshConfig, per: int, batch: int):
    return types.SimpleNamespace(devices_per_learner=per, mesh=mesh,
                                 train=types.SimpleNamespace(batch_size=batch))  # fmt: skip


class _OnHosts:
    """A real sharding over this process's CPU devices, its devices reported as on
    `hosts` hosts (consecutive ids on one host), as a slice's are."""

    def __init__(self, real, hosts: int):
        self.real, self.per_host = real, len(real.mesh.devices.flat) // hosts

    def devices_indices_map(self, shape):
        return {
            _Device(d.id, d.id // self.per_host): index
            for d, index in self.real.devices_indices_map(shape).items()
        }


class _Device(tuple):
    """(id, process_index): hashable, as a device is."""

    def __new__(cls, id_: int, process_index: int):
        return super().__new__(cls, (id_, process_index))

    @property
    def process_index(self) -> int:
        return self[1]


def _meshes(n: int):
    for d, f, t in itertools.product((1, 2, 4, 8), repeat=3):
        for e in (1, 2):
            if d * f * t * e == n:
                yield sharding.MeshConfig(data=d, fsdp=f, tensor=t, expert=e)


def test_a_tensor_axis_across_hosts_is_refused_before_the_run():
    # v5litepod-32: 8 hosts of 4 chips. tensor 8 spans two hosts; tensor 4 stays on one.
    across = _run(sharding.MeshConfig(data=1, fsdp=4, tensor=8), per=32, batch=64)
    with pytest.raises(ValueError, match="does not split the batch rows evenly .* 8 hosts"):
        preflight.check_hosts(across, 8)
    preflight.check_hosts(across, 1)  # one host holds every row: nothing to split
    preflight.check_hosts(_run(sharding.MeshConfig(data=1, fsdp=8, tensor=4), 32, 64), 8)
    with pytest.raises(ValueError, match="batch_size=4 must be a multiple of the learner's 8"):
        preflight.check_hosts(_run(sharding.MeshConfig(data=1, fsdp=8, tensor=4), 32, 4), 8)
    with pytest.raises(ValueError, match="devices_per_learner=32 cannot be split over 3"):
        preflight.check_hosts(across, 3)


@pytest.mark.parametrize("hosts", [2, 4, 8])
def test_the_check_before_the_run_agrees_with_the_learners_own(hosts):
    """For every mesh of 8 devices: the pre-run check (hosts modelled as consecutive
    devices) refuses exactly what the learner's check of its real batch sharding refuses."""
    devices = jax.devices()[:8]
    seen = set()
    for mesh_cfg in _meshes(8):
        batch = 16
        real = _OnHosts(sharding.batch_sharding(sharding.make_mesh(devices, mesh_cfg)), hosts)
        try:
            transfer.check_batch_split(real, batch)
            learner_ok = True
        except ValueError:
            learner_ok = False
        try:
            preflight.check_hosts(_run(mesh_cfg, 8, batch), hosts)
            model_ok = True
        except ValueError:
            model_ok = False
        assert model_ok == learner_ok, (mesh_cfg, hosts)
        seen.add(learner_ok)
    assert seen == {True, False}  # both kinds of mesh were checked
