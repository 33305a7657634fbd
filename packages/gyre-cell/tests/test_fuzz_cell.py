"""Malformed commands to a real cell worker's `/cell/*` API (issue 37): every one is a 4xx with a message, never a
500, and none leaves a lock held (a valid publish, which takes the publish lock, goes through after each).

One elastic core worker (a gloo world of one, weights through disk so no Mooncake library is needed) runs as a real
process on loopback, as the controller starts it. Bodies: a valid command with one field replaced by NaN, an
infinity, 2**63, 10**30, `true`, a string, a list, an object or null; non-object JSON, truncated JSON, bytes that are
no JSON; each sent as JSON and as text/plain. Hypothesis draws them, the same ones on every run (derandomized).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gyre_cell.engine.config import EngineConfig
from gyre_cell.ports import free_ports
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import (
    CellTrainingConfig,
    CellWorkerConfig,
    OpenBatchCommand,
    PublishCommand,
    PublishedWeights,
    ReformCommand,
    SaveCommand,
)
from gyre_train.testing.synthetic import build_tiny_model
from gyre_train.types import ReadyGroupMessage

BAD = [float("nan"), float("inf"), float("-inf"), 2**63, 10**30, -1, True, "1", 1.5, [], {}, None]
"""Values no field of a command takes where a valid one stood (a bool field takes True: `assume` drops those)."""
RAW = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"[]",
    b'"x"',
    b"1",
    b"null",
    b"",
    b"\xff\xfe",
    b'{"version": 1e400}',
    b'{"version": 9223372036854775808}',
    b'{"version": true}',
    b'{"version": "0"}',
]


def _dumps(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN and Infinity as the JSON extension writes them


async def _wait_ready(port: int, proc: subprocess.Popen) -> None:
    client = CellWorkerClient(f"http://127.0.0.1:{port}")
    try:
        await client.wait_ready(600, alive=lambda: proc.poll() is None)
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-cell")
    model = build_tiny_model(tmp / "tiny")
    http_port, master_port, coordinator_port = free_ports(3)
    cfg = CellWorkerConfig(
        cell=0,
        num_cells=1,
        run_dir=str(tmp),
        port=http_port,
        weights="disk",
        engine=EngineConfig(model_path=model, device="cpu", weight_version="0"),
        training=CellTrainingConfig(
            group_size=2,
            batch_groups=1,
            lr=1e-3,
            tokens_per_shard=64,
            snapshot="file",
            master_port=master_port,
            coordinator_port=coordinator_port,
            checkpoint_keep=0,
        ),
    )
    (tmp / "cell.json").write_text(cfg.model_dump_json())
    log = (tmp / "cell.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre_cell.cli", "worker", "--config", str(tmp / "cell.json")],
        stdout=log,
        stderr=log,
    )
    try:
        asyncio.run(_wait_ready(http_port, proc))
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
            yield http, model, tmp
    finally:
        proc.kill()
        proc.wait()


def _examples(model: str, tmp: Path) -> dict[str, tuple[type, dict]]:
    weights = {"version": 0, "path": model}
    group = {
        "group_id": "g",
        "policy_version": 0,
        "executions": [{"execution_id": "e", "reward": 0.0, "advantage": 0.0, "placeholder": True}],
    }
    return {
        "publish": (PublishCommand, {"version": 0, "save": False}),
        "save": (SaveCommand, {"version": 0}),
        "open_batch": (OpenBatchCommand, {"version": 0, "final": True}),
        "load_weights": (PublishedWeights, weights),
        "to_rollout": (PublishedWeights, weights),
        "reform": (ReformCommand, {"generation": 1, "master_port": 1, "rejoining": [0], "members": [0]}),
        "groups": (ReadyGroupMessage, group),
    }


def _refused_in_shape(r: httpx.Response, what: str) -> None:
    assert 400 <= r.status_code < 500, f"{what} -> {r.status_code} {r.text[:300]}"
    message = r.json()["error"]["message"]
    assert message and "Traceback" not in message, message


def _publish_goes_through(http: httpx.Client) -> None:
    r = http.post("/cell/publish", json={"version": 0})
    assert r.status_code == 200 and r.json()["version"] == 0, r.text[:300]


def test_malformed_commands_are_4xx_and_leave_no_lock_held(core):
    http, model, tmp = core
    examples = _examples(model, tmp)
    sent: list[str] = []

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(sorted(examples)),
        st.data(),
        st.sampled_from(["application/json", "text/plain"]),
    )
    def one(path, data, content_type):
        model_type, example = examples[path]
        if data.draw(st.booleans(), label="raw"):
            body = data.draw(
                st.sampled_from(RAW) | st.sampled_from([_dumps(example)[:n] for n in (1, 5, -1)])
            )
        else:
            field = data.draw(st.sampled_from(sorted(example)), label="field")
            value = data.draw(st.sampled_from(BAD), label="value")
            body = _dumps({**example, field: value})
        try:
            model_type.model_validate_json(body, strict=True)
            assume(False)  # a valid command: not malformed (reform or open_batch would act on it)
        except ValidationError:
            pass
        r = http.post(f"/cell/{path}", content=body, headers={"content-type": content_type})
        _refused_in_shape(r, f"{path} {body[:80]!r}")
        sent.append(path)
        _publish_goes_through(http)  # the publish lock is free after every refused command

    one()
    assert set(sent) == set(examples), sent


def test_well_formed_commands_the_cell_cannot_carry_out_are_4xx(core):
    """Before: each of these was a 500 (a ValueError out of the handler)."""
    http, model, tmp = core
    missing = {
        "execution_id": "e",
        "reward": 0.0,
        "advantage": 0.0,
        "trajectories_path": str(tmp / "no.parquet"),
    }
    cases = [
        ("open_batch", {"version": 5, "final": True}, 409, "the trainer is at version 0"),
        ("load_weights", {"version": 0}, 400, "no checkpoint path"),
        ("load_weights", {"version": 0, "path": str(tmp / "nowhere")}, 400, "is not a directory"),
        ("load_weights", {"version": 0, "path": str(tmp)}, 400, "safetensors"),
        ("groups", {"group_id": "g", "policy_version": 0, "executions": [missing]}, 400, "group g refused"),
    ]
    for path, body, status, words in cases:
        r = http.post(f"/cell/{path}", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], (
            path,
            r.status_code,
            r.text,
        )
        _publish_goes_through(http)
    # lax mode took `true` for version 1 and loaded weights labelled "True"
    r = http.post("/cell/load_weights", json={"version": True, "path": model})
    assert r.status_code == 400 and "version" in r.json()["error"]["message"], r.text
    assert http.get("/cell/status").json()["weight_version"] == "0"


@pytest.mark.parametrize(
    "query",
    ["timeout=NaN", "timeout=inf", "timeout=-1", "after=-5", "after=99999999999999999999", "after=true"],
)
def test_the_event_poll_refuses_bad_bounds(core, query):
    """A NaN timeout made the long poll wait forever (min(nan, 60) is nan); a negative `after` was echoed back."""
    http, _, _ = core
    r = http.get(f"/cell/events?{query}", timeout=30)
    assert r.status_code == 422, (query, r.status_code, r.text[:200])
    assert http.get("/cell/events?after=0&timeout=0").status_code == 200
