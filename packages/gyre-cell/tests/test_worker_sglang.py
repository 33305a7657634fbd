"""A cell worker whose rollout engine is an SGLang server it starts and supervises (`CellWorkerConfig.sglang`).

SGLang cannot run here, so the server is `gyre_cell.testing.sglang_stand_in`: a separate process started with SGLang's
flags, its token passed by SGLang's `--config` file, serving the CPU torch engine. Everything between the worker
and its server is real: the process, the port, the token, role switches, weight pushes, the watch.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from gyre_cell.engine.config import EngineConfig
from gyre_cell.errors import CellCommandError
from gyre_cell.ports import free_ports
from gyre_cell.sglang_adapter import STAND_IN, SGLangLaunchConfig
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import CellTrainingConfig, CellWorkerConfig, PublishedWeights
from gyre_train.testing.synthetic import build_tiny_model

TOKEN = "engine-token-7f3a9c"


def _start(tmp: Path, cfg: CellWorkerConfig) -> subprocess.Popen:
    path = tmp / f"{cfg.kind}-{cfg.cell}.json"
    path.write_text(cfg.model_dump_json())
    key = tmp / "engine.key"
    key.write_text(TOKEN)
    key.chmod(0o600)
    log = (tmp / f"{cfg.kind}-{cfg.cell}.log").open("wb")
    argv = [
        sys.executable,
        "-m",
        "gyre_cell.cli",
        "worker",
        "--config",
        str(path),
        "--api-key-file",
        str(key),
    ]
    return subprocess.Popen(argv, stdout=log, stderr=log)


def _server(model: str, port: int, **kw) -> SGLangLaunchConfig:
    return SGLangLaunchConfig(model_path=model, port=port, weight_version="0", module=STAND_IN, **kw)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_a_worker_serves_rollout_on_its_sglang_server_and_exits_when_the_server_dies(tmp_path, model):
    worker_port, server_port = free_ports(2)
    cfg = CellWorkerConfig(
        cell=0,
        kind="standalone",
        num_cells=1,
        run_dir=str(tmp_path),
        port=worker_port,
        engine=EngineConfig(model_path=model, device="cpu"),
        sglang=_server(model, server_port),
    )
    proc = _start(tmp_path, cfg)

    async def drive() -> None:
        client = CellWorkerClient(f"http://127.0.0.1:{worker_port}", api_key=TOKEN)
        try:
            status = await client.wait_ready(120, alive=lambda: proc.poll() is None)
            assert status.engine_url == client.engine_url == f"http://127.0.0.1:{server_port}"
            auth = {"authorization": f"Bearer {TOKEN}"}
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
                served = await http.post(f"{client.engine_url}/generate", json=body, headers=auth)
                assert served.status_code == 200 and len(served.json()["output_ids"]) == 3
                assert (await http.post(f"{client.engine_url}/generate", json=body)).status_code == 401
                assert (await http.get(f"{client.base_url}/health")).status_code == 200
                # /cell: the token too
                assert (await http.get(f"{client.base_url}/cell/status")).status_code == 401
                # A checkpoint on disk goes in through the server's own endpoint.
                loaded = await client.load_weights(PublishedWeights(version=3, path=model))
                assert loaded.version == "3" and (await client.status()).weight_version == "3"
                info = await http.get(f"{client.engine_url}/model_info", headers=auth)
                assert info.json()["weight_version"] == "3"
        finally:
            await client.aclose()

    try:
        asyncio.run(drive())
        (server,) = psutil.Process(proc.pid).children()
        argv = " ".join(server.cmdline())
        assert "gyre_cell.testing.sglang_stand_in" in argv and "--config" in argv and TOKEN not in argv
        assert TOKEN not in "".join(server.environ().values())
        os.kill(server.pid, signal.SIGKILL)  # the server dies: the cell has no engine, the worker leaves
        assert proc.wait(timeout=60) == 1
    finally:
        proc.kill()
    log = (tmp_path / "standalone-0.log").read_text()
    assert "its SGLang server exited with status -9; the worker exits" in log
    assert (tmp_path / "logs" / "standalone-0.sglang.log").read_text().strip()  # the server's own log


def test_the_core_pushes_its_published_weights_to_its_sglang_server_across_a_role_switch(tmp_path, model):
    """The core trains nothing here: it switches to training (the server pauses, flushes, releases its memory),
    publishes its current weights as version 1 and switches back: its own buffer is pushed over HTTP."""
    worker_port, server_port, master, coordinator = free_ports(4)
    cfg = CellWorkerConfig(
        cell=0,
        num_cells=1,
        run_dir=str(tmp_path),
        port=worker_port,
        engine=EngineConfig(model_path=model, device="cpu"),
        sglang=_server(model, server_port),
        training=CellTrainingConfig(
            group_size=2, batch_groups=1, lr=1e-3, master_port=master, coordinator_port=coordinator
        ),
    )
    proc = _start(tmp_path, cfg)

    async def drive() -> None:
        client = CellWorkerClient(f"http://127.0.0.1:{worker_port}", api_key=TOKEN)
        try:
            status = await client.wait_ready(180, alive=lambda: proc.poll() is None)
            switch = await client.to_training()
            assert [p.name for p in switch.report.phases][:3] == [
                "pause_generation",
                "flush_cache",
                "release_memory",
            ]
            published = await client.publish(1)
            back = await client.to_rollout(published)
            assert back.report.weight_version == "1" and back.weights_seconds > 0
            async with httpx.AsyncClient(timeout=60) as http:
                auth = {"authorization": f"Bearer {TOKEN}"}
                info = await http.get(f"{status.engine_url}/model_info", headers=auth)
                assert info.json()["weight_version"] == "1"
                body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
                served = await http.post(f"{status.engine_url}/generate", json=body, headers=auth)
                assert served.status_code == 200  # its memory is back: it serves again
            await client.shutdown()
        finally:
            await client.aclose()

    try:
        asyncio.run(drive())
        assert proc.wait(timeout=60) == 0
        assert not psutil.pid_exists(proc.pid)
    finally:
        proc.kill()


def test_a_server_that_cannot_start_fails_the_worker_set_up_with_its_log(tmp_path, model):
    worker_port, server_port = free_ports(2)
    server = _server(model, server_port).model_copy(update={"module": "gyre_cell.no_such_server"})
    cfg = CellWorkerConfig(
        cell=1,
        kind="standalone",
        num_cells=1,
        run_dir=str(tmp_path),
        port=worker_port,
        engine=EngineConfig(model_path=model, device="cpu"),
        sglang=server,
    )
    proc = _start(tmp_path, cfg)

    async def drive() -> None:
        client = CellWorkerClient(f"http://127.0.0.1:{worker_port}", api_key=TOKEN)
        try:
            with pytest.raises(
                CellCommandError, match="set-up failed: RuntimeError: SGLang server exited with st"
            ):
                await client.wait_ready(120, alive=lambda: proc.poll() is None)
        finally:
            await client.aclose()

    try:
        asyncio.run(drive())
        assert (
            "No module named gyre_cell.no_such_server"
            in (tmp_path / "logs" / "standalone-1.sglang.log").read_text()
        )
    finally:
        proc.kill()
