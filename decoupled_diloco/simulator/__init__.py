"""Goodput simulator for DP, elastic DP and Decoupled DiLoCo at 10^5-10^7 chips.

`simulate(method, chips, learners, SimParams(...), fault_spec=None)`; the command line is
`python -m decoupled_diloco.simulate`. Parameters and their reasoning: `params.py`;
traces: `trace.py`; recovery policies: `timeline.py`; accounting: `core.py`.
"""

from decoupled_diloco.simulator.core import SimResult, simulate
from decoupled_diloco.simulator.params import METHODS, SimParams, validate_sim_params

__all__ = ["METHODS", "SimParams", "SimResult", "simulate", "validate_sim_params"]
