import orjson
import pytest
from pydantic import ValidationError

from gyre_cell.types import FinishReason, GenerationResult, WeightVersionSpan

EXAMPLES = [
    FinishReason(type="stop", matched=151645),
    FinishReason(type="abort", message="Aborted"),
    WeightVersionSpan(version="v1", start=0, end=4),
    GenerationResult(
        rid="r",
        output_ids=[1, 2],
        output_logprobs=[-0.1, -2.0],
        finish_reason=FinishReason(type="length", length=2),
        prompt_tokens=3,
        completion_tokens=2,
        cached_tokens=0,
        weight_version="v1",
        weight_versions=[WeightVersionSpan(version="v1", start=0, end=2)],
        text="ab",
    ),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert type(msg).model_validate(orjson.loads(msg.model_dump_json())) == msg


@pytest.mark.parametrize(
    ("cls", "data"),
    [
        (FinishReason, {"type": "done"}),
        (WeightVersionSpan, {"version": "v", "start": 0}),
        (GenerationResult, {"rid": "r", "output_ids": ["x"]}),
        (FinishReason, {"type": "stop", "schema_version": 2}),
        (FinishReason, {"type": "stop", "extra": 1}),
    ],
)
def test_rejects_malformed(cls, data):
    with pytest.raises(ValidationError):
        cls.model_validate(data)
