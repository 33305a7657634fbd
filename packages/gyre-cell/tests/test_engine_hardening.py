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
    from gyre_cell.errors import EngineInputError

    with pytest.raises(EngineInputError, match="temperature"):
        engine.submit(
            rid="bad",
            input_ids=[1],
            sampling=SamplingSpec(temperature=temp),
            return_logprob=False,
            stream=False,
            sink=lambda *_: None,
        )


def test_nan_weights_are_refused_and_the_engine_keeps_its_weights(engine):
    from gyre_cell.errors import WeightError

    name, param = next(iter(engine.weights._params.items()))
    before = param.detach().clone()
    bad = torch.full_like(before, float("nan"))
    with pytest.raises(WeightError, match="NaN or infinite"):
        engine.update_weights({name: bad}, weight_version="nan")
    assert torch.equal(param.detach(), before) and engine.weight_version != "nan"


def test_control_endpoints_answer_400_not_500(shared, tmp_path):
    http = shared.http
    r = http.post("/update_weights_from_disk", json={"model_path": "/x" * 2500})
    assert r.status_code == 400 and r.json()["success"] is False and "model_path" in r.json()["message"]
    r = http.post(
        "/init_weights_update_group",
        json={"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1, "world_size": 2},
    )
    assert r.status_code == 400 and "master_port" in r.json()["error"]["message"]
    (tmp_path / "x.safetensors").write_bytes(b"not a safetensors file")
    r = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert r.status_code == 400 and "cannot read the checkpoint" in r.json()["message"]
    assert http.get("/health").status_code == 200


def test_weight_dirs_restrict_update_from_disk(tiny_model, tiny_model_b, tmp_path):
    from gyre_cell.errors import WeightError

    eng = TorchEngine(EngineConfig(model_path=str(tiny_model), device="cpu", weight_dirs=[str(tiny_model_b)]))
    try:
        link = tmp_path / "link"
        link.symlink_to(tiny_model)  # resolved before the check: a link cannot smuggle another directory in
        for path in (str(tiny_model), str(link), str(tiny_model_b) + "/../" + tiny_model.name):
            with pytest.raises(WeightError, match="outside the engine's weight directories"):
                eng.update_weights_from_disk(path, weight_version="x")
        assert eng.update_weights_from_disk(str(tiny_model_b), weight_version="b") > 0
        assert eng.weight_version == "b"
    finally:
        eng.close()


def test_engine_token_guards_every_endpoint_but_health(tiny_model):
    """Before: any local process could POST /pause_generation (hanging every proxied call) or load weights."""
    import asyncio

    import httpx

    from gyre_cell.client import TorchEngineClient
    from gyre_cell.engine.server import create_app

    eng = TorchEngine(EngineConfig(model_path=str(tiny_model), device="cpu"))
    try:
        app = create_app(eng, api_key="s3cret")

        async def main():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://e") as anon:
                assert (await anon.get("/health")).status_code == 200
                for method, path in [
                    ("POST", "/pause_generation"),
                    ("POST", "/generate"),
                    ("POST", "/update_weights_from_disk"),
                    ("GET", "/model_info"),
                    ("GET", "/server_info"),
                    ("POST", "/abort_request"),
                ]:
                    r = await anon.request(method, path, json={})
                    assert r.status_code == 401, (path, r.status_code)
                    assert "token" in r.json()["error"]["message"]
                r = await anon.post("/pause_generation", headers={"authorization": "Bearer wrong"})
                assert r.status_code == 401
            assert not eng.paused
            async with TorchEngineClient("http://e", transport=transport, api_key="s3cret") as client:
                res = await client.generate([3, 1, 4], {"max_new_tokens": 3, "temperature": 0.0})
                assert len(res.output_ids) == 3
                assert await client.weight_version() == "default"

        asyncio.run(main())
    finally:
        eng.close()
