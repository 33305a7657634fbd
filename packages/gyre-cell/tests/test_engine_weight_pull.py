"""An in-process torch engine pulls published weights over Mooncake (no HTTP for the weights).

The publisher is a spawned process (`publisher_process`, TCP on loopback); the engine is a TorchEngine in the test
process served over real HTTP, which the checks use (`/generate`, `/model_info`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gyre_cell.client import TorchEngineClient
from gyre_cell.engine.weights import load_checkpoint_dir
from gyre_cell.roles import CellRoleManager
from gyre_cell.transfer import WeightSubscriber, fetch_manifest, published_weights_loader, pull_into_engine
from gyre_cell.transfer.peer import PeerProcess, publisher_process

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _body(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        **extra,
    }


def _teacher_forced_error(model_dir: Path, out: dict[str, Any]) -> float:
    """Max |engine log-prob - teacher-forced HF float32 forward| over the output tokens."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + out["output_ids"]])).logits[0].float()
    lp = torch.log_softmax(logits, -1)  # greedy requests report unscaled log-probs
    expected = [float(lp[len(PROMPT) - 1 + j, t]) for j, t in enumerate(out["output_ids"])]
    got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    return max(abs(a - b) for a, b in zip(expected, got, strict=True))


def _assert_serves(served: Any, model_dir: Path, version: str) -> list[int]:
    for name, p in served.engine.model.named_parameters():  # bit-equal to the published checkpoint
        assert torch.equal(p.detach(), load_checkpoint_dir(model_dir)[name]), name
    assert served.http.get("/model_info").json()["weight_version"] == version
    r = served.http.post("/generate", json=_body(16))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["weight_version"] == version
    assert [s["version"] for s in out["meta_info"]["weight_versions"]] == [version]
    assert _teacher_forced_error(model_dir, out) < 1e-5
    return out["output_ids"]


@pytest.fixture
def publisher(tiny_model: Path) -> Iterator[PeerProcess]:
    with PeerProcess(publisher_process, {"dir": str(tiny_model)}, 1) as p:
        yield p


@pytest.mark.slow
def test_engine_pulls_a_then_b_and_a_running_request_continues(
    publisher: PeerProcess, serve_engine: Any, tiny_model: Path, tiny_model_b: Path
) -> None:
    # The engine starts on B's weights, so pulling A really changes them.
    with (
        serve_engine(tiny_model_b) as served,
        WeightSubscriber(fetch_manifest(publisher.call("serve_manifest"))) as sub,
    ):
        assert pull_into_engine(served.engine, sub) == "1"
        greedy_a = _assert_serves(served, tiny_model, "1")

        publisher.call("publish", {"dir": str(tiny_model_b)}, 2)
        assert pull_into_engine(served.engine, sub) == "2"
        greedy_b = _assert_serves(served, tiny_model_b, "2")
        assert greedy_a != greedy_b

        # A pull while a request runs: it continues on the new weights, and its spans say where they changed.
        publisher.call("publish", {"dir": str(tiny_model)}, 3)
        n = 4000  # long enough that the request is still running when the pause lands, even on a loaded box
        with served.http.stream("POST", "/generate", json=_body(n, stream=True, rid="long")) as resp:
            frames = (json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {"))
            first = next(frames)  # the request is running and has produced tokens
            assert served.http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
            assert pull_into_engine(served.engine, sub) == "3"
            assert served.http.post("/continue_generation", json={}).status_code == 200
            for frame in frames:  # until it has made a few tokens on the new weights, then stop it
                spans = frame["meta_info"]["weight_versions"]
                if spans[-1]["version"] == "3" and spans[-1]["end"] - spans[-1]["start"] >= 8:
                    break
            assert served.http.post("/abort_request", json={"rid": "long"}).status_code == 200
            *_, last = [frame, *frames]
        spans, m = last["meta_info"]["weight_versions"], len(last["output_ids"])
        k = spans[0]["end"]
        assert len(first["output_ids"]) <= k < m < n
        assert spans == [{"version": "2", "start": 0, "end": k}, {"version": "3", "start": k, "end": m}]
        assert last["meta_info"]["weight_version"] == "3"
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert _assert_serves(served, tiny_model, "3") == greedy_a


class _NoTraining:
    """A training side with nothing to move (the weights under test are the engine's)."""

    async def offload(self) -> None:
        pass

    async def restore(self) -> None:
        pass


@pytest.mark.slow
def test_to_rollout_with_published_weights_loader(
    publisher: PeerProcess, serve_engine: Any, tiny_model: Path, tiny_model_b: Path
) -> None:
    publisher.call("publish", {"dir": str(tiny_model)}, 5)
    # No weights backup: after release/resume the parameters are zeros until the loader fills them.
    with (
        serve_engine(tiny_model_b, weights_backup="none") as served,
        WeightSubscriber(fetch_manifest(publisher.call("serve_manifest"))) as sub,
    ):

        async def run() -> str | None:
            async with TorchEngineClient(served.url) as client:
                mgr = CellRoleManager(client, _NoTraining())
                await mgr.to_training()
                assert all(p.numel() == 0 for p in served.engine.model.parameters())  # really released
                rep = await mgr.to_rollout(published_weights_loader(sub, served.engine))
                assert await client.weight_version() == "5"
                return rep.weight_version

        assert asyncio.run(run()) == "5"
        _assert_serves(served, tiny_model, "5")
