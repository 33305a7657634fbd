"""The `local` launcher: every process of a run is a subprocess of the controller, on loopback (the default).

Each is started with its own CLI (the same commands a user runs by hand: `gyre-cell worker --config`, `gyre-tito
serve`) in its own process group, logs to RUN/logs/NAME.log, and dies with this process (cells set PDEATHSIG).
`stop()` ends them all: SIGTERM to each group, SIGKILL to what is left after a grace period.

Cell workers on CPU are forked from a zygote (`gyre_cell.zygote`) that imported torch, transformers and the worker's
code once, started by `warm_up` while the controller is still starting: three workers on two cores then start in
seconds, not the ~30 s their own imports take. A worker's command line, process group, log, token fd and exit status
are those a plain start gives it. Workers on CUDA, or all of them if the zygote cannot start, start plainly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gyre.config import RunConfig
from gyre.launch.base import Launcher, bin_path, cell_name, child_environment
from gyre_cell.errors import ZygoteError
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import CellWorkerConfig
from gyre_cell.zygote import WORKER_MODULES, ForkedProcess, Zygote

__all__ = ["LocalLauncher"]

log = logging.getLogger("gyre.launch")


@dataclass
class LocalLauncher(Launcher):
    kind = "local"
    _zygote: Zygote | None = None
    _zygote_failed: bool = False

    def warm_up(self, cfg: RunConfig) -> None:
        if cfg.cluster.device == "cpu":
            self._start_zygote()

    def _start_zygote(self) -> Zygote | None:
        if self._zygote is None and not self._zygote_failed:
            try:
                self._zygote = Zygote.start(WORKER_MODULES, child_environment())
            except OSError as exc:
                self._zygote_unusable(exc)
        return self._zygote

    def _zygote_unusable(self, exc: BaseException) -> None:
        log.warning(
            "cell workers start without a zygote (%s): each imports torch and transformers itself", exc
        )
        self._zygote_failed = True
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None

    async def _spawn_worker(
        self, name: str, wc: CellWorkerConfig, path: Path
    ) -> subprocess.Popen | ForkedProcess:
        """`gyre-cell worker --config PATH`: forked from the zygote when the worker runs on CPU only."""
        argv = [bin_path("gyre-cell"), "worker", "--config", str(path)]
        secrets = {"--api-key-fd": self.tokens.engine}
        devices = [wc.engine.device] + ([wc.training.device] if wc.training is not None else [])
        zygote = self._start_zygote() if all(d == "cpu" for d in devices) else None
        if zygote is not None:
            try:
                await asyncio.to_thread(zygote.wait_ready)
                logfile = str(self.log_path(name))
                proc = zygote.spawn(
                    "gyre_cell.cli:main",
                    argv[1:],
                    title=" ".join(["gyre-cell", *argv[1:]]),
                    env=child_environment(),
                    cwd=os.getcwd(),
                    stdout=logfile,
                    stderr=logfile,
                    secrets=secrets,
                )
            except ZygoteError as exc:
                self._zygote_unusable(exc)
            else:
                self._procs.append((name, proc))
                self._write_services()
                return proc
        return self._spawn(name, argv, secrets)

    def stop(self, grace_s: float | None = None) -> None:
        super().stop(grace_s)
        if self._zygote is not None:  # after its children: they die with it
            self._zygote.close()
            self._zygote = None

    async def start_cells(self, configs: list[CellWorkerConfig], timeout_s: float = 300.0) -> None:
        """Start every worker, then wait until each finished its set-up (the gloo rendezvous needs all K)."""
        cfg_dir = self.run_dir / "cells"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        waits = []
        for wc in configs:
            if wc.kind == "elastic":
                self._cell_configs[wc.cell] = wc
            name = cell_name(wc)
            path = cfg_dir / f"{name}.json"
            path.write_text(wc.model_dump_json(indent=2))
            proc = await self._spawn_worker(name, wc, path)
            client = self.worker_client(f"http://{wc.host}:{wc.port}")
            (self.cells if wc.kind == "elastic" else self.standalone).append(client)
            waits.append((name, client, proc))

        async def ready(name: str, client: CellWorkerClient, proc: subprocess.Popen | ForkedProcess) -> None:
            try:
                await client.wait_ready(timeout_s, alive=lambda: proc.poll() is None)
            except Exception as exc:
                raise self.started_badly(name, exc) from None

        await asyncio.gather(*(ready(*w) for w in waits))

    async def _restart_cell(
        self, cell: int, wc: CellWorkerConfig, attempt: int, timeout_s: float
    ) -> CellWorkerClient:
        """The same command on the same port, from RUN/cells/cell-I.restart-N.json. A worker taken as dead that still
        runs (it hung) is killed first: it holds the port."""
        name = cell_name(wc)
        for entry in [e for e in self._procs if e[0] == name]:
            if entry[1].poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(entry[1].pid, signal.SIGKILL)
            # A forked worker's end is reported by the zygote's reader thread: wait for it off the event loop.
            await asyncio.to_thread(entry[1].wait)
            self._procs.remove(entry)
        path = self.run_dir / "cells" / f"{name}.restart-{attempt}.json"
        path.write_text(wc.model_dump_json(indent=2))
        proc = await self._spawn_worker(name, wc, path)
        client = self.worker_client(f"http://{wc.host}:{wc.port}")
        try:
            await client.wait_ready(timeout_s, alive=lambda: proc.poll() is None)
        except Exception as exc:
            await client.aclose()
            raise self.started_badly(name, exc, attempt) from None
        return client
