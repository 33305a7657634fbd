"""vLLM adapter: start a vLLM server with what Gyre needs (`gyre_cell.vllm_launch`) and drive it as a RolloutEngine.

The role switch maps onto vLLM's development routes (`VLLM_SERVER_DEV_MODE=1`):

| Gyre (SGLang's names) | vLLM |
|---|---|
| pause (abort, wait, keep) | `POST /pause?mode=...` |
| continue_generation | `POST /resume` |
| flush_cache | `POST /reset_prefix_cache` |
| release_memory / resume_memory | `POST /sleep?level=1` / `POST /wake_up` with `enable_sleep_mode` (GPU); else nothing, as on CPU where vLLM's sleep frees nothing |
| update_weights_from_disk | `POST /collective_rpc` `gyre_load_safetensors` (Gyre's worker extension: in place, tied head re-tied), then `/update_weight_version` |
| abort one request | `POST /inference/v1/abort_requests` (`generate-tokens-<rid>`) |

Weights reach vLLM from a safetensors file: the core's own buffer or a Mooncake snapshot is written next to the
cell (`load_tensors`) and loaded in place. vLLM's own transfer engines (NCCL, CUDA IPC) need a GPU on both sides;
on a GPU machine that is the faster path and a later step. A swap that lands while requests run (`/pause?mode=keep`
around it) shows in their `weight_versions` spans, which the proxy records per token.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import torch

from gyre_cell.errors import EngineError

from .client import RolloutEngine
from .server_process import die_with_parent, stop_process
from .vllm_launch import VLLMLaunchConfig, build_launch_command, launch_env

__all__ = ["VLLMEngine", "VLLMServer", "save_weights_file"]


class VLLMServer:
    """A launched vLLM server process (start, wait until it generates, stop); talk to it through `client()`."""

    def __init__(self, cfg: VLLMLaunchConfig, *, api_key: str | None = None) -> None:
        self.cfg = cfg
        self.api_key = api_key
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def start(self, *, log_path: str | None = None) -> None:
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (lives with the process)
        self.proc = subprocess.Popen(
            build_launch_command(self.cfg),
            env=launch_env(self.cfg, self.api_key),
            stdout=out,
            stderr=subprocess.STDOUT,
            # its own session, so that stop() can end its engine core and workers too; its parent's death asks it
            # to shut down (SIGTERM), which ends them: a SIGKILLed API server left both running, holding memory
            start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
        )

    async def wait_ready(self, timeout_s: float = 900.0, poll_s: float = 1.0) -> None:
        """Until the server answers `/health` and then generates one token (a model vLLM's CPU attention cannot run,
        such as head_dim 16, passes `/health` and dies on its first request), then give its weights their version.
        Fails at once if the process exits."""
        client = self.client()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while not await client.health():
                self._check_alive()
                if loop.time() > deadline:
                    raise TimeoutError(f"vLLM server at {self.base_url} not healthy after {timeout_s} s")
                await asyncio.sleep(poll_s)  # a starting server: nothing to wait on but its port
            if not await client.health_generate():
                self._check_alive()
                raise RuntimeError(
                    f"vLLM server at {self.base_url} is up but could not generate; see its log"
                )
            await client.update_weight_version(self.cfg.weight_version)
        finally:
            await client.aclose()

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with code {self.proc.returncode} before it was ready")

    def client(self) -> VLLMEngine:
        return VLLMEngine(self.base_url, api_key=self.api_key, sleep_mode=self.cfg.enable_sleep_mode)

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_process(self.proc, timeout_s, group=True)


class VLLMEngine(RolloutEngine):
    """RolloutEngine over a vLLM server started by `VLLMServer` (scale-out and development routes on)."""

    kind = "vllm"
    supports_kv_migration = False
    """vLLM pins no KV for another engine: a request moved off it is recomputed at its destination."""

    def __init__(self, base_url: str, *, sleep_mode: bool = False, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.sleep_mode = sleep_mode

    async def health_generate(self) -> bool:
        body = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "detokenize": False}}
        try:
            r = await self._http.post("/inference/v1/generate", json=body)
        except httpx.TransportError:
            return False
        return r.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        models = await self._get("/v1/models")
        info = dict(models["data"][0])
        info["weight_version"] = await self.weight_version()
        return info

    async def weight_version(self) -> str:
        return str((await self._get("/weight_info"))["weight_version"])

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = False) -> None:
        if abort_all_requests:
            await self.abort(abort_all=True)
        await self._post("/update_weight_version", {"new_version": version})

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        if abort_all:
            await self._post("/abort_requests", {})  # no ids: every request the server tracks
        else:
            await self._post("/inference/v1/abort_requests", {"request_ids": [f"generate-tokens-{rid}"]})

    async def is_paused(self) -> bool:
        return bool((await self._get("/is_paused"))["is_paused"])

    async def pause(self, mode: str = "abort") -> None:
        await self._http_post_query("/pause", mode=mode)

    async def continue_generation(self) -> None:
        await self._post("/resume")

    async def flush_cache(self) -> None:
        await self._http_post_query("/reset_prefix_cache")

    async def release_memory(self, tags: list[str] | None = None) -> None:
        if self.sleep_mode:
            await self._http_post_query("/sleep", level="1")

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        if self.sleep_mode:
            await self._http_post_query("/wake_up", **({"tags": tags} if tags else {}))

    async def _http_post_query(self, path: str, **params: Any) -> Any:
        return self._decode(await self._http.post(path, params=params or None))

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None) -> None:
        """Load a safetensors file, or every safetensors file of a checkpoint directory, in place. Requests running
        on the server are held (`/pause?mode=keep`) across the swap and continue on the new weights; an engine the
        role switch already paused stays paused."""
        held = not await self.is_paused()
        if held:
            await self._http_post_query("/pause", mode="keep")
        try:
            out = await self._post(
                "/collective_rpc", {"method": "gyre_load_safetensors", "kwargs": {"path": str(model_path)}}
            )
            if not out or not out.get("results") or any(int(n) <= 0 for n in out["results"]):
                raise EngineError(500, f"vLLM loaded no tensors from {model_path}: {out}")
            if weight_version is not None:
                await self._post("/update_weight_version", {"new_version": weight_version})
        finally:
            if held:
                await self._post("/resume")

    async def load_tensors(
        self, named: Iterable[tuple[str, torch.Tensor]], version: str, folder: str | os.PathLike[str]
    ) -> None:
        """Put HF-named tensors in: written to a private safetensors file in `folder` (next to the server), loaded
        in place, removed."""
        path = await asyncio.to_thread(save_weights_file, named, folder)
        try:
            await self.update_weights_from_disk(path, weight_version=version)
        finally:
            Path(path).unlink(missing_ok=True)

    def tensor_update_body(
        self, named: Iterable[tuple[str, torch.Tensor]], *, weight_version: str | None
    ) -> dict[str, Any]:
        raise EngineError(501, "vLLM takes no tensors over HTTP here: use load_tensors (by file)")


def save_weights_file(named: Iterable[tuple[str, torch.Tensor]], folder: str | os.PathLike[str]) -> str:
    """Write HF-named tensors to a new mode-600 safetensors file in `folder`; returns its path. Tied names share
    storage, which safetensors refuses: each later name gets its own copy."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, t in named:
        t = t.detach().to("cpu")
        tensors[name] = t.clone().contiguous() if t.data_ptr() in seen else t.contiguous()
        seen.add(t.data_ptr())
    fd, path = tempfile.mkstemp(prefix="gyre-weights-", suffix=".safetensors", dir=folder)
    os.close(fd)  # mkstemp made it 600; save_file writes it again in place
    save_file(tensors, path)
    return path
