"""`RolloutEngine`: one async client interface over every engine that speaks SGLang's HTTP protocol.

Implementations differ only where the engines differ: how `/update_weights_from_tensor` serializes tensors
(SGLang: pickled per-rank handles; torch engine: base64 safetensors) and how the server is launched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx
import orjson
import torch

from gyre_cell.errors import EngineError

from .protocol import (
    AbortBody,
    BeginWeightUpdateBody,
    ContinueBody,
    EndWeightUpdateBody,
    GenerateBody,
    InitGroupBody,
    MemoryTagsBody,
    PauseBody,
    SamplingParams,
    UpdateFromDiskBody,
    UpdateFromDistributedBody,
    UpdateFromTensorBody,
    UpdateWeightVersionBody,
)
from .tensor_codec import SAFETENSORS_LOAD_FORMAT, encode_named_tensors
from .types import GenerationResult
from .weight_sync import dtype_name


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text.strip()
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        if "message" in data:
            return str(data["message"])
    return resp.text.strip()


class RolloutEngine:
    """Async client of one rollout engine at `base_url` (SGLang protocol subset)."""

    kind = "generic"
    supports_kv_migration = False
    """Whether the engine serves Gyre's KV-migration endpoints (`/kv/pin`, `/kv/takeover`, `/kv/ack`, `/kv/release`;
    gyre_cell.engine.kv_migration). Without them a rerouted request is recomputed at its destination."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # the engine's token, if it has one
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout_s, transport=transport, headers=headers
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RolloutEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- plumbing ----------------------------------------------------------------------------
    async def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        resp = await self._http.post(
            path, content=orjson.dumps(body or {}), headers={"content-type": "application/json"}
        )
        return self._decode(resp)

    async def _get(self, path: str, **params: Any) -> Any:
        return self._decode(await self._http.get(path, params=params or None))

    @staticmethod
    def _decode(resp: httpx.Response) -> Any:
        if resp.status_code >= 400:
            raise EngineError(resp.status_code, _error_message(resp))
        if not resp.content:
            return None
        try:
            return resp.json()
        except ValueError:
            return resp.text

    @staticmethod
    def _check_success(data: Any) -> Any:
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(400, str(data.get("message")))
        return data

    # ---- health and info ---------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.TransportError:
            return False

    async def health_generate(self) -> bool:
        try:
            return (await self._http.get("/health_generate")).status_code == 200
        except httpx.TransportError:
            return False

    async def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if await self.health():
                return
            await asyncio.sleep(poll_s)
        raise TimeoutError(f"{self.base_url} not healthy after {timeout_s} s")

    async def model_info(self) -> dict[str, Any]:
        return await self._get("/model_info")

    async def weight_version(self) -> str:
        return str((await self.model_info())["weight_version"])

    async def loads(self) -> dict[str, Any]:
        return await self._get("/v1/loads")

    # ---- generation --------------------------------------------------------------------------
    @staticmethod
    def generate_body(
        input_ids: list[int],
        sampling: SamplingParams | dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        stream: bool = False,
    ) -> dict[str, Any]:
        sp = sampling if isinstance(sampling, SamplingParams) else SamplingParams(**(sampling or {}))
        fields: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sp,
            "return_logprob": return_logprob,
        }
        if rid is not None:
            fields["rid"] = rid
        if stream:
            fields["stream"] = True
        return GenerateBody(**fields).body()

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams | dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerationResult:
        body = self.generate_body(input_ids, sampling, rid=rid, return_logprob=return_logprob)
        return GenerationResult.from_sglang(await self._post("/generate", body))

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling: SamplingParams | dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> AsyncIterator[GenerationResult]:
        """Cumulative snapshots; the last one carries the finish_reason."""
        body = self.generate_body(input_ids, sampling, rid=rid, return_logprob=return_logprob, stream=True)
        async with self._http.stream("POST", "/generate", content=orjson.dumps(body)) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise EngineError(resp.status_code, _error_message(resp))
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    return
                data = orjson.loads(payload)
                if "error" in data:
                    raise EngineError(400, str(data["error"]))
                yield GenerationResult.from_sglang(data)

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        body = AbortBody(abort_all=True) if abort_all else AbortBody(rid=rid or "")
        await self._post("/abort_request", body.body())

    # ---- KV-cache migration (engines with supports_kv_migration) ----------------------------
    def _check_kv(self) -> None:
        if not self.supports_kv_migration:
            raise EngineError(501, f"{self.kind} engine has no KV migration: the request is recomputed")

    async def kv_pin(
        self, *, rid: str | None = None, token_ids: list[int] | None = None, ttl_s: float | None = None
    ) -> dict[str, Any]:
        """Pin a running request's KV (ending it) or a cached prefix; the `KVExport` as a dict."""
        self._check_kv()
        body: dict[str, Any] = {"rid": rid, "token_ids": token_ids}
        if ttl_s is not None:
            body["ttl_s"] = ttl_s
        export = await self._post("/kv/pin", body)
        return dict(export, source_url=self.base_url)

    async def kv_takeover(
        self, export: dict[str, Any], *, token_ids: list[int] | None = None, timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """Ask this (destination) engine to read and install `export`; the `KVTakeoverResult` as a dict, whatever
        its status (installed | refused | failed: recompute)."""
        self._check_kv()
        resp = await self._http.post(
            "/kv/takeover",
            content=orjson.dumps({"export": export, "token_ids": token_ids, "timeout_s": timeout_s}),
            headers={"content-type": "application/json"},
        )
        if resp.status_code in (200, 409, 502):
            return resp.json()
        raise EngineError(resp.status_code, _error_message(resp))

    async def kv_release(self, migration_id: str) -> None:
        self._check_kv()
        await self._post("/kv/release", {"migration_id": migration_id})

    async def pause(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", PauseBody(mode=mode).body())

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", ContinueBody().body())

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    # ---- memory ------------------------------------------------------------------------------
    async def release_memory(self, tags: list[str] | None = None) -> None:
        body = MemoryTagsBody(tags=tags).body() if tags is not None else {}
        await self._post("/release_memory_occupation", body)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        body = MemoryTagsBody(tags=tags).body() if tags is not None else {}
        await self._post("/resume_memory_occupation", body)

    # ---- weights -----------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None) -> None:
        body = UpdateFromDiskBody(model_path=model_path)
        if weight_version is not None:
            body = UpdateFromDiskBody(model_path=model_path, weight_version=weight_version)
        self._check_success(await self._post("/update_weights_from_disk", body.body()))

    async def begin_weight_update(self) -> None:
        self._check_success(
            await self._post("/begin_weight_update", BeginWeightUpdateBody(selector="all").body())
        )

    async def end_weight_update(self) -> None:
        self._check_success(await self._post("/end_weight_update", EndWeightUpdateBody().body()))

    @contextlib.asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[None]:
        """SGLang 0.5.23: from_tensor / from_distributed updates must sit inside begin ... end."""
        await self.begin_weight_update()
        try:
            yield
        finally:
            await self.end_weight_update()

    def tensor_update_body(
        self, named: Iterable[tuple[str, torch.Tensor]], *, weight_version: str | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    async def update_weights_from_tensor(
        self, named: Iterable[tuple[str, torch.Tensor]], *, weight_version: str | None = None
    ) -> None:
        body = self.tensor_update_body(named, weight_version=weight_version)
        self._check_success(await self._post("/update_weights_from_tensor", body))

    @staticmethod
    def init_group_body(
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        return InitGroupBody(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        ).body()

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        body = self.init_group_body(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        self._check_success(await self._post("/init_weights_update_group", body))

    @staticmethod
    def distributed_update_body(
        named_meta: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        meta = list(named_meta)
        fields: dict[str, Any] = {
            "names": [n for n, _, _ in meta],
            "dtypes": [dtype_name(d) for _, d, _ in meta],
            "shapes": [list(s) for _, _, s in meta],
            "group_name": group_name,
        }
        if weight_version is not None:
            fields["weight_version"] = weight_version
        return UpdateFromDistributedBody(**fields).body()

    async def update_weights_from_distributed(
        self,
        named_meta: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
    ) -> None:
        """Announce the tensors; the trainer must broadcast them (weight_sync.send_weights) concurrently."""
        body = self.distributed_update_body(named_meta, group_name=group_name, weight_version=weight_version)
        self._check_success(await self._post("/update_weights_from_distributed", body))

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = False) -> None:
        body = UpdateWeightVersionBody(new_version=version, abort_all_requests=abort_all_requests).body()
        self._check_success(await self._post("/update_weight_version", body))


class TorchEngineClient(RolloutEngine):
    """Client of the Gyre torch engine (`gyre-cell engine serve`)."""

    kind = "torch"
    supports_kv_migration = True

    def tensor_update_body(
        self, named: Iterable[tuple[str, torch.Tensor]], *, weight_version: str | None
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "serialized_named_tensors": [encode_named_tensors(list(named))],
            "load_format": SAFETENSORS_LOAD_FORMAT,
        }
        if weight_version is not None:
            fields["weight_version"] = weight_version
        return UpdateFromTensorBody(**fields).body()
