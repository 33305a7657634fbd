"""gyre_sched: boundary dispatch, the elastic cell policy with Async/Colocate baselines, and a simulator that runs
the same policy objects. No torch, no I/O in the policy core."""

from gyre_sched.config import PolicyParams, SimConfig
from gyre_sched.errors import InvariantError
from gyre_sched.ledger import CarriedGroup
from gyre_sched.policies import AsyncPolicy, ColocatePolicy, ElasticPolicy, make_policy
from gyre_sched.policy import PolicyCore
from gyre_sched.sim import SimResult, Simulator
from gyre_sched.trace import TraceWriter, read_trace, summarize_trace

__all__ = [
    "AsyncPolicy",
    "CarriedGroup",
    "ColocatePolicy",
    "ElasticPolicy",
    "InvariantError",
    "PolicyCore",
    "PolicyParams",
    "SimConfig",
    "SimResult",
    "Simulator",
    "TraceWriter",
    "make_policy",
    "read_trace",
    "summarize_trace",
]
