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

from gyre.config import ConfigError, RunConfig, resolve_transports
from gyre.launch.health import HealthWatch
from gyre.launch.tokens import RunTokens, TokenPipes
from gyre_cell import ports
from gyre_cell.engine.config import EngineConfig
from gyre_cell.sglang_launch import SGLangLaunchConfig
from gyre_cell.vllm_launch import VLLMLaunchConfig
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import CellTrainingConfig, CellWorkerConfig
from gyre_eval.client import EvalClient
from gyre_eval.config import ServiceConfig

__all__ = ["Launcher", "ServiceError", "cell_configs", "free_port", "free_ports"]

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


def cell_name(wc: CellWorkerConfig) -> str:
    return f"cell-{wc.cell}" if wc.kind == "elastic" else f"standalone-{wc.cell}"


def cell_configs(cfg: RunConfig, run_dir: Path, model_dir: Path) -> list[CellWorkerConfig]:
    """Every worker's config on loopback: the K elastic cells first (index = cell), then the standalone engines.

    A launcher that places workers on other hosts rewrites the addresses (`host`, `port`, `mooncake`, the training
    rendezvous) once it knows each worker's node; everything else is the same for every launcher.
    """
    # A worker takes a transport, never "auto": `gyre run` resolved it at start (and said so); direct callers here.
    if "auto" in (cfg.weights.transport, cfg.weights.snapshot):
        cfg, _ = resolve_transports(cfg)
    c, s, t, dbg = cfg.cluster, cfg.scheduler, cfg.train, cfg.debug
    workers = c.cells + c.standalone_engines
    server = (
        cfg.rollout.engine != "torch"
    )  # an SGLang or vLLM server beside each worker, on a port of its own
    # distinct: none is bound before the workers start (two independent draws once gave the same port twice)
    master, coordinator, *ports = free_ports(2 + workers * (2 if server else 1))
    worker_ports, server_ports = ports[:workers], ports[workers:]
    gpus = _local_gpus(cfg, workers)
    scripted = str(Path(cfg.rollout.scripted_replies).resolve()) if cfg.rollout.scripted_replies else None
    out = []
    for i in range(c.cells + c.standalone_engines):
        elastic = i < c.cells
        index = i if elastic else i - c.cells
        engine = EngineConfig(
            model_path=str(model_dir),
            device=c.device,
            weight_version="0",
            seed=t.seed + i,
            cpu_threads=c.cpu_threads_per_cell,
            scripted_replies=scripted,
        )
        training = None
        if elastic:
            training = CellTrainingConfig(
                group_size=s.N,
                batch_groups=s.B,
                steps_per_burst=s.mu,
                lr=t.lr,
                dtype=t.dtype,
                lr_warmup_steps=t.lr_warmup_steps,
                max_grad_norm=t.max_grad_norm,
                tokens_per_shard=t.tokens_per_shard,
                temperature=cfg.model.temperature,
                loss=t.loss,
                master_port=master,
                coordinator_port=coordinator,
                claim_timeout_s=t.claim_timeout_s,
                collective_timeout_s=t.collective_timeout_s,
                snapshot=cfg.weights.snapshot,
                dump_batches=dbg.dump_batches,
                hold_core_for_join=dbg.hold_core_for_join,
                hold_timeout_s=dbg.hold_timeout_s,
                stop_gate=dbg.stop_gate,
                backend=t.backend,
                device=c.device,
                tensor_parallel=t.tensor_parallel,
                pipeline_parallel=t.pipeline_parallel,
                context_parallel=t.context_parallel,
                expert_parallel=t.expert_parallel,
                checkpoint_keep=t.checkpoint_keep,
            )
        out.append(
            CellWorkerConfig(
                cell=index,
                kind="elastic" if elastic else "standalone",
                num_cells=c.cells,
                run_dir=str(run_dir),
                port=worker_ports[i],
                engine=engine,
                training=training,
                weights=cfg.weights.transport,
                mooncake=cfg.weights.mooncake,
                cpu_threads=c.cpu_threads_per_cell,
                visible_gpus=gpus[i] if gpus is not None else None,
                sglang=_sglang_launch(cfg, model_dir, server_ports[i], t.seed + i)
                if cfg.rollout.engine == "sglang"
                else None,
                vllm=_vllm_launch(cfg, model_dir, server_ports[i], t.seed + i)
                if cfg.rollout.engine == "vllm"
                else None,
            )
        )
    return out


def _local_gpus(cfg: RunConfig, workers: int) -> list[list[str]] | None:
    """The local launcher's GPUs for each worker in order: `gpus_per_cell` whole ids each, or one id shared by
    1/gpus_per_cell workers in a row; taken from this process's CUDA_VISIBLE_DEVICES (ids or UUIDs), counted from 0
    when it is unset. None when no GPU is handed out (CPU, or Ray, which sets each actor's own)."""
    per = cfg.launcher.gpus_per_cell
    if cfg.launcher.kind != "local" or per == 0:
        return None
    whole, share = (int(per), 1) if per >= 1 else (1, round(1 / per))  # the config refused anything else
    slots = (
        [list(range(w * whole, (w + 1) * whole)) for w in range(workers)]
        if share == 1
        else [[w // share] for w in range(workers)]
    )  # fmt: skip (an aligned table)
    need = slots[-1][-1] + 1
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    pool = [g.strip() for g in listed.split(",") if g.strip()] if listed is not None else None
    if pool is not None and len(pool) < need:
        raise ConfigError(
            f"launcher.gpus_per_cell = {per:g} for {workers} worker(s) needs {need} GPUs; "
            f"CUDA_VISIBLE_DEVICES lists {len(pool)} ({listed!r})"
        )
    ids = pool if pool is not None else [str(g) for g in range(need)]
    return [[ids[g] for g in slot] for slot in slots]


def _sglang_launch(cfg: RunConfig, model_dir: Path, port: int, seed: int) -> SGLangLaunchConfig:
    """One worker's SGLang server, from `[rollout.sglang]`: the run's policy at version 0, on loopback (a launcher
    placing the worker elsewhere rebinds it)."""
    sg = cfg.rollout.sglang
    return SGLangLaunchConfig(
        model_path=str(model_dir),
        host="127.0.0.1",
        port=port,
        tp_size=sg.tp_size,
        mem_fraction_static=sg.mem_fraction_static,
        weight_version="0",
        random_seed=seed,
        python=sg.python or sys.executable,
        module=sg.module,
        extra_args=tuple(sg.extra_args),
    )


def _vllm_launch(cfg: RunConfig, model_dir: Path, port: int, seed: int) -> VLLMLaunchConfig:
    """One worker's vLLM server, from `[rollout.vllm]`: the run's policy at version 0, on loopback (a launcher
    placing the worker elsewhere rebinds it). Its compile caches stay in vLLM's default place (keyed by model and
    settings): a cold compile took 97 of a server's 237 s start."""
    v = cfg.rollout.vllm
    return VLLMLaunchConfig(
        model_path=str(model_dir),
        python=v.python or sys.executable,
        host="127.0.0.1",
        port=port,
        dtype=v.dtype,
        max_model_len=v.max_model_len,
        weight_version="0",
        seed=seed,
        enforce_eager=v.enforce_eager,
        stream_interval=v.stream_interval,
        enable_sleep_mode=v.enable_sleep_mode,
        gpu_memory_utilization=v.gpu_memory_utilization,
        cpu_kv_cache_gib=v.cpu_kv_cache_gib,
        extra_args=tuple(v.extra_args),
    )


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
            if (
                self._health is not None
            ):  # not probed while it starts (the probe would take the new one as hung)
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
