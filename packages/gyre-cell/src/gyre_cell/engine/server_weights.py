"""Weight-update endpoints of the torch engine (SGLang shapes: `{"success", "message"}`, 400 on failure)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gyre_cell.errors import EngineStateError, WeightError

from ..protocol import (
    BeginWeightUpdateBody,
    DestroyGroupBody,
    EndWeightUpdateBody,
    InitGroupBody,
    UpdateFromDiskBody,
    UpdateFromDistributedBody,
    UpdateFromTensorBody,
    UpdateWeightVersionBody,
)
from ..tensor_codec import SAFETENSORS_LOAD_FORMAT, decode_named_tensors
from ..weight_sync import GroupSpec, join_group, receive_weights
from .core import TorchEngine


def _result(ok: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)


def add_weight_routes(app: FastAPI, engine: TorchEngine, parse_body: Callable[..., Awaitable[Any]]) -> None:
    groups: dict[str, dist.ProcessGroup] = {}
    app.state.weight_groups = groups

    async def guarded(fn: Callable[[], Any], ok_message: str, **extra: Any) -> JSONResponse:
        try:
            out = await asyncio.to_thread(fn)
        except (WeightError, EngineStateError, ValueError, RuntimeError) as e:
            return _result(False, str(e), **extra)
        return _result(True, ok_message.format(out=out), **extra)

    @app.post("/update_weights_from_disk")
    async def from_disk(request: Request) -> JSONResponse:
        b = await parse_body(request, UpdateFromDiskBody)
        return await guarded(
            lambda: engine.update_weights_from_disk(
                b.model_path,
                weight_version=b.weight_version,
                flush_cache=b.flush_cache,
                abort_all_requests=b.abort_all_requests,
            ),
            "Succeeded to update model weights ({out} tensors).",
            num_paused_requests=0,
        )

    @app.post("/update_weights_from_tensor")
    async def from_tensor(request: Request) -> JSONResponse:
        b = await parse_body(request, UpdateFromTensorBody)

        def run() -> int:
            engine.check_update_session()
            if b.load_format not in (None, SAFETENSORS_LOAD_FORMAT):
                raise WeightError(
                    f"load_format {b.load_format!r} not supported: the torch engine takes base64 safetensors "
                    f"(load_format null or {SAFETENSORS_LOAD_FORMAT!r})"
                )
            if len(b.serialized_named_tensors) != 1:
                raise WeightError(
                    "the torch engine has one rank: send exactly one serialized_named_tensors entry"
                )
            named = decode_named_tensors(b.serialized_named_tensors[0])
            return engine.update_weights(
                named,
                weight_version=b.weight_version,
                flush_cache=b.flush_cache,
                abort_all_requests=b.abort_all_requests,
            )

        return await guarded(run, "Succeeded to update {out} tensors.")

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> JSONResponse:
        b = await parse_body(request, InitGroupBody)

        def run() -> None:
            if b.backend != "gloo":
                raise WeightError(f"backend {b.backend!r} not supported by the torch engine (use 'gloo')")
            if b.group_name in groups:
                raise WeightError(f"group {b.group_name!r} already exists")
            spec = GroupSpec(
                master_address=b.master_address,
                master_port=b.master_port,
                world_size=b.world_size,
                group_name=b.group_name,
            )
            groups[b.group_name] = join_group(spec, rank=b.rank_offset)

        return await guarded(run, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> JSONResponse:
        b = await parse_body(request, DestroyGroupBody)
        if groups.pop(b.group_name, None) is None:
            return _result(False, f"unknown group {b.group_name!r}")
        return _result(True, "Succeeded to destroy custom process group.")

    @app.post("/update_weights_from_distributed")
    async def from_distributed(request: Request) -> JSONResponse:
        b = await parse_body(request, UpdateFromDistributedBody)

        def run() -> int:
            engine.check_update_session()
            pg = groups.get(b.group_name)
            if pg is None:
                raise WeightError(f"unknown group {b.group_name!r}: call /init_weights_update_group first")
            for name, shape in zip(b.names, b.shapes, strict=False):
                if tuple(shape) != engine.weights.expected_shape(name):
                    raise WeightError(f"shape mismatch for {name!r}: {shape}")
            named = receive_weights(pg, b.names, b.dtypes, b.shapes)
            return engine.update_weights(
                named,
                weight_version=b.weight_version,
                flush_cache=b.flush_cache,
                abort_all_requests=b.abort_all_requests,
            )

        return await guarded(run, "Succeeded to update {out} tensors.")

    @app.post("/begin_weight_update")
    async def begin(request: Request) -> JSONResponse:
        await parse_body(request, BeginWeightUpdateBody)
        return await guarded(engine.begin_weight_update, "Weight update session opened.")

    @app.post("/end_weight_update")
    async def end(request: Request) -> JSONResponse:
        await parse_body(request, EndWeightUpdateBody)
        return await guarded(engine.end_weight_update, "Weight update session closed.")

    @app.post("/update_weight_version")
    async def update_version(request: Request) -> JSONResponse:
        b = await parse_body(request, UpdateWeightVersionBody)
        await asyncio.to_thread(
            engine.set_weight_version, b.new_version, abort_all_requests=b.abort_all_requests
        )
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {b.new_version}",
                "new_version": b.new_version,
            }
        )
