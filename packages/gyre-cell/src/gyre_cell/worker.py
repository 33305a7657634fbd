"""The cell worker process: one per cell, alive for the whole run, holding its rollout engine and its training side.

One HTTP server per process: the engine's SGLang protocol subset at the root (the TITO proxy routes model calls
here) and the controller's commands under ``/cell`` (types in ``gyre_cell.worker_types``):

| command | who | what |
|---|---|---|
| `GET /cell/status` | all | ready, role, served weight version, the core's latest published weights |
| `GET /cell/events?after=N&timeout=S` | all | long poll of what happened (claims, group assignments, steps) |
| `POST /cell/to_training` | elastic | pause, flush, release engine memory, restore training state (docs/design/cells.md) |
| `POST /cell/to_rollout` | elastic | leave the burst, offload training state, resume the engine with the given weights |
| `POST /cell/join` | satellite | join the open batch: pull the core's snapshot, claim micro-steps until the burst ends |
| `POST /cell/groups` | core | a ready group (advantages given, trajectories as files) for the trajectory buffer |
| `POST /cell/open_batch` | core | run one optimizer step over streamed micro-steps claimed by every training cell |
| `POST /cell/publish` | core | refresh the published weights (Mooncake buffer; checkpoint when asked or with disk weights) |
| `POST /cell/load_weights` | rollout | pull published weights into the engine (Mooncake, or a checkpoint on disk) |
| `POST /cell/save` | core | final checkpoint: policy + trainer state |
| `POST /cell/shutdown` | all | stop serving; the process exits |

Role switches run through gyre-cell's ``CellRoleManager``. The process exits when its parent dies (PDEATHSIG), so a
killed controller leaves no cell behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import torch
import uvicorn
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from gyre_cell.client import RolloutEngine
from gyre_cell.engine.server import create_app, require_token
from gyre_cell.errors import CommandRefused, IllegalRoleTransition, RoleSwitchError, WeightError
from gyre_cell.ports import free_port
from gyre_cell.roles import CellRoleManager, CellRoleManagerConfig
from gyre_cell.worker_engine import InProcessEngine, RolloutSide, SupervisedSGLang, SupervisedVLLM
from gyre_cell.worker_types import (
    CellEvent,
    CellWorkerConfig,
    EventBatch,
    LoadResult,
    OpenBatchCommand,
    PublishCommand,
    PublishedWeights,
    ReformCommand,
    RendezvousPort,
    SaveCommand,
    SwitchResult,
    WorkerStatus,
)
from gyre_sched.types import CellRole

if TYPE_CHECKING:
    from gyre_cell.worker_stages import RankSpawner

log = logging.getLogger("gyre_cell.worker")

__all__ = ["CellWorkerProcess", "main"]

SHUTDOWN_GRACE_S = 1
"""Seconds uvicorn waits, on SIGTERM, for open requests before cancelling them (under the launcher's 5 s): a
command caught mid-way is cut short rather than the whole cell being SIGKILLed."""


class EventLog:
    """Append-only, thread-safe list of CellEvents with an asyncio wake-up for long polls."""

    def __init__(self) -> None:
        self._events: list[CellEvent] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._changed = loop, asyncio.Event()

    def emit(self, kind: str, /, **fields: Any) -> None:
        with self._lock:
            self._events.append(CellEvent(seq=len(self._events), at=time.time(), kind=kind, fields=fields))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """The server is stopping: open polls answer now and later ones at once (a graceful shutdown waits on
        them; held for their timeout, they would outlast the launcher's grace)."""
        self._closed = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake)

    async def after(self, seq: int, timeout_s: float) -> EventBatch:
        with self._lock:
            ready = self._events[seq:]
        if not ready and self._changed is not None and not self._closed:
            waiter = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), timeout_s)
            with self._lock:
                ready = self._events[seq:]
        return EventBatch(events=ready, next=seq + len(ready))


class _NoTraining:
    """The training side of a standalone engine: nothing to restore or offload."""

    async def restore(self) -> None:  # pragma: no cover - never called (standalone workers never switch)
        raise RuntimeError("a standalone engine has no training side")

    async def offload(self) -> None:  # pragma: no cover
        raise RuntimeError("a standalone engine has no training side")


class CellWorkerProcess:
    def __init__(
        self, cfg: CellWorkerConfig, api_key: str | None = None, rank_spawner: RankSpawner | None = None
    ) -> None:
        self.cfg = cfg
        self.rank_spawner = rank_spawner  # a multi-rank cell's other ranks (None: children on this machine)
        self.api_key = api_key  # the run's engine token: engine and /cell commands need it (not /health)
        self.url = f"http://{cfg.host}:{cfg.port}"
        self.events = EventLog()
        logs = Path(cfg.run_dir) / "logs"
        self.rollout: RolloutSide = (
            SupervisedSGLang(cfg, api_key, logs / f"{_name(cfg)}.sglang.log")
            if cfg.sglang is not None
            else SupervisedVLLM(cfg, api_key, logs / f"{_name(cfg)}.vllm.log")
            if cfg.vllm is not None
            else InProcessEngine(cfg, self.url, api_key)
        )
        self.training = None  # CellTraining, built in the background (gloo waits for every cell)
        self.error: str | None = None
        self._ready = threading.Event()
        self.roles: CellRoleManager | None = None
        self._subscribers: dict[str, Any] = {}
        self.server: uvicorn.Server | None = None
        if isinstance(self.rollout, InProcessEngine):  # the engine's protocol at the root, next to /cell
            self.app = create_app(self.rollout.engine, api_key=api_key)
        else:  # an SGLang or vLLM server serves the engine protocol itself (`WorkerStatus.engine_url`): /cell only
            self.app = FastAPI()
            require_token(self.app, api_key)
            self.app.add_api_route("/health", lambda: Response(status_code=200), methods=["GET"])
        self.app.include_router(self._router(), prefix="/cell")

        @self.app.exception_handler(RoleSwitchError)
        @self.app.exception_handler(IllegalRoleTransition)
        async def _switch_refused(_: Request, exc: Exception) -> JSONResponse:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=409)

        @self.app.exception_handler(ValidationError)
        async def _bad_command(_: Request, exc: ValidationError) -> JSONResponse:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            return JSONResponse({"error": {"message": f"invalid command: {problems}"}}, status_code=400)

        @self.app.exception_handler(CommandRefused)
        async def _refused(_: Request, exc: CommandRefused) -> JSONResponse:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)

        @self.app.exception_handler(WeightError)
        async def _not_a_checkpoint(_: Request, exc: WeightError) -> JSONResponse:
            # a load naming a directory the engine refuses (missing, no safetensors, outside its weight_dirs)
            return JSONResponse({"error": {"message": f"cannot load weights: {exc}"}}, status_code=400)

    # ---- start-up ------------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        try:
            failed: list[BaseException] = []

            def start_engine() -> None:
                try:
                    self.rollout.start(self._engine_exited)
                except BaseException as exc:  # reported by the set-up below, as its failure
                    failed.append(exc)

            starting = threading.Thread(target=start_engine, name="engine-start", daemon=True)
            starting.start()  # an SGLang server loads while the training side forms its world
            if self.cfg.kind == "elastic" and not self.cfg.restarted:
                from gyre_cell.worker_training import CellTraining

                self.training = CellTraining(
                    self.cfg, self.events.emit, rank_spawner=self.rank_spawner, run_secret=self.api_key
                )
            starting.join()
            if failed:
                raise failed[0]
            trainer = (
                "nothing" if self.training is None else getattr(self.training.backend, "device", "its stages")
            )
            log.info(
                "cell %d: ready; rollout on %s, training on %s (CUDA_VISIBLE_DEVICES=%s)",
                self.cfg.cell,
                self.rollout.device,
                trainer,
                os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
            )
            self._ready.set()
        except Exception as exc:
            log.exception("cell %d: set-up failed", self.cfg.cell)
            self.error = f"set-up failed: {type(exc).__name__}: {exc}"

    def _engine_exited(self, code: int) -> None:
        """The SGLang server died: without its engine the cell serves nothing, so the worker leaves too and the
        launcher handles a dead cell."""
        log.error("cell %d: its SGLang server exited with status %d; the worker exits", self.cfg.cell, code)
        logging.shutdown()
        os._exit(1)

    def _role_manager(self) -> CellRoleManager:
        if self.roles is None:
            side = self.training.state if self.training is not None else _NoTraining()
            self.roles = CellRoleManager(
                self.rollout.client(),
                side,
                CellRoleManagerConfig(cell=str(self.cfg.cell)),
            )
        return self.roles

    # ---- weights -------------------------------------------------------------------------------------------------
    def _subscriber(self, manifest_url: str):
        from gyre_cell.transfer.http_subscriber import HttpWeightSubscriber, fetch_http_manifest
        from gyre_cell.transfer.subscriber import WeightSubscriber, fetch_manifest

        if manifest_url not in self._subscribers:
            # weights = "http": Mooncake cannot load here, the core serves its buffer over HTTP
            http = self.cfg.weights == "http"
            secret = self.api_key or ""
            try:
                manifest = fetch_http_manifest(manifest_url, secret) if http else fetch_manifest(manifest_url)
            except Exception as exc:  # unreachable, not a URL, not a manifest: the command's ref is wrong
                raise CommandRefused(
                    400, f"cannot read the weight manifest at {manifest_url!r}: {exc}"
                ) from exc
            self._subscribers[manifest_url] = (
                HttpWeightSubscriber(manifest, secret=secret)
                if http
                else WeightSubscriber(manifest, mooncake=self.cfg.mooncake)
            )
        return self._subscribers[manifest_url]

    async def _load_weights(self, ref: PublishedWeights) -> str:
        """Put published weights into this cell's engine (engine requests continue meanwhile)."""
        own = self.training.published_tensors() if self.training is not None else None
        if own is not None and ref.manifest_url == self.training.published.manifest_url:
            return await self.rollout.load(ref, own, None)  # the core: its own buffer
        if ref.manifest_url is not None and self.cfg.weights in ("mooncake", "http"):
            subscriber = await asyncio.to_thread(self._subscriber, ref.manifest_url)
            version = await self.rollout.load(ref, None, subscriber)
            if version != str(ref.version):  # the publisher moved on meanwhile: the caller asks again (409)
                raise CommandRefused(409, f"pulled weight version {version}, expected {ref.version}")
            return version
        if ref.path is None:
            raise CommandRefused(
                400, f"published weights v{ref.version} name no checkpoint path and no manifest"
            )
        return await self.rollout.load(ref, None, None)

    # ---- HTTP ----------------------------------------------------------------------------------------------------
    def _router(self) -> APIRouter:
        r = APIRouter()
        worker = self

        def need_ready(training: bool = False, core: bool = False) -> JSONResponse | None:
            if core and (worker.cfg.kind != "elastic" or worker.cfg.cell != 0):
                message = (
                    f"{worker.cfg.kind} cell {worker.cfg.cell} is not the core: only cell 0 trains batches"
                )
                return JSONResponse({"error": {"message": message}}, status_code=409)
            if training and worker.cfg.kind == "standalone":
                message = f"standalone engine {worker.cfg.cell} serves rollout only: it has no training side"
                return JSONResponse({"error": {"message": message}}, status_code=409)
            if (training or core) and worker.cfg.restarted and worker.training is None:
                message = (
                    f"cell {worker.cfg.cell} was restarted mid-run: it serves rollout only (no training side)"
                )
                return JSONResponse({"error": {"message": message}}, status_code=409)
            if worker.error is not None:
                return JSONResponse({"error": {"message": worker.error}}, status_code=500)
            if not worker._ready.is_set():
                return JSONResponse({"error": {"message": "cell is still starting"}}, status_code=503)
            return None

        async def body(request: Request, model):
            # strict: a JSON `true` or `"3"` is no count or version (lax mode took them for 1 and 3)
            return model.model_validate_json(await request.body(), strict=True)

        @r.get("/status")
        async def status() -> WorkerStatus:
            role = worker.roles.role.value if worker.roles is not None else CellRole.ROLLOUT.value
            return WorkerStatus(
                cell=worker.cfg.cell,
                kind=worker.cfg.kind,
                ready=worker._ready.is_set(),
                role=role,
                weight_version=worker.rollout.weight_version,
                error=worker.error,
                engine_url=worker.rollout.url,
                published=worker.training.published if worker.training is not None else None,
            )

        @r.get("/events")
        async def events(
            after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
            timeout: Annotated[float, Query(ge=0, le=86400, allow_inf_nan=False)] = 30.0,
        ) -> EventBatch:
            # bounded here: a NaN timeout made the long poll wait forever, a negative `after` echoed itself
            return await worker.events.after(after, min(timeout, 60.0))

        @r.post("/to_training")
        async def to_training():
            if (bad := need_ready(training=True)) is not None:
                return bad
            report = await worker._role_manager().to_training()
            if worker.training is not None:
                worker.training.arm()
            return SwitchResult(report=report)

        @r.post("/to_rollout")
        async def to_rollout(request: Request):
            if (bad := need_ready(training=True)) is not None:
                return bad
            ref = await body(request, PublishedWeights)
            if worker.training is not None and worker.training.satellite is not None:
                await asyncio.to_thread(worker.training.stop_burst)
            loaded: list[float] = []

            async def loader(_: RolloutEngine) -> str:
                t0 = time.perf_counter()
                version = await worker._load_weights(ref)
                loaded.append(time.perf_counter() - t0)
                return version

            report = await worker._role_manager().to_rollout(loader)
            return SwitchResult(report=report, weights_seconds=loaded[0] if loaded else 0.0)

        @r.post("/join")
        async def join():
            if (bad := need_ready(training=True)) is not None:
                return bad
            if worker.cfg.cell == 0:
                return JSONResponse(
                    {"error": {"message": "the core does not join: it opens batches"}}, status_code=409
                )
            joined = await asyncio.to_thread(worker.training.join)
            return {"ok": True, "joined": joined}

        @r.post("/groups")
        async def groups(request: Request):
            if (bad := need_ready(core=True)) is not None:
                return bad
            from gyre_train.types import ReadyGroupMessage

            message = await body(request, ReadyGroupMessage)
            try:
                await asyncio.to_thread(worker.training.add_group, message)
            except (ValueError, OSError) as exc:  # a file missing, unreadable, of another group: none added
                raise CommandRefused(400, f"group {message.group_id} refused: {exc}") from exc
            return {"ok": True}

        @r.post("/open_batch")
        async def open_batch(request: Request):
            if (bad := need_ready(core=True)) is not None:
                return bad
            cmd = await body(request, OpenBatchCommand)
            await asyncio.to_thread(worker.training.open_batch, cmd.version, cmd.final)
            return {"ok": True}

        @r.post("/publish")
        async def publish(request: Request):
            if (bad := need_ready(core=True)) is not None:
                return bad
            cmd = await body(request, PublishCommand)
            return await asyncio.to_thread(worker.training.publish, cmd.version, cmd.save)

        @r.post("/load_weights")
        async def load_weights(request: Request) -> LoadResult:
            ref = await body(request, PublishedWeights)
            t0 = time.perf_counter()
            version = await worker._load_weights(ref)
            return LoadResult(version=version, seconds=time.perf_counter() - t0)

        @r.post("/save")
        async def save(request: Request):
            if (bad := need_ready(core=True)) is not None:
                return bad
            cmd = await body(request, SaveCommand)
            return await asyncio.to_thread(worker.training.save, cmd.version)

        @r.post("/rendezvous_port")
        async def rendezvous_port():
            """A port free now on this cell's rendezvous host (its `master_host`, else its own host), for the next
            world generation: asked of the core, which hosts the rendezvous."""
            if worker.cfg.kind != "elastic" or worker.cfg.training is None:
                message = f"standalone engine {worker.cfg.cell} hosts no gloo rendezvous"
                return JSONResponse({"error": {"message": message}}, status_code=409)
            host = worker.cfg.training.master_host or worker.cfg.host
            return RendezvousPort(port=await asyncio.to_thread(free_port, host))

        @r.post("/reform")
        async def reform(request: Request):
            """A new gloo world generation (every elastic cell at once); a restarted cell builds its training side
            in it, the others re-form theirs."""
            if (bad := need_ready()) is not None:
                return bad
            if worker.cfg.kind != "elastic":
                message = f"standalone engine {worker.cfg.cell} has no training side"
                return JSONResponse({"error": {"message": message}}, status_code=409)
            cmd = await body(request, ReformCommand)
            from gyre_train.multicell import RendezvousTimeout

            try:
                if worker.training is None:  # restarted: its training side starts in the new world
                    from gyre_cell.worker_training import CellTraining

                    training = worker.cfg.training.model_copy(update={"master_port": cmd.master_port})
                    cfg = worker.cfg.model_copy(update={"training": training})
                    worker.training = await asyncio.to_thread(
                        CellTraining,
                        cfg,
                        worker.events.emit,
                        cmd.rendezvous_timeout_s,
                        cmd.members,
                        worker.rank_spawner,
                        worker.api_key,
                    )
                    worker.roles = (
                        None  # a role manager built without a training side: rebuilt on the next switch
                    )
                else:
                    await asyncio.to_thread(
                        worker.training.reform,
                        cmd.master_port,
                        cmd.rejoining,
                        cmd.rendezvous_timeout_s,
                        cmd.members,
                    )
            # another cell never arrived: this one has no world until the next
            except RendezvousTimeout as exc:
                message = f"cell {worker.cfg.cell}: generation {cmd.generation} not formed: {exc}"
                return JSONResponse({"error": {"message": message}}, status_code=503)
            return {"ok": True, "generation": cmd.generation}

        @r.post("/shutdown")
        async def shutdown():
            if worker.server is not None:
                worker.events.close()
                worker.server.should_exit = True
            return {"ok": True}

        return r

    # ---- run -----------------------------------------------------------------------------------------------------
    def serve(self) -> None:
        # keep-alive far past the clients' idle expiry (worker_client.KEEPALIVE_EXPIRY_S): the client, not the server,
        # closes idle connections, so no command is ever sent on a connection the server is closing. On SIGTERM,
        # requests still open after SHUTDOWN_GRACE_S are cancelled: the controller's event poll is held open up to
        # its timeout (20 s), so a graceful wait for it outlasted the launcher's grace and every cell was SIGKILLed.
        config = uvicorn.Config(
            self.app,
            host=self.cfg.host,
            port=self.cfg.port,
            log_level="warning",
            timeout_keep_alive=75,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        self.server = _Server(config, on_exit=self.events.close)

        async def main() -> None:
            self.events.bind(asyncio.get_running_loop())
            threading.Thread(target=self._setup, name="cell-setup", daemon=True).start()
            await self.server.serve()

        asyncio.run(main())


class _Server(uvicorn.Server):
    """uvicorn's server, telling the event log when a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def _name(cfg: CellWorkerConfig) -> str:
    return f"cell-{cfg.cell}" if cfg.kind == "elastic" else f"standalone-{cfg.cell}"


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the controller that started it dies (no orphaned cells). Not SIGTERM: nobody
    is left to escalate, and a graceful shutdown waits on requests the dead controller left open (its event poll)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _claim_devices(cfg: CellWorkerConfig) -> str | None:
    """Restrict this process (and the SGLang server it starts) to its GPUs, before CUDA is first touched; why a
    worker asked to run on CUDA cannot, or None."""
    if cfg.visible_gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(cfg.visible_gpus)
    wants = [cfg.engine.device] + ([cfg.training.device] if cfg.training is not None else [])
    if any(d.startswith("cuda") for d in wants) and not torch.cuda.is_available():
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "device cuda, but this process sees no CUDA device" + (
            f" (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else ""
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre-cell worker", description="one cell worker process")
    parser.add_argument("--config", required=True, type=Path, help="CellWorkerConfig as JSON")
    parser.add_argument("--api-key-file", default=None, help="file (mode 600) with the engine token")
    parser.add_argument("--api-key-fd", type=int, default=None, help="read the engine token from this fd")
    args = parser.parse_args(argv)
    try:
        cfg = CellWorkerConfig.model_validate_json(args.config.read_text())
    except (OSError, ValueError) as exc:
        print(f"gyre-cell worker: {args.config}: {exc}", file=sys.stderr)
        return 2
    from gyre_sched.errors import SecretError
    from gyre_sched.secret import read_secret

    try:  # by file or inherited fd only: argv and the environment are readable through /proc
        api_key = read_secret(args.api_key_file, args.api_key_fd)
    except SecretError as exc:
        print(f"gyre-cell worker: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s cell-{cfg.cell}: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _die_with_parent()
    if (problem := _claim_devices(cfg)) is not None:
        print(f"gyre-cell worker: cell {cfg.cell}: {problem}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(cfg.cpu_threads)
    print(cfg.model_dump_json(), flush=True)  # the resolved config, first
    worker = CellWorkerProcess(cfg, api_key=api_key)
    try:
        worker.serve()
    except SystemExit as exc:  # uvicorn could not start (its port is taken): leave at once, with a line
        print(
            f"gyre-cell worker: cell {cfg.cell}: HTTP server on {cfg.host}:{cfg.port} did not start",
            file=sys.stderr,
            flush=True,
        )
        os._exit(exc.code if isinstance(exc.code, int) and exc.code else 1)  # a setup thread must not hold it
    finally:
        if worker.training is not None:
            worker.training.close()
        worker.rollout.close()
    # Daemon threads (gloo, Mooncake, the coordinator) must not keep a finished cell alive.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
