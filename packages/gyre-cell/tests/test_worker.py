"""The cell worker process (`gyre-cell worker`), driven over HTTP as the controller drives it.

A standalone engine (no training side) and a one-cell elastic worker (the core alone: gloo world of one) run as
real processes; every command goes through `CellWorkerClient`, the controller's client.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gyre_cell.engine.config import EngineConfig
from gyre_cell.errors import CellCommandError
from gyre_cell.ports import free_port, free_ports
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import CellEvent, CellTrainingConfig, CellWorkerConfig, PublishedWeights
from gyre_eval.groups import group_advantages
from gyre_tito.export import write_trajectories
from gyre_train.testing.synthetic import build_tiny_model, make_groups
from gyre_train.types import ReadyGroupMessage


def _start(tmp: Path, cfg: CellWorkerConfig) -> subprocess.Popen:
    path = tmp / f"{cfg.kind}-{cfg.cell}.json"
    path.write_text(cfg.model_dump_json())
    log = (tmp / f"{cfg.kind}-{cfg.cell}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "gyre_cell.cli", "worker", "--config", str(path)], stdout=log, stderr=log
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_standalone_worker_serves_rollout_only_and_answers_bad_commands_in_shape(tmp_path, model):
    cfg = CellWorkerConfig(
        cell=0,
        kind="standalone",
        num_cells=2,
        run_dir=str(tmp_path),
        port=free_port(),
        engine=EngineConfig(model_path=model, device="cpu", weight_version="0"),
    )
    proc = _start(tmp_path, cfg)

    async def drive() -> None:
        client = CellWorkerClient(f"http://127.0.0.1:{cfg.port}")
        try:
            status = await client.wait_ready(120, alive=lambda: proc.poll() is None)
            assert (status.kind, status.role, status.weight_version) == ("standalone", "rollout", "0")
            with pytest.raises(CellCommandError, match="409 standalone engine 0 serves rollout only"):
                await client.to_training()
            with pytest.raises(CellCommandError, match="409 standalone cell 0 is not the core"):
                await client.open_batch(0, final=True)
            with pytest.raises(CellCommandError, match="409 standalone engine 0 hosts no gloo rendezvous"):
                await client.rendezvous_port()
            async with httpx.AsyncClient(base_url=client.base_url) as raw:
                bad = await raw.post("/cell/load_weights", content=b'{"version": -1}')
                assert bad.status_code == 400 and "invalid command" in bad.json()["error"]["message"]
                assert (await raw.get("/model_info")).json()["weight_version"] == "0"  # nothing changed
            loaded = await client.load_weights(PublishedWeights(version=3, path=model))
            assert loaded.version == "3"
            assert (await client.status()).weight_version == "3"
            assert (await client.events(0, timeout_s=0.2)).events == []
            await client.shutdown()
        finally:
            await client.aclose()

    try:
        asyncio.run(drive())
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_sigterm_answers_an_open_event_poll_and_the_worker_exits(tmp_path, model):
    """The controller's event poll is held open up to its timeout (60 s here). On SIGTERM the worker answers it, with
    no events, and ends well before that; before, uvicorn's graceful shutdown waited for the poll, past the
    launcher's 5 s grace, and every cell of every finished run was SIGKILLed."""
    cfg = CellWorkerConfig(
        cell=0,
        kind="standalone",
        num_cells=2,
        run_dir=str(tmp_path),
        port=free_port(),
        engine=EngineConfig(model_path=model, device="cpu", weight_version="0"),
    )
    proc = _start(tmp_path, cfg)
    try:
        asyncio.run(
            CellWorkerClient(f"http://127.0.0.1:{cfg.port}").wait_ready(120, lambda: proc.poll() is None)
        )
        with socket.create_connection(("127.0.0.1", cfg.port)) as poll:
            poll.sendall(b"GET /cell/events?after=0&timeout=60 HTTP/1.1\r\nHost: cell\r\n\r\n")
            # gate: a request sent after the poll is answered, so the server has taken the poll before the signal
            assert httpx.get(f"http://127.0.0.1:{cfg.port}/cell/status").json()["ready"]
            proc.send_signal(signal.SIGTERM)
            poll.settimeout(30)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = poll.recv(65536)
                assert chunk, f"connection closed with {answer!r}"
                answer += chunk
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200") and (
            json.loads(body)["events"],
            json.loads(body)["next"],
        ) == ([], 0)
        assert proc.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises the signal once it has shut down
    finally:
        proc.kill()


def test_a_worker_whose_port_is_taken_exits_with_one_line(tmp_path, model):
    """Its HTTP server cannot start: the process leaves at once (its setup thread must not keep it alive, or the
    launcher would wait for a restarted cell until its start timeout), naming the address."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = CellWorkerConfig(
            cell=0,
            kind="standalone",
            num_cells=1,
            run_dir=str(tmp_path),
            port=taken.getsockname()[1],
            engine=EngineConfig(model_path=model, device="cpu", weight_version="0"),
        )
        proc = _start(tmp_path, cfg)
        try:
            assert proc.wait(timeout=120) != 0
        finally:
            proc.kill()
    log = (tmp_path / "standalone-0.log").read_text()
    assert f"cell 0: HTTP server on 127.0.0.1:{cfg.port} did not start" in log
    assert "Traceback" not in log


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_worker_asked_for_cuda_that_sees_none_refuses_in_one_line(tmp_path, model):
    """`cluster.device = "cuda"`: the worker restricts itself to its GPUs first, and one that sees no CUDA device
    leaves with a line naming them, before building anything (no engine on the CPU instead)."""
    cfg = CellWorkerConfig(
        cell=1,
        num_cells=2,
        run_dir=str(tmp_path),
        port=free_port(),
        visible_gpus=["2", "3"],
        engine=EngineConfig(model_path=model, device="cuda", weight_version="0"),
        training=CellTrainingConfig(
            group_size=2, batch_groups=1, lr=1e-3, master_port=1, coordinator_port=2, device="cuda"
        ),
    )
    proc = _start(tmp_path, cfg)
    try:
        assert proc.wait(timeout=120) == 2
    finally:
        proc.kill()
    log = (tmp_path / "elastic-1.log").read_text()
    assert (
        "gyre-cell worker: cell 1: device cuda, but this process sees no CUDA device (CUDA_VISIBLE_DEVICES=2,3)"
        in log
    )
    assert "Traceback" not in log and '"cell":1' not in log  # refused before its resolved config was printed


def test_core_worker_trains_a_streamed_batch_and_publishes(tmp_path, model):
    """One elastic cell: switch to training, receive groups as files, stream a batch, publish over Mooncake."""
    n, b = 4, 2
    http_port, master_port, coordinator_port = free_ports(3)  # distinct, below the ephemeral range
    cfg = CellWorkerConfig(
        cell=0,
        num_cells=1,
        run_dir=str(tmp_path),
        port=http_port,
        engine=EngineConfig(model_path=model, device="cpu", weight_version="0"),
        training=CellTrainingConfig(
            group_size=n,
            batch_groups=b,
            lr=1e-3,
            tokens_per_shard=64,
            master_port=master_port,
            coordinator_port=coordinator_port,
        ),
    )
    messages = []
    for gid, version, execs in make_groups(b, n, seed=3, max_len=50):
        advantages = group_advantages([r for _, r, _ in execs])
        rows = []
        for (eid, reward, trajs), adv in zip(execs, advantages, strict=True):
            path = tmp_path / f"{eid}.parquet"
            write_trajectories(path, trajs)
            placeholder = all(t.num_targets == 0 for t in trajs)
            rows.append(
                {
                    "execution_id": eid,
                    "reward": reward,
                    "advantage": adv,
                    "placeholder": placeholder,
                    "trajectories_path": None if placeholder else str(path),
                }
            )
        messages.append(ReadyGroupMessage(group_id=gid, policy_version=version, executions=rows))
    proc = _start(tmp_path, cfg)

    async def drive() -> list[CellEvent]:
        client = CellWorkerClient(f"http://127.0.0.1:{cfg.port}")
        try:
            status = await client.wait_ready(180, alive=lambda: proc.poll() is None)
            assert status.published is not None and status.published.manifest_url is not None
            # The next world generation's port, picked by the core on its own host: free there, not the live world's.
            port = await client.rendezvous_port()
            assert port not in (cfg.training.master_port, cfg.training.coordinator_port, cfg.port)
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            switch = await client.to_training()
            assert [p.name for p in switch.report.phases][:3] == [
                "pause_generation",
                "flush_cache",
                "release_memory",
            ]
            await client.open_batch(0, final=True)  # opened before any group arrives: the core waits for them
            for m in messages:
                await client.add_group(m)
            events, after = [], 0
            while not any(e.kind in ("step_end", "error") for e in events):
                batch = await client.events(after, timeout_s=30)
                events += batch.events
                after = batch.next
            published = await client.publish(1)
            assert published.version == 1 and published.manifest_url == status.published.manifest_url
            back = await client.to_rollout(published)
            assert back.report.weight_version == "1" and (await client.status()).weight_version == "1"
            await client.shutdown()
            return events
        finally:
            await client.aclose()

    try:
        events = asyncio.run(drive())
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    kinds = [e.kind for e in events]
    assert "error" not in kinds, [e.fields for e in events if e.kind == "error"]
    assigned = [e.fields["group_id"] for e in events if e.kind == "group_assigned"]
    assert sorted(assigned) == sorted(m.group_id for m in messages)
    claims = [e for e in events if e.kind == "microstep_claim"]
    assert len(claims) >= 2 and all(e.fields["cell"] == 0 for e in claims)
    for i, e in enumerate(events):  # every claimed micro-step's groups were assigned before the claim
        if e.kind == "microstep_claim":
            earlier = {x.fields["group_id"] for x in events[:i] if x.kind == "group_assigned"}
            assert set(e.fields["groups"]) <= earlier
    report = events[kinds.index("step_end")].fields["report"]
    assert report["policy_version"] == 1 and report["num_executions"] == n * b
    assert sum(report["microsteps_by_cell"].values()) == report["num_microsteps"] >= 2
    assert [e.seq for e in events] == list(range(len(events)))
