"""Local service processes of a run: rollout engines (one per cell) and the TITO proxy, as subprocesses on loopback.

Each service is started with its own CLI (the same commands a user runs by hand), logs to RUN/logs/NAME.log, and is
waited on through its health endpoint. Production runs place the same commands in Ray actors; the interfaces between
them are HTTP either way.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = ["LocalServices", "ServiceError", "free_port"]


class ServiceError(RuntimeError):
    """A service did not start; the message names it and points at its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """The console script installed beside this interpreter (works in a venv without activating it)."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


@dataclass
class LocalServices:
    run_dir: Path
    engine_urls: list[str] = field(default_factory=list)
    proxy_url: str = ""
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    _procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = (log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self._procs.append((name, proc))

    async def _wait_healthy(self, name: str, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        proc = dict(self._procs)[name]
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise ServiceError(
                        f"{name} exited with {proc.returncode}; see {self.run_dir}/logs/{name}.log"
                    )
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        raise ServiceError(f"{name} not healthy after {timeout_s:.0f} s; see {self.run_dir}/logs/{name}.log")

    async def start_engines(self, model_dir: Path, count: int, seed: int, timeout_s: float = 180.0) -> None:
        for cell in range(count):
            port = free_port()
            self._spawn(
                f"engine-{cell}",
                [_bin("gyre-cell"), "engine", "serve", "--model", str(model_dir), "--port", str(port),
                 "--device", "cpu", "--weight-version", "0", "--seed", str(seed + cell)],
            )  # fmt: skip
            self.engine_urls.append(f"http://127.0.0.1:{port}")
        await asyncio.gather(
            *(self._wait_healthy(f"engine-{i}", url, timeout_s) for i, url in enumerate(self.engine_urls))
        )

    async def start_proxy(self, tokenizer_dir: Path, timeout_s: float = 120.0) -> None:
        port = free_port()
        # the proxy writes exports only under its store or an --export-dir: runner.export writes to trajectories/
        argv = [_bin("gyre-tito"), "serve", "--tokenizer", str(tokenizer_dir), "--store",
                str(self.run_dir / "records"), "--port", str(port),
                "--export-dir", str(self.run_dir / "trajectories")]  # fmt: skip
        for url in self.engine_urls:
            argv += ["--engine", url]
        self._spawn("proxy", argv, env={"GYRE_TITO_ADMIN_TOKEN": self.admin_token})
        self.proxy_url = f"http://127.0.0.1:{port}"
        await self._wait_healthy("proxy", self.proxy_url, timeout_s)

    def stop(self) -> None:
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
