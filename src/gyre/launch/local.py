"""The `local` launcher: every process of a run is a subprocess of the controller, on loopback (the default).

Each is started with its own CLI (the same commands a user runs by hand: `gyre-cell worker --config`, `gyre-tito
serve`) in its own process group, logs to RUN/logs/NAME.log, and dies with this process (cells set PDEATHSIG).
`stop()` ends them all: SIGTERM to each group, SIGKILL to what is left after a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass

from gyre.launch.base import Launcher, bin_path, cell_name
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import CellWorkerConfig

__all__ = ["LocalLauncher"]


@dataclass
class LocalLauncher(Launcher):
    kind = "local"

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
            argv = [bin_path("gyre-cell"), "worker", "--config", str(path)]
            proc = self._spawn(name, argv, {"--api-key-fd": self.tokens.engine})
            client = self.worker_client(f"http://{wc.host}:{wc.port}")
            (self.cells if wc.kind == "elastic" else self.standalone).append(client)
            waits.append((name, client, proc))

        async def ready(name: str, client: CellWorkerClient, proc: subprocess.Popen) -> None:
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
            entry[1].wait()
            self._procs.remove(entry)
        path = self.run_dir / "cells" / f"{name}.restart-{attempt}.json"
        path.write_text(wc.model_dump_json(indent=2))
        argv = [bin_path("gyre-cell"), "worker", "--config", str(path)]
        proc = self._spawn(name, argv, {"--api-key-fd": self.tokens.engine})
        client = self.worker_client(f"http://{wc.host}:{wc.port}")
        try:
            await client.wait_ready(timeout_s, alive=lambda: proc.poll() is None)
        except Exception as exc:
            await client.aclose()
            raise self.started_badly(name, exc, attempt) from None
        return client
