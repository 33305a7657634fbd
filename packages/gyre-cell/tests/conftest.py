"""Shared fixtures: the tiny model on disk and torch engines served over real HTTP on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gyre_cell.engine import EngineConfig, TorchEngine
from gyre_cell.engine.server import create_app
from gyre_cell.ports import free_port
from gyre_cell.tiny_model import TinyModelConfig, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different weights (seed 1)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_b"), TinyModelConfig(seed=1))


class Served:
    def __init__(self, engine: TorchEngine, url: str) -> None:
        self.engine = engine
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=60)

    def hold_after(self, rid: str, k: int) -> threading.Event:
        """The gate: pause the engine in the step that gives request `rid` its k-th token (if that token does not
        end it); the event fires then. The request stays running, its output k tokens long, until the test acts."""
        held = threading.Event()
        engine, check_finish = self.engine, self.engine._check_finish

        def check(req: Any, token: int) -> Any:
            out = check_finish(req, token)
            if req.rid == rid and len(req.output_ids) == k and out is None:
                engine.paused = True  # the engine's lock is held: the loop stops before its next step
                held.set()
            return out

        engine._check_finish = check  # type: ignore[method-assign]
        return held


@contextmanager
def serve(model: Path, **cfg: object) -> Iterator[Served]:
    engine = TorchEngine(EngineConfig(model_path=str(model), **cfg))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    served = Served(engine, f"http://127.0.0.1:{port}")
    try:
        yield served
    finally:
        served.http.close()
        server.should_exit = True
        thread.join(timeout=10)
        engine.close()


@pytest.fixture
def served(tiny_model: Path) -> Iterator[Served]:
    with serve(tiny_model) as s:
        yield s


@pytest.fixture
def served_without_backup(tiny_model: Path) -> Iterator[Served]:
    """An engine that keeps no copy of the weights it releases (`--weights-backup none`): they come back from disk."""
    with serve(tiny_model, weights_backup="none") as s:
        yield s


@pytest.fixture(scope="module")
def shared(tiny_model: Path) -> Iterator[Served]:
    """One engine for tests that leave no state behind."""
    with serve(tiny_model) as s:
        yield s


@pytest.fixture
def serve_engine():
    """`with serve_engine(model, **EngineConfig fields) as served:` for tests that need their own config."""
    return serve


@pytest.fixture
def port_factory():
    return free_port
