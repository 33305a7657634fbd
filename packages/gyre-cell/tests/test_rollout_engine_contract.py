"""One contract for every RolloutEngine: the torch engine (real HTTP on loopback) in CI, SGLang under `gpu`.

The SGLang case launches `python -m sglang.launch_server` on the tiny model; it needs a CUDA machine with
sglang's kernels (pytest -m gpu).
"""

import asyncio
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from gyre_cell.client import RolloutEngine, TorchEngineClient
from gyre_cell.errors import EngineError

LONG = {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}
SHORT = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@dataclass
class EngineUnderTest:
    url: str
    make_client: type[RolloutEngine]
    tensor_device: str
    served: Any = None  # conftest's Served: the in-process torch engine: its gates (SGLang offers none)


@contextmanager
def _sglang(model) -> Iterator[EngineUnderTest]:
    from gyre_cell.sglang_adapter import SGLangEngine, SGLangLaunchConfig, SGLangServer

    # Only the `gpu`-marked parameter reaches here: without CUDA that run must fail, not pass silently.
    assert torch.cuda.is_available(), "the SGLang contract run (pytest -m gpu) needs a CUDA device"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = SGLangServer(SGLangLaunchConfig(model_path=str(model), port=port, mem_fraction_static=0.3))
    server.start()
    try:
        asyncio.run(server.wait_healthy(timeout_s=600))
        yield EngineUnderTest(server.base_url, SGLangEngine, "cuda")
    finally:
        server.stop()


@pytest.fixture(params=["torch", pytest.param("sglang", marks=pytest.mark.gpu)])
def engine(request, tiny_model, serve_engine) -> Iterator[EngineUnderTest]:
    if request.param == "torch":
        with serve_engine(tiny_model) as s:
            yield EngineUnderTest(s.url, TorchEngineClient, "cpu", s)
    else:
        with _sglang(tiny_model) as e:
            yield e


def _run(coro):
    return asyncio.run(coro)


async def _running(client: RolloutEngine, task: asyncio.Task, held=None) -> None:
    """Until `task`'s request runs. The torch engine's gate `held` (Served.hold_after) holds it there, k tokens
    in, so it cannot end before the test acts: stop 31's CI saw a 3000-token request end between the poll that
    saw it running and the pause. SGLang has no gate: its load is polled (a request that ended first says so)."""
    if held is not None:
        assert await asyncio.to_thread(held.wait, 60), "the request never reached its gate"
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while loop.time() < deadline:
        if (await client.loads())["loads"][0]["num_running_reqs"] >= 1:
            return
        if task.done():
            raise AssertionError(f"the request ended before it was seen running: {task.result()!r}")
        await asyncio.sleep(0.01)
    raise AssertionError("no request started")


def _gate(e: EngineUnderTest, rid: str, k: int = 4):
    return e.served.hold_after(rid, k) if e.served is not None else None


def test_generate_and_stream(engine):
    async def body():
        async with engine.make_client(engine.url) as c:
            assert await c.health()
            res = await c.generate([1, 2, 3, 4], SHORT, rid="g1")
            assert res.rid == "g1" and len(res.output_ids) == 8 == res.completion_tokens
            assert res.output_logprobs is not None and len(res.output_logprobs) == 8
            assert all(lp <= 0 for lp in res.output_logprobs)
            assert res.finish_reason.type == "length" and res.prompt_tokens == 4
            snaps = [s async for s in c.generate_stream([1, 2, 3, 4], SHORT)]
            assert [len(s.output_ids) for s in snaps][-1] == 8
            assert snaps[-1].output_ids == res.output_ids and snaps[-1].finish_reason.type == "length"

    _run(body())


def test_abort_pause_continue(engine):
    async def body():
        async with engine.make_client(engine.url) as c:
            held = _gate(engine, "long")
            task = asyncio.create_task(c.generate([5, 6, 7], LONG, rid="long"))
            await _running(c, task, held)
            await c.abort("long")
            res = await task
            assert res.finish_reason.type == "abort" and 0 < len(res.output_ids) < 3000
            if held is not None:  # held at its 4th token, aborted there
                assert len(res.output_ids) == 4
                await c.continue_generation()

            # Paused in place and continued: the same greedy tokens as uninterrupted.
            expected = (await c.generate([5, 6], {**SHORT, "max_new_tokens": 3000})).output_ids
            held = _gate(engine, "paused")
            task = asyncio.create_task(c.generate([5, 6], {**SHORT, "max_new_tokens": 3000}, rid="paused"))
            await _running(c, task, held)
            await c.pause("in_place")
            await c.continue_generation()
            assert (await task).output_ids == expected

            held = _gate(engine, "dropped")
            task = asyncio.create_task(c.generate([5, 6, 7], LONG, rid="dropped"))
            await _running(c, task, held)
            await c.pause("abort")
            res = await task
            assert res.finish_reason.type == "abort" and 0 < len(res.output_ids) < 3000
            await c.continue_generation()

    _run(body())


def test_release_resume_and_weight_update_session(engine, tiny_model_b):
    new = load_file(str(tiny_model_b / "model.safetensors"), device=engine.tensor_device)

    async def body():
        async with engine.make_client(engine.url) as c:
            before = (await c.generate([9, 8, 7], SHORT)).output_ids
            await c.pause("retract")
            await c.flush_cache()
            await c.release_memory(["weights", "kv_cache", "cuda_graph"])
            await c.resume_memory(["weights"])
            async with c.weight_update_session():
                await c.update_weights_from_tensor(list(new.items()), weight_version="step-1")
            await c.resume_memory(["kv_cache", "cuda_graph"])
            await c.continue_generation()
            assert await c.weight_version() == "step-1"
            res = await c.generate([9, 8, 7], SHORT)
            assert res.weight_version == "step-1" and res.output_ids != before
            await c.update_weight_version("step-2")
            assert await c.weight_version() == "step-2"
            assert await c.health_generate()

    _run(body())


def test_bad_requests_raise_engine_error(engine):
    async def body():
        async with engine.make_client(engine.url) as c:
            with pytest.raises(EngineError) as err:
                await c.generate([1, 2], {"max_new_tokens": -1})  # SGLang accepts 0
            assert err.value.status == 400
            assert (await c.generate([1, 2], SHORT)).completion_tokens == 8

    _run(body())


def test_trainer_side_sends_torch_tensors():
    # the torch engine's tensor payload is plain safetensors: decodable without pickle
    from gyre_cell.tensor_codec import decode_named_tensors

    body = TorchEngineClient("http://x").tensor_update_body([("a", torch.ones(2, 3))], weight_version="v")
    assert body["load_format"] == "safetensors" and body["weight_version"] == "v"
    assert torch.equal(decode_named_tensors(body["serialized_named_tensors"][0])["a"], torch.ones(2, 3))
