"""Services that are alive but no longer answer: the proxy and gyre-eval probed while a run goes on.

A service whose process exits is seen by the launcher at once (`Launcher.dead_service`). One that hangs (a deadlock,
a process stopped, or the host it runs on gone quiet: no reset, no end of file) never exits, and the controller's
calls to it only time out: a stopped gyre-eval ended a run after 70 s with "run failed: ReadTimeout:", naming
nothing, and a stopped proxy left every harness waiting. `HealthWatch` probes each service's health route on a
schedule; one that answered no probe for `hang_s` is reported hung once, and the launcher kills it, so its death
takes the usual path: gyre-eval is started again on its port (its state is on disk), the proxy's ends the run with
one line naming it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

__all__ = ["HealthWatch"]


class HealthWatch:
    """`add(name, url)` the services to watch; `hung()` probes them all and returns the names that have answered no
    probe for `hang_s` (each reported once). `clock` is injectable for tests."""

    def __init__(
        self,
        hang_s: float,
        probe_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if hang_s <= 0:
            raise ValueError(f"hang_s must be > 0, got {hang_s}")
        self.hang_s = hang_s
        self.probe_timeout_s = min(probe_timeout_s, hang_s)
        self.clock = clock
        self._client = client
        self._urls: dict[str, str] = {}
        self._last_ok: dict[str, float] = {}

    def add(self, name: str, url: str) -> None:
        """Watch `name` at `url` (again from now on, after a restart)."""
        self._urls[name] = url
        self._last_ok[name] = self.clock()

    def restart_clock(self) -> None:
        """Count silence from now for every service (probing resumes after a pause: only silence seen counts)."""
        now = self.clock()
        for name in self._last_ok:
            self._last_ok[name] = now

    def remove(self, name: str) -> None:
        self._urls.pop(name, None)
        self._last_ok.pop(name, None)

    def silent_for(self, name: str) -> float:
        """Seconds since `name` last answered a probe (or was added)."""
        return self.clock() - self._last_ok[name]

    async def _answers(self, client: httpx.AsyncClient, url: str) -> bool:
        try:
            return (await client.get(url, timeout=self.probe_timeout_s)).status_code == 200
        except httpx.HTTPError:
            return False

    async def hung(self) -> list[str]:
        """Probe every watched service at once; the ones silent for `hang_s` or longer (no longer watched after)."""
        names = list(self._urls)
        if not names:
            return []
        client = self._client or httpx.AsyncClient()
        try:
            answers = await asyncio.gather(*(self._answers(client, self._urls[n]) for n in names))
        finally:
            if self._client is None:
                await client.aclose()
        out = []
        now = self.clock()
        for name, ok in zip(names, answers, strict=True):
            if ok:
                self._last_ok[name] = now
            elif now - self._last_ok[name] >= self.hang_s:
                out.append(name)
                self.remove(name)
        return out
