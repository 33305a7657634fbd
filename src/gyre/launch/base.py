"""What every launcher shares: the interface, the cell configs, the proxy and gyre-eval subprocesses, watching and
stopping processes.

Every service of a run needs a token made for this run (`RunTokens`: the engines' API key, gyre-eval's token, the
proxy's admin token); each child gets the ones it uses through an inherited pipe (`gyre.launch.tokens`), and every
client the controller holds sends them. A child dies with the controller (PR_SET_PDEATHSIG, SIGKILL), so a killed controller
leaves no process behind. While the run goes on, `supervise` restarts a dead gyre-eval (same port and token; its
assessments live in RUN/assessments.sqlite and unfinished ones resume; the controller's client retries meanwhile)
and turns the death of any other service into one `ServiceError` line naming it and its log; RUN/services.json says where each service listens and its pid (no tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Collection
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from gyre.config import RunConfig
from gyre.launch.cell_configs import cell_configs, cell_name
from gyre.launch.health import HealthWatch
from gyre.launch.tokens import RunTokens, TokenPipes
from gyre_cell import ports
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import CellWorkerConfig
from gyre_eval.client import EvalClient
from gyre_eval.config import ServiceConfig

__all__ = ["Launcher", "ServiceError", "cell_configs", "cell_name", "free_port", "free_ports"]

log = logging.getLogger("gyre")
MAX_RESTARTS = 3
"""Restarts of one service per run before its death ends the run (a crash loop is not recovered)."""


class ServiceError(RuntimeError):
    """A service did not start; the message names it and points at its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the kernel's ephemeral range (`gyre_train.ports`)."""
    return ports.free_port(host)


def free_ports(n: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """`n` distinct free ports, none of `exclude`: several chosen before any is bound (`gyre_train.ports`)."""
    return ports.free_ports(n, host, exclude)


def bound_socket(host: str) -> socket.socket:
    """A TCP socket bound now to a port of the kernel's choosing on `host`, not listening yet, for a service started
    later to inherit (`--listen-fd`).

    A port only chosen here and bound by the service once it has started is free for any other process in between
    (seen in CI: gyre-eval exiting at start with "address already in use" while tests ran beside it). Bound here,
    nobody else can take it (no SO_REUSEADDR, which would let another reusing socket bind it too), and the service
    restarted on it finds it still held."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except BaseException:
        sock.close()
        raise
    return sock


def bin_path(name: str) -> str:
    """The console script installed beside this interpreter (works in a venv without activating it)."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def _die_with_parent(parent: int) -> None:
    """In the child before exec: SIGKILL when the controller dies (also if it died before this line ran).

    SIGKILL, not SIGTERM: with the controller gone the run is over and nobody escalates, while a graceful shutdown
    can wait on requests the dead controller left open (a cell's event long-poll). What a service acknowledged is
    already on disk (records, assessments)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus `extra`, less the admin token a caller may have exported (it stays here)."""
    env = {**os.environ, **(extra or {})}
    env.pop("GYRE_TITO_ADMIN_TOKEN", None)
    return env


def spawn_child(
    argv: list[str],
    tokens: dict[str, str],
    env: dict[str, str],
    log_path: Path,
    cwd: str | None = None,
    stdout_path: Path | None = None,
    inherit: tuple[int, ...] = (),
) -> subprocess.Popen:
    """A child in its own process group that dies with this process, logging to `log_path` (its stdout to
    `stdout_path` when given); `tokens` maps a `--...-fd` flag to the token the child reads from that inherited fd;
    `inherit`: more fds the child keeps, at the same numbers (a bound socket)."""
    pipes = TokenPipes()
    for flag, token in tokens.items():
        argv = [*argv, *pipes.arg(flag, token)]
    child_env = child_environment(env)
    try:
        with log_path.open("ab") as log, (stdout_path or log_path).open("ab") as out:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=log,
                env=child_env,
                start_new_session=True,
                cwd=cwd,
                pass_fds=(*pipes.fds, *inherit),
                preexec_fn=partial(_die_with_parent, os.getpid()),
            )
    finally:
        pipes.close()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal a child's process group (a child placed elsewhere is signalled by its own handle)."""
    with contextlib.suppress(ProcessLookupError):
        if hasattr(proc, "signal_group"):
            proc.signal_group(sig)
        else:
            os.killpg(proc.pid, sig)


def _how(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


@dataclass
class Launcher:
    """Starts a run's cell workers, standalone engines and proxy; stops them all.

    Subclasses implement `start_cells` (and extend `stop` for what they start other than subprocesses). The proxy and
    gyre-eval are subprocesses beside the controller, unless a launcher places them elsewhere (`_service_address`,
    `_start_process`: the ray launcher with `[launcher] proxy_resources` / `eval_resources`).
    """

    run_dir: Path
    cells: list[CellWorkerClient] = field(default_factory=list)
    standalone: list[CellWorkerClient] = field(default_factory=list)
    proxy_url: str = ""
    eval_url: str = ""
    tokens: RunTokens = field(default_factory=RunTokens)
    restarts: dict[str, int] = field(default_factory=dict)
    service_died: bool = False
    """Set when a dead service ended the run: `stop` then gives the others a short grace (the run is failing)."""
    engine_api: str = "sglang"
    """The engines' token-in/token-out route the proxy calls (`gyre_tito.engine_client.EngineAPI`)."""
    cell_restarts: int = 1
    """Restarts of one satellite cell's worker per run (`[launcher] cell_restarts`)."""
    service_hang_s: float = 30.0
    """A proxy or gyre-eval that answers no health probe for this long is hung: killed, then handled as dead
    (`[launcher] service_hang_s`; `gyre.launch.health`)."""
    _procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    _restartable: dict[str, tuple[list[str], dict[str, str], str]] = field(default_factory=dict)
    _sockets: dict[str, socket.socket] = field(default_factory=dict)
    """Each service's bound socket (`bound_socket`), held for the whole run: every start of it inherits the same."""
    _cell_configs: dict[int, CellWorkerConfig] = field(default_factory=dict)
    """Each elastic cell's config as started (a restart starts it again from it)."""
    _health: HealthWatch | None = None
    _hung: dict[str, str] = field(default_factory=dict)
    """Services killed because they stopped answering: why, for the line that reports their death."""

    def _watch(self, name: str, url: str) -> None:
        if self._health is None:
            self._health = HealthWatch(self.service_hang_s)
        self._health.add(name, url)

    kind = "base"

    # ---- interface -----------------------------------------------------------------------------------------------
    def warm_up(self, cfg: RunConfig) -> None:
        """Start, ahead of `start_cells`, what makes the workers quick to start (the local launcher's zygote), so
        that it overlaps the controller's own start-up. Call from the thread that lives as long as the run."""

    async def start_cells(self, configs: list[CellWorkerConfig], timeout_s: float = 300.0) -> None:
        """Start every worker of `configs` (from `cell_configs`), then wait until each finished its set-up."""
        raise NotImplementedError

    async def restart_cell(self, cell: int, timeout_s: float = 300.0) -> CellWorkerClient | None:
        """Start satellite `cell`'s worker again after it died mid-run, and wait until it is ready.

        The new worker runs the cell's own config with `restarted` set (rollout at once, no training side: the
        run's gloo world was formed without it); `self.cells[cell]` becomes its client (returned). None, with one
        warning line, once the cell's restarts (`cell_restarts`) are spent: it stays lost."""
        name = f"cell-{cell}"
        used = self.restarts.get(name, 0)
        if used >= self.cell_restarts or cell not in self._cell_configs:
            log.warning(
                "%s died again after %d restart(s) ([launcher] cell_restarts = %d): it stays lost; see %s",
                name,
                used,
                self.cell_restarts,
                self.log_path(name),
            )
            return None
        self.restarts[name] = used + 1
        log.warning(
            "%s: restarting its worker (restart %d of at most %d)", name, used + 1, self.cell_restarts
        )
        wc = self._cell_configs[cell].model_copy(update={"restarted": True})
        client = await self._restart_cell(cell, wc, used + 1, timeout_s)
        old, self.cells[cell] = self.cells[cell], client
        await old.aclose()
        return client

    async def _restart_cell(
        self, cell: int, wc: CellWorkerConfig, attempt: int, timeout_s: float
    ) -> CellWorkerClient:
        raise NotImplementedError

    @property
    def engine_urls(self) -> list[str]:
        return [c.engine_url for c in self.cells + self.standalone]

    @property
    def admin_token(self) -> str:
        return self.tokens.admin

    def worker_client(self, url: str) -> CellWorkerClient:
        """A client of one cell worker or standalone engine, with the run's engine token."""
        return CellWorkerClient(url, api_key=self.tokens.engine)

    def log_path(self, name: str) -> Path:
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        return log_dir / f"{name}.log"

    def started_badly(self, name: str, exc: BaseException, restart: int | None = None) -> ServiceError:
        """A worker that failed its start-up, in one line: what the launcher saw, the last line its log has (a
        worker that refuses to start says why there), and where the rest is."""
        path = self.log_path(name)
        last = ""
        with contextlib.suppress(OSError), path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 4096))
            lines = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
            last = f" (its log ends: {lines[-1].strip()[:300]})" if lines else ""
        what = name if restart is None else f"{name} (restart {restart})"
        return ServiceError(f"{what}: {exc}{last}; see {path}")

    # ---- subprocesses --------------------------------------------------------------------------------------------
    def _spawn(
        self,
        name: str,
        argv: list[str],
        tokens: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Start a child in its own process group, logging to RUN/logs/NAME.log; `tokens` maps a `--...-fd` flag
        to the token it reads from that fd."""
        proc = self._start_process(name, argv, tokens or {}, env or {})
        self._procs.append((name, proc))
        self._write_services()
        return proc

    def _start_process(
        self, name: str, argv: list[str], tokens: dict[str, str], env: dict[str, str]
    ) -> subprocess.Popen:
        """A child of this process (a launcher that places a service elsewhere starts it there instead)."""
        held = self._sockets.get(name)
        inherit = (held.fileno(),) if held is not None else ()
        return spawn_child(argv, tokens, env, self.log_path(name), inherit=inherit)

    async def _service_address(self, name: str) -> str:
        """The address service `name` (proxy, gyre-eval) binds: loopback beside the controller, here."""
        return "127.0.0.1"

    async def _listen_args(self, name: str, host: str) -> tuple[int, list[str]]:
        """The port service `name` will listen on, and the flags that give it its socket: one bound here and held
        (`bound_socket`), inherited as `--listen-fd`."""
        sock = self._sockets[name] = bound_socket(host)
        return sock.getsockname()[1], ["--listen-fd", str(sock.fileno())]

    def _write_services(self) -> None:
        """RUN/services.json: each service's URL and pid (for operators and the kill -9 tests; never a token)."""
        info = {
            "proxy": self.proxy_url or None,
            "gyre-eval": self.eval_url or None,
            "cells": self.engine_urls[: len(self.cells)],
            "standalone": self.engine_urls[len(self.cells) :],
            "workers": [c.base_url for c in self.cells + self.standalone],
            "pids": {name: proc.pid for name, proc in self._procs},
        }
        (self.run_dir / "services.json").write_text(json.dumps(info, indent=1) + "\n")

    async def start_proxy(
        self, tokenizer_dir: Path, timeout_s: float = 120.0, temperature: float | None = None
    ) -> None:
        host = await self._service_address("proxy")
        port, listen = await self._listen_args("proxy", host)
        # the proxy writes exports only under its store or an --export-dir: runner.export writes to trajectories/
        argv = [
            bin_path("gyre-tito"),
            "serve",
            "--tokenizer",
            str(tokenizer_dir),
            "--store",
            str(self.run_dir / "records"),
            "--host",
            host,
            "--port",
            str(port),
            *listen,
            "--export-dir",
            str(self.run_dir / "trajectories"),
        ]
        for url in self.engine_urls:
            argv += ["--engine", url]
        if self.engine_api != "sglang":
            argv += ["--engine-api", self.engine_api]
        if temperature is not None:  # every call samples at the trainer's temperature (sampling policy: pin)
            argv += ["--temperature", str(temperature)]
        self.proxy_url = f"http://{host}:{port}"
        tokens = {"--admin-token-fd": self.tokens.admin, "--engine-api-key-fd": self.tokens.engine}
        proc = self._spawn("proxy", argv, tokens)
        await self._wait_healthy("proxy", proc, f"{self.proxy_url}/health", timeout_s)
        self._watch("proxy", f"{self.proxy_url}/health")

    async def start_eval(self, config: ServiceConfig, timeout_s: float = 120.0) -> EvalClient:
        """gyre-eval as a child on the run directory (RUN/assessments.sqlite); returns a client with its token."""
        private = self.run_dir / "private"
        private.mkdir(mode=0o700, exist_ok=True)
        config_file = private / "gyre-eval.json"  # evaluator commands and paths; a judge's key would be here
        fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(config.model_dump_json(indent=2))
        host = await self._service_address("gyre-eval")
        port, listen = await self._listen_args("gyre-eval", host)
        argv = [
            bin_path("gyre-eval"),
            "serve",
            "--store",
            str(self.run_dir),
            "--host",
            host,
            "--port",
            str(port),
            *listen,
            "--config",
            str(config_file),
        ]
        self.eval_url = f"http://{host}:{port}"
        tokens = {"--token-fd": self.tokens.eval}
        # its state is on disk (RUN/assessments.sqlite): a dead gyre-eval is started again on the same port
        self._restartable["gyre-eval"] = (argv, tokens, f"{self.eval_url}/healthz")
        proc = self._spawn("gyre-eval", argv, tokens)
        await self._wait_healthy("gyre-eval", proc, f"{self.eval_url}/healthz", timeout_s)
        self._watch("gyre-eval", f"{self.eval_url}/healthz")
        # Calls keep retrying through a restart: a hung gyre-eval is found and restarted within service_hang_s + ~10 s.
        return EvalClient(
            self.eval_url, token=self.tokens.eval, retry_s=max(60.0, 2 * self.service_hang_s + 30.0)
        )

    async def _wait_healthy(self, name: str, proc: subprocess.Popen, url: str, timeout_s: float) -> None:
        log_file = self.log_path(name)
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise ServiceError(f"{name} exited with {proc.returncode}; see {log_file}")
                try:
                    if (await client.get(url)).status_code == 200:
                        self._write_services()
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        raise ServiceError(f"{name} not healthy after {timeout_s:.0f} s; see {log_file}")

    # ---- while the run goes on ------------------------------------------------------------------------------------
    def watched(self, name: str) -> bool:
        """Services whose death ends the run here. Cells are watched by the controller (their event stream)."""
        return not name.startswith("cell-")

    def dead_service(self) -> str | None:
        """One line naming the first watched service that is gone, and its log; None while all are alive."""
        for name, proc in self._procs:
            if self.watched(name) and proc.poll() is not None:
                return f"{name} {self._end_of(name, proc)}; see {self.log_path(name)}"
        return None

    def _end_of(self, name: str, proc: subprocess.Popen) -> str:
        if name in self._hung:
            return f"stopped answering ({self._hung[name]}) and was killed"
        return f"exited ({_how(proc.returncode)})"

    async def _kill_hung(self, every_s: float = 5.0) -> None:
        """Probe the services every `every_s`; kill the ones that stopped answering (their death is then seen)."""
        if self._health is not None:
            self._health.restart_clock()  # not probed since the last supervise: that gap is not silence
        while self._health is not None:
            await asyncio.sleep(every_s)
            try:
                hung = await self._health.hung()
            except Exception as exc:  # a probe that cannot run is no reason to stop watching
                log.warning("health probe failed (%s: %s)", type(exc).__name__, exc)
                continue
            for name in hung:
                self._hung[name] = f"no answer to its health check for {self._health.hang_s:.0f} s"
                log.warning("%s %s: killing it", name, self._hung[name])
                for proc_name, proc in self._procs:
                    if proc_name == name and proc.poll() is None:
                        _signal_group(proc, signal.SIGKILL)

    async def _restart_dead(self) -> bool:
        """Start again each dead restartable service (same argv, port and token); False if one cannot be."""
        for i, (name, proc) in enumerate(self._procs):
            if not self.watched(name) or proc.poll() is None:
                continue
            if name not in self._restartable or self.restarts.get(name, 0) >= MAX_RESTARTS:
                return False
            log.warning(
                "%s %s; restarted (%d of at most %d); see %s",
                name,
                self._end_of(name, proc),
                self.restarts.get(name, 0) + 1,
                MAX_RESTARTS,
                self.log_path(name),
            )
            argv, tokens, health = self._restartable[name]
            del self._procs[i]
            self._hung.pop(name, None)
            # not probed while it starts (the probe would take the new one as hung)
            if self._health is not None:
                self._health.remove(name)
            await self._wait_healthy(name, self._spawn(name, argv, tokens), health, 60.0)
            self.restarts[name] = self.restarts.get(name, 0) + 1  # counted once it answers again
            if self._health is not None:
                self._health.add(name, health)
            return True
        return True

    async def supervise[T](self, work: Awaitable[T], poll_s: float = 0.2, settle_s: float = 1.0) -> T:
        """Await `work` while watching the services: a dead gyre-eval is restarted; any other dead one cancels the
        work and raises ServiceError naming it. A service that stopped answering its health probe is killed first
        (`gyre.launch.health`), so a hung one takes the same path.

        When `work` fails first (a client of a service that just died sees a refused connection before the
        watcher looks), the dead service is what is reported, not the client's error.
        """
        task = asyncio.ensure_future(work)
        prober = asyncio.ensure_future(self._kill_hung())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    if task.exception() is not None:
                        settle = time.monotonic() + settle_s
                        while time.monotonic() < settle:
                            if (dead := self.dead_service()) is not None:
                                self.service_died = True
                                raise ServiceError(dead) from None
                            await asyncio.sleep(0.05)
                    return task.result()
                if (dead := self.dead_service()) is not None and not await self._restart_dead():
                    self.service_died = True
                    raise ServiceError(dead)
        finally:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def aclose_clients(self) -> None:
        for client in self.cells + self.standalone:
            await client.aclose()

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every process group, SIGKILL what is still alive after `grace_s` (default 5 s, 1 s once a dead
        service ended the run: it must fail within seconds); idempotent."""
        if grace_s is None:
            grace_s = 1.0 if self.service_died else 5.0
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in reversed(self._procs):
            try:
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
