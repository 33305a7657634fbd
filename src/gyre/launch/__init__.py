"""Launchers: where a run's processes live. One interface (`Launcher`), two implementations.

- `local` (`LocalLauncher`, the default): every cell worker, standalone engine and the TITO proxy is a subprocess of
  the controller on this machine, bound to loopback. Needs no Ray.
- `ray` (`RayLauncher`, `[launcher] kind = "ray"` or `gyre run --ray ADDRESS`): one placement group per cell (its
  CPUs, or its GPUs), each cell worker a Ray actor running the same worker code (`gyre_cell.worker`), bound to its
  node's own address; the addresses are exchanged through the controller. Needs `gyre-rl[ray]`.

Both hand the controller the same things: one `CellWorkerClient` per elastic cell and per standalone engine, the
proxy URL and its admin token. Imports are lazy: `gyre.launch` never imports Ray unless the ray launcher is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gyre.launch.base import Launcher, ServiceError, free_port

if TYPE_CHECKING:
    from gyre.config import RunConfig
    from gyre_tito.engine_client import EngineAPI

__all__ = ["Launcher", "ServiceError", "free_port", "make_launcher"]


def make_launcher(cfg: RunConfig, run_dir: Path | None = None) -> Launcher:
    """The launcher `cfg.launcher.kind` names (its run directory is set again by `gyre.run.pipeline.run`)."""
    run_dir = run_dir if run_dir is not None else Path(".")
    if cfg.launcher.kind == "ray":
        from gyre.launch.ray import RayLauncher

        return RayLauncher(
            run_dir,
            cell_restarts=cfg.launcher.cell_restarts,
            service_hang_s=cfg.launcher.service_hang_s,
            engine_api=_engine_api(cfg),
            launcher=cfg.launcher,
        )
    from gyre.launch.local import LocalLauncher

    return LocalLauncher(
        run_dir,
        cell_restarts=cfg.launcher.cell_restarts,
        service_hang_s=cfg.launcher.service_hang_s,
        engine_api=_engine_api(cfg),
    )


def _engine_api(cfg: RunConfig) -> EngineAPI:
    """The route the proxy calls the run's engines by: vLLM's own, or SGLang's (SGLang, Gyre's torch engine)."""
    return "vllm" if cfg.rollout.engine == "vllm" else "sglang"
