"""jax_world's `distributed.*` validation refuses a coordinator port no process can serve:
one past 65535, or 0 (process 0 binds any free port, the others connect to port 0), both
of which the 'host:port' pattern let through to fail (or wait out the initialization
timeout) inside jax.distributed."""

import pytest

from decoupled_diloco import jax_world


@pytest.mark.parametrize("address", ["10.0.0.2:70000", "h:0", "[::1]:99999", "h:00000"])
def test_a_coordinator_port_out_of_range_is_refused_by_name(address):
    config = jax_world.DistributedConfig(coordinator_address=address, num_processes=2)
    with pytest.raises(ValueError, match=r"coordinator_address=.*port must be in \[1, 65535\]"):
        config.validate()


@pytest.mark.parametrize("address", ["10.0.0.2:1", "h:65535", "[::1]:8482"])
def test_a_coordinator_port_in_range_is_taken(address):
    jax_world.DistributedConfig(coordinator_address=address, num_processes=2).validate()
