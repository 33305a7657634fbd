"""Async client of a cell worker process (the controller's side of ``gyre_cell.worker``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import httpx
from pydantic import BaseModel

from gyre_cell.errors import CellCommandError
from gyre_cell.worker_types import (
    EventBatch,
    LoadResult,
    OpenBatchCommand,
    PublishCommand,
    PublishedWeights,
    ReformCommand,
    RendezvousPort,
    SaveCommand,
    SwitchResult,
    WorkerStatus,
)
from gyre_train.types import ReadyGroupMessage

__all__ = ["KEEPALIVE_EXPIRY_S", "CellCommandError", "CellWorkerClient"]


KEEPALIVE_EXPIRY_S = 2.0
"""The client drops a connection idle this long, well before the worker's uvicorn closes it (its keep-alive; 5 s by
default): reusing a connection the server is closing at that moment fails the command with an empty ReadError
(seen: a demo run ended on `/cell/groups: ReadError` under load)."""


STATUS_POLL_S = 5.0
"""The longest one status poll of `wait_ready` waits for an answer."""


class CellWorkerClient:
    def __init__(self, base_url: str, *, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.engine_url = self.base_url
        """Where the cell's rollout engine serves model calls (its SGLang server's URL, learnt by `wait_ready`)."""
        # the worker's token, if it has one
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self._http = httpx.AsyncClient(
            base_url=f"{self.base_url}/cell",
            timeout=timeout_s,
            headers=headers,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call[M: BaseModel](
        self, method: str, path: str, body: BaseModel | None, out: type[M] | None
    ) -> M | None:
        content = body.model_dump_json() if body is not None else None
        try:
            resp = await self._http.request(
                method, path, content=content, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as exc:
            raise CellCommandError(f"{self.base_url}/cell{path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text.strip()
            raise CellCommandError(f"{self.base_url}/cell{path}: {resp.status_code} {message}")
        return out.model_validate_json(resp.content) if out is not None else None

    async def status(self) -> WorkerStatus:
        return await self._call("GET", "/status", None, WorkerStatus)

    async def wait_ready(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> WorkerStatus:
        """Poll until the cell finished its set-up (gloo rendezvous, model, engine); fail fast if it died.

        Each poll is bounded (`STATUS_POLL_S`): something that accepts on the cell's port and never answers (the
        port taken by another process) must not keep the liveness check from running."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not alive():
                raise CellCommandError(f"cell at {self.base_url} exited during start-up")
            try:
                st = await asyncio.wait_for(self.status(), STATUS_POLL_S)
                if st.error:
                    raise CellCommandError(f"cell {st.cell}: {st.error}")
                if st.ready:
                    self.engine_url = (st.engine_url or self.base_url).rstrip("/")
                    return st
            except TimeoutError:
                pass  # no answer within the poll: look at liveness and the deadline again
            except CellCommandError as exc:
                if "exited" in str(exc) or "set-up failed" in str(exc):
                    raise
            if time.monotonic() > deadline:
                raise CellCommandError(f"cell at {self.base_url} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    async def events(self, after: int, timeout_s: float = 20.0, silence_s: float = 50.0) -> EventBatch:
        """Events after ``after``: a long poll that the cell answers within ``timeout_s`` even when nothing happened.
        A cell that answers nothing for ``silence_s`` (a stopped or hung host sends no reset and no end of file)
        raises httpx's ReadTimeout; the poll is kept at most half of it, so a slow answer is not taken for silence."""
        poll = min(timeout_s, silence_s / 2)
        resp = await self._http.get("/events", params={"after": after, "timeout": poll}, timeout=silence_s)
        resp.raise_for_status()
        return EventBatch.model_validate_json(resp.content)

    async def to_training(self) -> SwitchResult:
        return await self._call("POST", "/to_training", None, SwitchResult)

    async def to_rollout(self, weights: PublishedWeights) -> SwitchResult:
        return await self._call("POST", "/to_rollout", weights, SwitchResult)

    async def join(self) -> None:
        await self._call("POST", "/join", None, None)

    async def add_group(self, message: ReadyGroupMessage) -> None:
        await self._call("POST", "/groups", message, None)

    async def open_batch(self, version: int, final: bool) -> None:
        await self._call("POST", "/open_batch", OpenBatchCommand(version=version, final=final), None)

    async def publish(self, version: int, save: bool = False) -> PublishedWeights:
        return await self._call(
            "POST", "/publish", PublishCommand(version=version, save=save), PublishedWeights
        )

    async def load_weights(self, weights: PublishedWeights) -> LoadResult:
        return await self._call("POST", "/load_weights", weights, LoadResult)

    async def save(self, version: int) -> PublishedWeights:
        return await self._call("POST", "/save", SaveCommand(version=version), PublishedWeights)

    async def rendezvous_port(self) -> int:
        """A port free on the (core) cell's rendezvous host, for a new world generation."""
        return (await self._call("POST", "/rendezvous_port", None, RendezvousPort)).port

    async def reform(self, command: ReformCommand) -> None:
        await self._call("POST", "/reform", command, None)

    async def shutdown(self) -> None:
        with contextlib.suppress(CellCommandError):  # already gone
            await self._call("POST", "/shutdown", None, None)
