"""Issue 15 regressions for the torch engine: one request can never fail its batch, bad control input is a 400."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from gyre_cell.engine import EngineConfig, TorchEngine
from gyre_cell.engine.request import SamplingSpec
from gyre_cell.engine.sampling import sample_batch


def test_sample_batch_tiny_temperature_is_greedy_and_a_bad_row_fails_alone():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [0.3, 0.2, 0.9, 0.1], [0.0, float("nan"), 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    params = [(1e-40, 1.0, -1, None), (1.0, 1.0, -1, None), (1.0, 1.0, -1, None)]
    tokens, logprobs, failed = sample_batch(logits, params, gen)
    assert tokens[0] == 1  # greedy
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))
    assert 0 <= tokens[1] < 4 and math.isfinite(logprobs[1])
    assert set(failed) == {2}
    # the same with a per-request generator (the row-by-row path)
    params = [(1e-40, 0.9, 2, torch.Generator().manual_seed(1)), (1.0, 0.5, -1, None), (0.7, 1.0, 3, None)]
    tokens, _, failed = sample_batch(logits, params, gen)
    assert tokens[0] == 1 and set(failed) == {2}


def _collect():
    done = threading.Event()
    box: dict = {}

    def sink(out, finished):
        if finished:
            box["out"] = out
            done.set()

    return sink, box, done


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = TorchEngine(EngineConfig(model_path=str(tiny_model), device="cpu"))
    yield eng
    eng.close()


def test_tiny_temperature_in_a_batch_does_not_abort_the_other_requests(engine):
    """Before: `temperature: 1e-40` made the step's sampling raise and the engine aborted every running request."""
    engine.pause("in_place")  # gate: all three requests join the same first step
    sinks = []
    for i, temp in enumerate((1e-40, 1.0, 0.7)):
        sink, box, done = _collect()
        spec = SamplingSpec(max_new_tokens=8, temperature=temp, ignore_eos=True)
        engine.submit(
            rid=f"t{i}", input_ids=[3, 1, 4], sampling=spec, return_logprob=True, stream=False, sink=sink
        )
        sinks.append((box, done))
    engine.resume_generation()
    for box, done in sinks:
        assert done.wait(60)
        meta = box["out"]["meta_info"]
        assert meta["finish_reason"]["type"] == "length", meta["finish_reason"]
        assert len(box["out"]["output_ids"]) == 8
        assert all(math.isfinite(lp) for lp, _, _ in meta["output_token_logprobs"])
    # the tiny temperature sampled greedily
    sink, box, done = _collect()
    spec = SamplingSpec(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    engine.submit(rid="g", input_ids=[3, 1, 4], sampling=spec, return_logprob=True, stream=False, sink=sink)
    assert done.wait(60)
    assert box["out"]["output_ids"] == sinks[0][0]["out"]["output_ids"]


@pytest.mark.parametrize("temp", [float("nan"), float("inf"), -1.0])
def test_non_finite_temperature_is_refused(engine, temp):
    from gyre_cell.engine.request import EngineInputError

    with pytest.raises(EngineInputError, match="temperature"):
        engine.submit(
            rid="bad", input_ids=[1], sampling=SamplingSpec(temperature=temp), return_logprob=False,
            stream=False, sink=lambda *_: None,
        )  # fmt: skip
