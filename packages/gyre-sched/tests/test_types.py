"""Every wire type round-trips through orjson and rejects malformed input with a ValidationError."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from gyre_sched.types import CellRole, CellTransition, ExecutionEvent, ExecutionSpec, Route, TraceLine

SPEC = {
    "execution_id": "g3.e1",
    "group_id": "g3",
    "query_id": "q3",
    "dispatch_version": 2,
    "dispatch_index": 1,
    "harness_timeout_s": 14400.0,
    "overall_budget_s": 18000.0,
    "engine": "cell:7",
}

GOOD = [
    (ExecutionSpec, SPEC),
    (ExecutionEvent, {"execution_id": "g3.e1", "kind": "launched"}),
    (ExecutionEvent, {"execution_id": "g3.e1", "kind": "terminated", "outcome": "harness_timeout"}),
    (CellTransition, {"cell": 2, "from_role": "rollout", "to_role": "to_training"}),
    (CellTransition, {"cell": 0, "from_role": "training", "to_role": "to_rollout", "phase": "end"}),
    (Route, {"execution_id": "g3.e1", "engine": "standalone", "reason": "reroute"}),
]


@pytest.mark.parametrize(("model", "data"), GOOD)
def test_round_trip(model, data):
    m = model.model_validate(data)
    back = model.model_validate(orjson.loads(m.model_dump_json()))
    assert back == m
    assert back.schema_version == 1


BAD = [
    (ExecutionSpec, {**SPEC, "overall_budget_s": 100.0}),  # overall budget shorter than the harness timeout
    (ExecutionSpec, {**SPEC, "dispatch_version": -1}),
    (ExecutionSpec, {**SPEC, "surprise": 1}),
    (ExecutionSpec, {**SPEC, "execution_id": ""}),
    (ExecutionSpec, {**SPEC, "schema_version": 2}),
    (ExecutionEvent, {"execution_id": "e", "kind": "terminated"}),  # terminated needs an outcome
    (ExecutionEvent, {"execution_id": "e", "kind": "launched", "outcome": "completed"}),
    (ExecutionEvent, {"execution_id": "e", "kind": "terminated", "outcome": "vanished"}),
    (CellTransition, {"cell": 1, "from_role": "rollout", "to_role": "training"}),  # skips TO_TRAINING
    (CellTransition, {"cell": -1, "from_role": "rollout", "to_role": "to_training"}),
    (Route, {"execution_id": "e", "engine": "cell 1"}),
]


@pytest.mark.parametrize(("model", "data"), BAD)
def test_rejects_malformed(model, data):
    with pytest.raises(ValidationError):
        model.model_validate(data)


def test_frozen():
    m = Route(execution_id="e", engine="cell:1")
    with pytest.raises(ValidationError):
        m.engine = "cell:2"


def test_trace_line_requires_event_fields():
    line = TraceLine.model_validate(
        {"t": 1.5, "ev": "terminate", "execution": "g0.e0", "outcome": "completed"}
    )
    assert line.fields() == {"execution": "g0.e0", "outcome": "completed"}
    assert TraceLine.model_validate(orjson.loads(orjson.dumps(line.model_dump()))) == line
    with pytest.raises(ValidationError, match="lacks field"):
        TraceLine.model_validate({"t": 1.0, "ev": "step_end", "version": 3})
    with pytest.raises(ValidationError):
        TraceLine.model_validate({"t": -1.0, "ev": "publish", "version": 1})
    with pytest.raises(ValidationError):
        TraceLine.model_validate({"t": 1.0, "ev": "teleport"})


def test_role_cycle():
    assert [r.value for r in CellRole] == ["rollout", "to_training", "training", "to_rollout", "lost"]


def test_decisions_become_wire_messages():
    from gyre_sched.config import PolicyParams
    from gyre_sched.events import BeginTransition, Reroute, to_wire
    from gyre_sched.policies import make_policy

    pol = make_policy(PolicyParams(kind="elastic", K=2, C_e=2, N=1, B=1, tau_s=0.0, rho_min=1.0))
    specs = [to_wire(d) for d in pol.start(0.0)]
    launches = [m for m in specs if isinstance(m, ExecutionSpec)]
    assert [(m.execution_id, m.engine, m.dispatch_version) for m in launches] == [("g0.e0", "cell:1", 0)]
    for m in launches:
        assert ExecutionSpec.model_validate(orjson.loads(m.model_dump_json())) == m
    route = to_wire(Reroute("g0.e0", "cell:1"))
    assert route == Route(execution_id="g0.e0", engine="cell:1", reason="reroute")
    tr = to_wire(BeginTransition(0, CellRole.ROLLOUT, CellRole.TO_TRAINING))
    assert tr == CellTransition(cell=0, from_role="rollout", to_role="to_training")
