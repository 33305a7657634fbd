"""The execution runner: creates an execution's credential, workspace and harness process at launch, ends it once.

A launched execution ends exactly once with one outcome: `completed` (the harness exited 0), `failed` (it exited
non-zero), `harness_timeout` (the task's own deadline passed: the harness is stopped and its work is still assessed)
or `cancelled` (the controller withdrew it). The harness is a black box in its own process group; the runner only
sees its exit status and the workspace it leaves behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["ExecutionRunner", "Finished"]


@dataclass(frozen=True, slots=True)
class Finished:
    execution_id: str
    outcome: str
    workspace: Path
    launched_at: float
    """Unix time of launch: the overall budget runs from here."""


class ExecutionRunner:
    def __init__(self, run_dir: Path, proxy_url: str, admin_token: str, agent_argv: list[str],
                 harness_timeout_s: float) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.proxy_url = proxy_url
        self.admin = httpx.AsyncClient(
            base_url=f"{proxy_url}/admin", headers={"Authorization": f"Bearer {admin_token}"}, timeout=60.0
        )
        self.agent_argv = agent_argv
        self.harness_timeout_s = harness_timeout_s
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._cancelled: set[str] = set()
        # Registration, reroutes and the end of one execution are serialized: a reroute decided while the
        # registration is still in flight must not be lost (the harness would call a draining engine), and a
        # reroute that arrives after the end has nothing to move.
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._routes: dict[str, str] = {}
        self._state: dict[str, str] = {}

    async def aclose(self) -> None:
        await self.admin.aclose()

    async def admin_call(self, method: str, path: str, body: dict | None = None) -> dict:
        response = await self.admin.request(method, path, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"proxy admin {method} {path}: {response.status_code} {response.text}")
        return response.json()

    async def run(self, execution_id: str, group_id: str, engine_url: str, task: str) -> Finished:
        """Launch the harness for one execution and wait for its single ending."""
        async with self._locks[execution_id]:
            route = self._routes.setdefault(execution_id, engine_url)
            body = {"execution_id": execution_id, "group_id": group_id, "route": [route]}
            registered = await self.admin_call("POST", "/executions", body)
            self._state[execution_id] = "registered"
        workspace = self.run_dir / "workspaces" / execution_id
        workspace.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "OPENAI_BASE_URL": f"{self.proxy_url}/v1",
            "OPENAI_API_KEY": registered["credential"],
        }
        log = (self.run_dir / "logs" / "agents").joinpath(f"{execution_id}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        launched_at = time.time()
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gyre.agent", "--workspace", str(workspace), "--task", task,
                *self.agent_argv, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
            self._procs[execution_id] = proc
            try:
                code = await asyncio.wait_for(proc.wait(), timeout=self.harness_timeout_s)
                outcome = "completed" if code == 0 else "failed"
            except TimeoutError:
                self._kill(proc)
                await proc.wait()
                outcome = "harness_timeout"
            finally:
                self._procs.pop(execution_id, None)
        if execution_id in self._cancelled:
            outcome = "cancelled"
        async with self._locks[execution_id]:
            self._state[execution_id] = "ended"
            await self.admin_call("POST", f"/executions/{execution_id}/end")
        return Finished(execution_id, outcome, workspace, launched_at)

    def cancel(self, execution_id: str) -> None:
        """Stop a running harness; its run() returns with outcome `cancelled`."""
        self._cancelled.add(execution_id)
        proc = self._procs.get(execution_id)
        if proc is not None:
            self._kill(proc)

    def cancel_all(self) -> None:
        for execution_id in list(self._procs):
            self.cancel(execution_id)

    async def reroute(self, execution_id: str, engine_url: str) -> None:
        async with self._locks[execution_id]:
            self._routes[execution_id] = engine_url
            if self._state.get(execution_id) == "registered":
                await self.admin_call("PUT", f"/executions/{execution_id}/route", {"engines": [engine_url]})

    async def export(self, execution_id: str, j_max: int, seed: int) -> list[dict]:
        path = self.run_dir / "trajectories" / f"{execution_id}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"j_max": j_max, "seed": seed, "path": str(path)}
        return (await self.admin_call("POST", f"/executions/{execution_id}/export", body))["trajectories"]

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
