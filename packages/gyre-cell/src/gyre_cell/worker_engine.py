"""A cell worker's rollout engine: the torch engine inside the worker process, or an SGLang or vLLM server the worker
starts and supervises (`CellWorkerConfig.sglang`, `CellWorkerConfig.vllm`).

Both are driven the same way by the worker: the role manager talks to the engine over HTTP (`client()`: pause,
flush, release and resume memory), the TITO proxy routes model calls to `url`, and `load` puts published weights
in. They differ in where the weights go:

| published weights | in-process torch engine | SGLang server | vLLM server |
|---|---|---|---|
| the core's own buffer | applied in-process | pushed with `/update_weights_from_tensor` | written to a file, loaded in place |
| Mooncake manifest | pulled next to the engine, applied in-process | pulled by the worker, pushed over HTTP | pulled by the worker, written, loaded |
| checkpoint on disk | loaded in-process | `/update_weights_from_disk` | loaded in place |

A server that exits while the worker runs leaves the cell without its engine: the worker exits too, so the
launcher handles it as any dead cell (a satellite is restarted, a dead core ends the run with one line).
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch

from gyre_cell.client import RolloutEngine
from gyre_cell.sglang_adapter import SGLangServer
from gyre_cell.transfer.engine_loader import mooncake_engine_loader, push_tensors
from gyre_cell.vllm_adapter import VLLMServer
from gyre_cell.worker_types import CellWorkerConfig, PublishedWeights

if TYPE_CHECKING:
    from gyre_cell.transfer.subscriber import WeightSubscriber

log = logging.getLogger(__name__)

PUSH_BUCKET_TENSORS = 64
"""Tensors per `/update_weights_from_tensor` request when weights are pushed to a server."""


class InProcessEngine:
    """The CPU (or CUDA) torch engine in the worker's own process, served at the worker's root URL."""

    def __init__(self, cfg: CellWorkerConfig, url: str, api_key: str | None) -> None:
        from gyre_cell.engine.core import TorchEngine

        self.engine = TorchEngine(cfg.engine)
        self.url, self.api_key, self.weights = url, api_key, cfg.weights

    @property
    def device(self) -> str:
        return str(self.engine.device)

    def start(self, on_exit: Callable[[int], None]) -> None:
        """Nothing to start: the engine was built with the worker."""

    def client(self) -> RolloutEngine:
        return RolloutEngine(self.url, api_key=self.api_key)

    @property
    def weight_version(self) -> str:
        return str(self.engine.weight_version)

    async def load(
        self,
        ref: PublishedWeights,
        own: Mapping[str, torch.Tensor] | None,
        subscriber: WeightSubscriber | None,
    ) -> str:
        return await asyncio.to_thread(self._load, ref, own, subscriber)

    def _load(
        self,
        ref: PublishedWeights,
        own: Mapping[str, torch.Tensor] | None,
        subscriber: WeightSubscriber | None,
    ) -> str:
        if own is not None:  # the core: its own published buffer, served in place where it can be (no copy)
            from gyre_cell.transfer.engine_loader import bind_published

            if not bind_published(self.engine, own, str(ref.version)):
                # its publisher refused NaN/inf (`WeightPublisher.check_finite`)
                self.engine.update_weights(own, weight_version=str(ref.version), check_finite=False)
            return str(ref.version)
        if subscriber is not None:
            from gyre_cell.transfer.engine_loader import pull_into_engine

            return pull_into_engine(self.engine, subscriber)
        self.engine.update_weights_from_disk(_path(ref), weight_version=str(ref.version))
        return str(ref.version)

    def close(self) -> None:
        self.engine.close()


class SupervisedServer:
    """An engine server process the worker starts with the run's engine token, on its own port, and watches: its
    exit ends the worker (the launcher then handles a dead cell). Subclasses: which server, how weights go in."""

    name = "engine"

    def __init__(self, server: SGLangServer | VLLMServer, log_path: Path, version: str) -> None:
        self.server = server
        self.url = server.base_url
        self.log_path = log_path
        self._version = version
        self._serving = self._closing = False

    @property
    def device(self) -> str:
        return f"its {self.name} server's devices"

    def start(self, on_exit: Callable[[int], None]) -> None:
        """Launch the server and wait until it is ready (blocking: the worker's set-up thread); raises if it exits
        first. A server that exits later (unless the worker is closing) calls `on_exit` with its status."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        launched = threading.Event()
        threading.Thread(target=self._parent, args=(launched, on_exit), name=self.name, daemon=True).start()
        launched.wait()
        proc = self.server.proc
        if proc is None:
            raise RuntimeError(f"{self.name} server could not be started; see {self.log_path}")
        if self._wait_ready(proc):
            self._serving = True  # from here on its exit ends the worker (`on_exit`)
            return
        raise RuntimeError(
            f"{self.name} server exited with status {proc.returncode} while starting; see {self.log_path}"
        )

    def _wait_ready(self, proc: subprocess.Popen) -> bool:
        """Until the server answers `/health` (True), or its process exits (False)."""
        with httpx.Client(timeout=5.0) as http:
            while proc.poll() is None:
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)  # polling a starting server: nothing to wait on but its port
        return False

    def _parent(self, launched: threading.Event, on_exit: Callable[[int], None]) -> None:
        """The server's parent thread for its whole life: the child's parent-death signal fires when the thread that
        forked it ends (not the process), so the thread that starts it is the one that waits for it."""
        try:
            self.server.start(log_path=str(self.log_path))
        finally:
            launched.set()
        proc = self.server.proc
        assert proc is not None
        code = proc.wait()
        # an exit during start-up fails `start` instead, naming the log
        if self._serving and not self._closing:
            on_exit(code)

    def client(self) -> RolloutEngine:
        return self.server.client()

    @property
    def weight_version(self) -> str:
        return self._version

    async def load(
        self,
        ref: PublishedWeights,
        own: Mapping[str, torch.Tensor] | None,
        subscriber: WeightSubscriber | None,
    ) -> str:
        """Put published weights into the server: the core's own buffer (`own`), a Mooncake snapshot
        (`subscriber`), else the checkpoint `ref` names; returns the version it serves now."""
        client = self.server.client()
        try:
            self._version = await self._load(client, ref, own, subscriber)
        finally:
            await client.aclose()
        return self._version

    async def _load(
        self,
        client: Any,
        ref: PublishedWeights,
        own: Mapping[str, torch.Tensor] | None,
        subscriber: WeightSubscriber | None,
    ) -> str:
        raise NotImplementedError

    def close(self) -> None:
        self._closing = True
        self.server.stop()


class SupervisedSGLang(SupervisedServer):
    """An SGLang server (or its CPU stand-in): published weights are pushed to it over HTTP."""

    name = "SGLang"

    def __init__(self, cfg: CellWorkerConfig, api_key: str | None, log_path: Path) -> None:
        assert cfg.sglang is not None
        super().__init__(SGLangServer(cfg.sglang, api_key=api_key), log_path, cfg.sglang.weight_version)

    async def _load(
        self,
        client: Any,
        ref: PublishedWeights,
        own: Mapping[str, torch.Tensor] | None,
        subscriber: WeightSubscriber | None,
    ) -> str:
        if own is not None:  # the core: its own buffer, pushed (SGLang has no in-process path)
            await push_tensors(client, own.items(), str(ref.version), bucket_tensors=PUSH_BUCKET_TENSORS)
            return str(ref.version)
        if subscriber is not None:
            return await mooncake_engine_loader(subscriber, bucket_tensors=PUSH_BUCKET_TENSORS)(client)
        await client.update_weights_from_disk(_path(ref), weight_version=str(ref.version))
        return str(ref.version)


class SupervisedVLLM(SupervisedServer):
    """A vLLM server from its own interpreter (`gyre_cell.vllm_launch`): published weights go in by a safetensors
    file next to the cell (the core's buffer, a Mooncake snapshot) or the published checkpoint, loaded in place."""

    name = "vLLM"

    def __init__(self, cfg: CellWorkerConfig, api_key: str | None, log_path: Path) -> None:
        assert cfg.vllm is not None
        super().__init__(VLLMServer(cfg.vllm, api_key=api_key), log_path, cfg.vllm.weight_version)
        self.scratch = Path(cfg.run_dir) / "cells" / f"{log_path.name.split('.')[0]}.vllm-weights"

    def _wait_ready(self, proc: subprocess.Popen) -> bool:
        try:  # /health, then one generated token (a model vLLM cannot run passes /health), then its version
            asyncio.run(self.server.wait_ready())
        except RuntimeError:
            if proc.poll() is not None:
                return False
            raise
        return True

    async def _load(
        self,
        client: Any,
        ref: PublishedWeights,
        own: Mapping[str, torch.Tensor] | None,
        subscriber: WeightSubscriber | None,
    ) -> str:
        if own is None and subscriber is None:
            await client.update_weights_from_disk(_path(ref), weight_version=str(ref.version))
            return str(ref.version)
        self.scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
        if own is not None:  # the core: its own buffer
            version, named = str(ref.version), own.items()
        else:
            snap = await asyncio.to_thread(subscriber.read)
            version, named = str(snap.version), snap.tensors.items()
        await client.load_tensors(named, version, self.scratch)
        return version


def _path(ref: PublishedWeights) -> str:
    if ref.path is None:
        raise ValueError(f"published weights v{ref.version} name no checkpoint path and no manifest")
    return ref.path


RolloutSide = InProcessEngine | SupervisedSGLang | SupervisedVLLM
