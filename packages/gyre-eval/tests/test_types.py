"""Every wire type round-trips through orjson and rejects malformed input with a ValidationError."""

import orjson
import pytest
from pydantic import ValidationError

from gyre_eval.types import (
    Assessment,
    AttemptRecord,
    ErrorBody,
    ExecutionReport,
    GroupStatus,
    MemberReward,
    Provenance,
    Submission,
)

SUB = dict(
    execution_id="e1",
    group_id="g1",
    group_size=4,
    dispatch_index=0,
    artifact_ref="/tmp/ws",
    launched_at=1000.0,
    budget_s=60.0,
)
PROV = Provenance(evaluator="task", kind="exec", critique="fine", details={"returncode": 0})


def _assessment(**kw):
    base = dict(
        id="a-1",
        execution_id="e1",
        group_id="g1",
        dispatch_index=0,
        artifact_ref="/tmp/ws",
        artifact_version="final",
        branch="main",
        evaluator="task",
        designated=True,
        status="valid",
        score=0.0,
        final=True,
        attempts=1,
        provenance=PROV,
        submitted_at=1.0,
        deadline=61.0,
        resolved_at=2.0,
    )
    base.update(kw)
    return Assessment(**base)


def _roundtrip(model):
    again = type(model).model_validate(orjson.loads(model.model_dump_json()))
    assert again == model
    return again


def test_every_wire_type_round_trips():
    sub = Submission(**SUB, task={"prompt": "build it"}, outcome="harness_timeout")
    assert _roundtrip(sub).deadline == 1060.0
    a = _roundtrip(_assessment())
    assert a.score == 0.0 and a.status == "valid" and not a.excluded
    _roundtrip(_assessment(status="unresolved", score=None, final=False, resolved_at=None))
    assert _roundtrip(_assessment(status="unresolved", score=None, final=True)).excluded
    _roundtrip(_assessment(status="no_work", score=0.0))
    _roundtrip(PROV)
    _roundtrip(
        AttemptRecord(
            assessment_id="a-1", number=1, started_at=1.0, finished_at=2.0, ok=False, score=None, error="boom"
        )
    )
    member = MemberReward(execution_id="e1", dispatch_index=0, status="valid", reward=1.0, advantage=0.5)
    _roundtrip(
        GroupStatus(
            group_id="g1",
            size=1,
            dispatched=1,
            state="ready",
            valid=1,
            excluded=0,
            pending=0,
            members=[member],
        )
    )
    _roundtrip(
        ExecutionReport(
            execution_id="e1",
            status="valid",
            reward=0.0,
            excluded=False,
            designated=_assessment(),
            history=[_assessment()],
        )
    )
    _roundtrip(ErrorBody(error="invalid_request", message="x"))


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"group_size": 0}, "group_size"),
        ({"dispatch_index": 4}, "out of range"),
        ({"group_dispatched": 2}, "must be >= group_size"),
        ({"execution_id": ""}, "execution_id"),
        ({"execution_id": "bad id with spaces"}, "execution_id"),
        ({"budget_s": -1}, "budget_s"),
        ({"outcome": "exploded"}, "outcome"),
        ({"no_work_reason": "image pull failed"}, "no artifact_ref"),
        ({"api_key": "sk-execution-token"}, "api_key"),  # extra fields (e.g. a credential) are refused
        ({"schema_version": 2}, "schema_version"),
    ],
)
def test_submission_rejects_malformed_input(change, needle):
    with pytest.raises(ValidationError) as info:
        Submission(**{**SUB, **change})
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"status": "unresolved", "score": 0.0}, "never a zero"),
        ({"status": "valid", "score": None}, "finite score"),
        ({"status": "valid", "score": float("nan")}, "finite score"),
        ({"status": "no_work", "score": 1.0}, "0.0"),
        ({"status": "valid", "final": False}, "final"),
        ({"status": "pending"}, "status"),
    ],
)
def test_assessment_rejects_impossible_states(change, needle):
    with pytest.raises(ValidationError) as info:
        _assessment(**change)
    assert needle in str(info.value)


def test_wire_types_are_frozen():
    a = _assessment()
    with pytest.raises(ValidationError):
        a.score = 1.0
