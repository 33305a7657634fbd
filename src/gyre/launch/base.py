"""What every launcher shares: the interface, the cell configs, the proxy subprocess and stopping processes."""

from __future__ import annotations

import asyncio
import contextlib
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

from gyre.config import RunConfig
from gyre_cell.engine.config import EngineConfig
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import CellTrainingConfig, CellWorkerConfig

__all__ = ["Launcher", "ServiceError", "cell_configs", "free_port"]


class ServiceError(RuntimeError):
    """A service did not start; the message names it and points at its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bin_path(name: str) -> str:
    """The console script installed beside this interpreter (works in a venv without activating it)."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def cell_name(wc: CellWorkerConfig) -> str:
    return f"cell-{wc.cell}" if wc.kind == "elastic" else f"standalone-{wc.cell}"


def cell_configs(cfg: RunConfig, run_dir: Path, model_dir: Path) -> list[CellWorkerConfig]:
    """Every worker's config on loopback: the K elastic cells first (index = cell), then the standalone engines.

    A launcher that places workers on other hosts rewrites the addresses (`host`, `port`, `mooncake`, the training
    rendezvous) once it knows each worker's node; everything else is the same for every launcher.
    """
    c, s, t = cfg.cluster, cfg.scheduler, cfg.train
    master, coordinator = free_port(), free_port()
    out = []
    for i in range(c.cells + c.standalone_engines):
        elastic = i < c.cells
        index = i if elastic else i - c.cells
        engine = EngineConfig(
            model_path=str(model_dir), device="cpu", weight_version="0", seed=t.seed + i,
            cpu_threads=c.cpu_threads_per_cell,
        )  # fmt: skip
        training = None
        if elastic:
            training = CellTrainingConfig(
                group_size=s.N, batch_groups=s.B, steps_per_burst=s.mu, lr=t.lr, dtype=t.dtype,
                max_grad_norm=t.max_grad_norm, tokens_per_shard=t.tokens_per_shard,
                temperature=cfg.model.temperature, loss=t.loss, master_port=master, coordinator_port=coordinator,
                claim_timeout_s=t.claim_timeout_s, snapshot=cfg.weights.snapshot, dump_batches=t.dump_batches,
                hold_core_for_join=t.hold_core_for_join, backend=t.backend, tensor_parallel=t.tensor_parallel,
                pipeline_parallel=t.pipeline_parallel, context_parallel=t.context_parallel,
                expert_parallel=t.expert_parallel,
            )  # fmt: skip
        out.append(
            CellWorkerConfig(
                cell=index,
                kind="elastic" if elastic else "standalone",
                num_cells=c.cells,
                run_dir=str(run_dir),
                port=free_port(),
                engine=engine,
                training=training,
                weights=cfg.weights.transport,
                mooncake=cfg.weights.mooncake,
                cpu_threads=c.cpu_threads_per_cell,
            )
        )
    return out


@dataclass
class Launcher:
    """Starts a run's cell workers, standalone engines and proxy; stops them all.

    Subclasses implement `start_cells` (and extend `stop` for what they start other than subprocesses). The proxy is
    a subprocess on the controller's machine for every launcher: the agents it serves run there.
    """

    run_dir: Path
    cells: list[CellWorkerClient] = field(default_factory=list)
    standalone: list[CellWorkerClient] = field(default_factory=list)
    proxy_url: str = ""
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    _procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    kind = "base"

    # ---- interface -----------------------------------------------------------------------------------------------
    async def start_cells(self, configs: list[CellWorkerConfig], timeout_s: float = 300.0) -> None:
        """Start every worker of `configs` (from `cell_configs`), then wait until each finished its set-up."""
        raise NotImplementedError

    @property
    def engine_urls(self) -> list[str]:
        return [c.base_url for c in self.cells + self.standalone]

    def log_path(self, name: str) -> Path:
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        return log_dir / f"{name}.log"

    # ---- subprocesses --------------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.log_path(name).open("ab")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self._procs.append((name, proc))
        return proc

    async def start_proxy(
        self, tokenizer_dir: Path, timeout_s: float = 120.0, temperature: float | None = None
    ) -> None:
        port = free_port()
        # the proxy writes exports only under its store or an --export-dir: runner.export writes to trajectories/
        argv = [bin_path("gyre-tito"), "serve", "--tokenizer", str(tokenizer_dir), "--store",
                str(self.run_dir / "records"), "--port", str(port),
                "--export-dir", str(self.run_dir / "trajectories")]  # fmt: skip
        for url in self.engine_urls:
            argv += ["--engine", url]
        if temperature is not None:  # every call samples at the trainer's temperature (sampling policy: pin)
            argv += ["--temperature", str(temperature)]
        proc = self._spawn("proxy", argv, env={"GYRE_TITO_ADMIN_TOKEN": self.admin_token})
        self.proxy_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise ServiceError(
                        f"proxy exited with {proc.returncode}; see {self.run_dir}/logs/proxy.log"
                    )
                try:
                    if (await client.get(f"{self.proxy_url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        raise ServiceError(f"proxy not healthy after {timeout_s:.0f} s; see {self.run_dir}/logs/proxy.log")

    async def aclose_clients(self) -> None:
        for client in self.cells + self.standalone:
            await client.aclose()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process group, SIGKILL what is still alive after `grace_s`; idempotent."""
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in reversed(self._procs):
            try:
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
