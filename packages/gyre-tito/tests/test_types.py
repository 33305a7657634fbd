"""Every gyre-tito wire type round-trips through orjson and rejects malformed input with a ValidationError."""

from __future__ import annotations

import orjson
import pytest
from pydantic import BaseModel, ValidationError

from gyre_tito.testing.synthetic import make_record
from gyre_tito.types import (
    CallRecord,
    OutputSegment,
    Timings,
    Trajectory,
    WeightSpan,
    mask_from_runs,
    runs_from_mask,
)


def _record() -> CallRecord:
    return CallRecord(
        execution_id="ex",
        call_id="c1",
        seq=3,
        parent_id="c0",
        input_ids=[5, 6, 7, 8],
        input_provenance=[("external", 2), ("policy", 1), ("external", 1)],
        output_ids=[9, 10, 11],
        output_logprobs=[-0.5, -0.25, -1e-7],
        output_segments=[
            OutputSegment(engine_id="e0", weight_version="3", start=0, end=2),
            OutputSegment(engine_id="e1", weight_version="4", start=2, end=3),
        ],
        agent_id="main",
        role_class="main/task",
        call_kind="task",
        finish_reason="tool_use",
        timings=Timings(request_at=1.0, first_token_at=1.5, end_at=2.0),
        metadata={"model": "m", "n": [1, 2]},
    )


def _trajectory() -> Trajectory:
    return Trajectory(
        execution_id="ex",
        group_id="g",
        index=0,
        leaf_call_id="c1",
        agent_id="main",
        role_class="main/task",
        token_ids=[1, 2, 3, 4],
        target_mask=[0, 0, 1, 1],
        behavior_logprobs=[0.0, 0.0, -0.3, -0.125],
        weight_versions=[WeightSpan(start=2, end=4, engine_id="e0", weight_version="3")],
    )


WIRE: list[BaseModel] = [
    _record(),
    _trajectory(),
    Trajectory(
        execution_id="ex",
        group_id="g",
        index=0,
        leaf_call_id=None,
        role_class="main/task",
        token_ids=[],
        target_mask=[],
        behavior_logprobs=[],
        weight_versions=[],
        placeholder=True,
    ),
    OutputSegment(engine_id="e", weight_version="v", start=0, end=1),
    Timings(request_at=0.0, end_at=0.0),
    WeightSpan(start=0, end=1, engine_id="e", weight_version="v"),
]


@pytest.mark.parametrize("msg", WIRE, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    again = type(msg).model_validate(orjson.loads(msg.model_dump_json()))
    assert again == msg
    assert again.schema_version == 1
    with pytest.raises(ValidationError, match="frozen"):
        msg.schema_version = 2  # type: ignore[misc]


@pytest.mark.parametrize("msg", WIRE, ids=lambda m: type(m).__name__)
def test_rejects_unknown_fields_and_wrong_version(msg):
    data = orjson.loads(msg.model_dump_json())
    with pytest.raises(ValidationError, match="extra"):
        type(msg).model_validate({**data, "surprise": 1})
    with pytest.raises(ValidationError, match="schema_version"):
        type(msg).model_validate({**data, "schema_version": 2})


BAD_RECORDS = {
    "provenance short": {"input_provenance": [("external", 3)]},
    "provenance zero run": {"input_provenance": [("external", 4), ("policy", 0)]},
    "provenance bad source": {"input_provenance": [("engine", 4)]},
    "logprobs misaligned": {"output_logprobs": [-0.1]},
    "logprob nan": {"output_logprobs": [-0.1, float("nan"), -0.2]},
    "segments gap": {"output_segments": [{"engine_id": "e", "weight_version": "v", "start": 1, "end": 3}]},
    "segments short": {"output_segments": [{"engine_id": "e", "weight_version": "v", "start": 0, "end": 2}]},
    "negative token": {"input_ids": [5, -6, 7, 8]},
    "token not int": {"output_ids": [9, "x", 11]},
    "role": {"role_class": "main/other"},
    "self parent": {"parent_id": "c1"},
    "missing field": {"agent_id": None},
    "timings reversed": {"timings": {"request_at": 2.0, "end_at": 1.0}},
}


@pytest.mark.parametrize("change", list(BAD_RECORDS.values()), ids=list(BAD_RECORDS))
def test_call_record_rejects_malformed(change):
    data = {**orjson.loads(_record().model_dump_json()), **change}
    with pytest.raises(ValidationError):
        CallRecord.model_validate(data)


BAD_TRAJECTORIES = {
    "mask length": {"target_mask": [0, 1, 1]},
    "mask value": {"target_mask": [0, 0, 2, 1]},
    "logprob on non-target": {"behavior_logprobs": [-0.1, 0.0, -0.3, -0.125]},
    "target outside spans": {
        "weight_versions": [{"start": 3, "end": 4, "engine_id": "e", "weight_version": "v"}]
    },
    "span outside tokens": {
        "weight_versions": [{"start": 2, "end": 9, "engine_id": "e", "weight_version": "v"}]
    },
    "no leaf": {"leaf_call_id": None},
    "placeholder with targets": {"placeholder": True},
}


@pytest.mark.parametrize("change", list(BAD_TRAJECTORIES.values()), ids=list(BAD_TRAJECTORIES))
def test_trajectory_rejects_malformed(change):
    data = {**orjson.loads(_trajectory().model_dump_json()), **change}
    with pytest.raises(ValidationError):
        Trajectory.model_validate(data)


def test_provenance_runs_round_trip():
    mask = [False, False, True, True, True, False]
    runs = runs_from_mask(mask)
    assert runs == [("external", 2), ("policy", 3), ("external", 1)]
    assert mask_from_runs(runs) == mask
    assert runs_from_mask([]) == []


def test_make_record_is_valid():
    r = make_record(call_id="a", input_ids=[1, 2], output_ids=[3])
    assert r.num_tokens == 3 and r.output_segments[0].end == 1
