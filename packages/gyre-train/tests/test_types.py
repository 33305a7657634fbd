"""Every gyre-train wire type round-trips through orjson and rejects malformed input with a ValidationError."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from gyre_train.types import (
    CellRequest,
    CoordinatorReply,
    ExecutionInfo,
    ExecutionPartial,
    MicroStep,
    PrepassResult,
    Shard,
    StepReport,
    TokenStats,
    TrainResult,
    WorkItem,
)


def _shard() -> Shard:
    return Shard(
        input_ids=[5, 6, 7, 8, 9],
        cu_seqlens=[0, 3, 5],
        labels=[6, 7, -100, 9, -100],
        exec_slot=[0, -1, -1, 0, -1],
        behavior_logprobs=[-1.25, 0.0, 0.0, -0.1, 0.0],
    )


def _micro() -> MicroStep:
    info = ExecutionInfo(
        execution_id="e",
        group_id="g",
        advantage=-0.3,
        num_targets=2,
        staleness=1,
        log_ratio_sum=-0.0123456789012345,
    )
    return MicroStep(
        batch=2, index=7, norm=512, temperature=0.7, executions=[info], shards=[_shard(), _shard()]
    )


def _examples():
    ms = _micro()
    pre = PrepassResult(
        batch=2, index=7, cell=1, partials=[ExecutionPartial(execution_id="e", log_ratio_sum=0.1, count=2)]
    )
    tr = TrainResult(batch=2, index=7, cell=0, stats=TokenStats(loss=0.5, num_targets=3, weight_max=5.0))
    return [
        ms.executions[0],
        _shard(),
        ms,
        WorkItem(kind="train", microstep=ms),
        pre,
        tr,
        tr.stats,
        StepReport(
            step=0,
            policy_version=1,
            loss=0.1,
            surrogate=0.2,
            grad_norm=1.5,
            num_groups=2,
            num_executions=8,
            num_target_tokens=100,
            num_microsteps=3,
            microsteps_by_cell={0: 2, 1: 1},
            group_ids=["a", "b"],
            staleness=[0, 1],
            metrics={"clip_frac_all": 0.25},
        ),
        CellRequest(op="report", cell=1, prepass=pre),
        CellRequest(op="claim", cell=2),
        CoordinatorReply(status="batch_done", batch=3, prefix=2, members=[0, 1], broadcast=True),
        CoordinatorReply(status="dropped"),
        CoordinatorReply(status="item", item=WorkItem(kind="prepass", microstep=ms)),
    ]


@pytest.mark.parametrize("model", _examples(), ids=lambda m: type(m).__name__)
def test_round_trip(model):
    again = type(model).model_validate(orjson.loads(model.model_dump_json()))
    assert again == model
    assert again.schema_version == 1


def test_derived_fields():
    s = _shard()
    assert s.position_ids() == [0, 1, 2, 0, 1]
    ms = _micro()
    assert ms.num_tokens == 10 and ms.num_targets == 4


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"labels": [6, 7, -100, 9]}, "labels has length 4"),
        ({"cu_seqlens": [0, 3, 4]}, "cu_seqlens must start at 0 and end at 5"),
        ({"cu_seqlens": [0, 3, 3, 5]}, "strictly increasing"),
        ({"exec_slot": [0, -2, -1, 0, -1]}, "< -1"),
        ({"exec_slot": [0, -1, 0, 0, -1]}, "is a target but has no label"),
        ({"extra": 1}, "Extra inputs"),
    ],
)
def test_shard_rejects_malformed(kwargs, msg):
    base = _shard().model_dump()
    base.update(kwargs)
    with pytest.raises(ValidationError, match=msg):
        Shard.model_validate(base)


def test_other_types_reject_malformed():
    ms = _micro().model_dump()
    ms["executions"] = []
    with pytest.raises(ValidationError, match="execution slot 0"):
        MicroStep.model_validate(ms)
    with pytest.raises(ValidationError, match="schema_version"):
        TokenStats.model_validate({"schema_version": 2})
    with pytest.raises(ValidationError, match="num_targets"):
        ExecutionInfo(execution_id="e", group_id="g", advantage=1.0, num_targets=-1, staleness=0)
    with pytest.raises(ValidationError, match="exactly one"):
        CellRequest(op="report", cell=1)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        CellRequest(op="claim", cell=0)  # the core does not ask itself
    with pytest.raises(ValidationError, match="kind"):
        WorkItem.model_validate({"kind": "eval", "microstep": _micro().model_dump()})
