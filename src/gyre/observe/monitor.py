"""What a run shows while it goes: metrics sink, live dashboard and progress bar, driven from the controller.

`RunMonitor(cfg, run_dir, controller)` is started by the pipeline before the first event. The controller calls
`on_step(row)` as each optimizer step ends (the metrics go out at once); the monitor's own task samples the
scheduler state every `[metrics] interval_s` (executions running/queued, waterlevel, capacity, roles) together with
what the proxy recorded meanwhile (tokens, latency), and forwards new switches and publications. It writes
metrics/clock.json (the unix time of the run's t = 0) so the proxy's unix timestamps line up with the trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import orjson

from gyre.config import RunConfig
from gyre.observe import progress as progress_mod
from gyre.observe.metrics import MetricsSink
from gyre.observe.rundata import RunView

__all__ = ["RunMonitor", "live_state"]

log = logging.getLogger("gyre")


def live_state(controller: Any) -> dict:
    """The scheduler's state now, from the controller's policy (the same numbers the trace recomputes)."""
    policy = controller.policy
    led, params = policy.ledger, policy.params
    roles = [r.value for r in policy.roles]
    away = sum(r != "rollout" for r in roles)
    return {
        "t": controller.now(),
        "running": led.running,
        "queued": led.queued,
        "waterlevel": led.d - led.x - led.f,
        "capacity": (params.K - away) * params.C_e + params.C_s,
        "roles": roles,
        "version": policy.version,
        "steps_done": controller.steps_done,
    }


class RunMonitor:
    def __init__(self, cfg: RunConfig, run_dir: Path, controller: Any) -> None:
        self.cfg, self.run_dir, self.controller = cfg, Path(run_dir), controller
        self.view = RunView(run_dir)
        m = cfg.metrics
        self.sink = MetricsSink(
            self.run_dir,
            cfg.cluster.cells,
            tensorboard=m.tensorboard,
            wandb_project=m.wandb_project,
            wandb_entity=m.wandb_entity,
            config=cfg.model_dump(mode="json"),
        )
        self.progress = progress_mod.current()
        # A resumed run's steps so far: its bar counts the whole run's.
        self._steps_before = controller.steps_done
        self.dashboard = None
        self.url: str | None = None
        self._task: asyncio.Task | None = None
        self._calls_seen = 0
        self._switches_seen = 0
        self._publishes_seen = 0
        self._last_t = 0.0
        self._last_reward: float | None = None
        self._closed = False
        self._ended = False

    async def start(self) -> None:
        t0 = time.time() - self.controller.now()
        (self.run_dir / "metrics" / "clock.json").write_bytes(orjson.dumps({"unix_t0": t0}))
        d = self.cfg.dashboard
        if d.enabled:
            from gyre.observe.dashboard.server import DashboardServer

            self.dashboard = DashboardServer(self.view, d.host, d.port, d.token, d.refresh_s)
            self.url = await self.dashboard.start()
            fd = os.open(self.run_dir / "dashboard.url", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:  # the URL carries the dashboard's token
                f.write(self.url + "\n")
            log.info("dashboard: %s", self.url)
        self._task = asyncio.create_task(self._loop())

    def on_step(self, row: dict) -> None:
        """The controller's step-end hook: metrics now, the bar now."""
        try:
            self.sink.step(row)
        except Exception:  # a metrics failure must not stop training
            log.warning("metrics: step %s not written", row.get("policy_version"), exc_info=True)
        self._last_reward = row.get("mean_reward")
        self._progress()

    def _progress(self) -> None:
        if self.progress is not None:
            c = self.controller
            total = c.target_steps or self.cfg.train.steps
            self.progress.update(self._steps_before + len(c.step_reports), total, c.now(), self._last_reward)

    async def _loop(self) -> None:
        interval = self.cfg.metrics.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sample()
            except Exception:
                log.warning("metrics: interval sample failed", exc_info=True)

    async def sample(self) -> dict[str, float]:
        """One interval: scheduler state + calls recorded since the last sample; new switches and publications."""
        state = live_state(self.controller)
        await asyncio.to_thread(self.view.refresh)
        calls = self.view.calls[self._calls_seen :]
        self._calls_seen += len(calls)
        seconds = max(1e-9, state["t"] - self._last_t)
        self._last_t = state["t"]
        scalars = self.sink.interval(state["t"], state, calls, seconds)
        self.sink.switches(self.view.switches[self._switches_seen :])
        self._switches_seen = len(self.view.switches)
        self.sink.publishes(self.view.publishes[self._publishes_seen :])
        self._publishes_seen = len(self.view.publishes)
        self._progress()
        return scalars

    async def end_run(self) -> None:
        """After the last step (or a failure): a last sample, metrics flushed; the dashboard keeps serving."""
        if self._ended:
            return
        self._ended = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.sample()
        try:
            self.sink.close()
        except Exception:  # never in the way of stopping the run's processes
            log.warning("metrics: closing the event files failed", exc_info=True)
        if self.progress is not None:
            self.progress.close()

    async def linger(self) -> None:
        """Keep the dashboard up `[dashboard] linger_s` after the run (its final state, report written)."""
        if self.dashboard is not None and self.cfg.dashboard.linger_s > 0:
            log.info("dashboard stays up %.0f s at %s", self.cfg.dashboard.linger_s, self.url)
            try:
                await asyncio.sleep(self.cfg.dashboard.linger_s)
            except asyncio.CancelledError:
                # SIGINT or SIGTERM: the run is done, so only the wait ends; the summary is printed next.
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.end_run()
        if self.dashboard is not None:
            await self.dashboard.stop()
        self.view.close()
