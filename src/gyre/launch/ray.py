"""The `ray` launcher: one placement group per cell, each cell worker a Ray actor (`[launcher] kind = "ray"`).

Placement: every worker (the K elastic cells, then the standalone engines) gets its own placement group with one
bundle: its CPUs (`cpus_per_cell`), its GPUs (`gpus_per_cell`) and any custom resources the config names for it
(`cell_resources`, e.g. a node's own resource to pin a cell there). The actor runs in that bundle and runs the same
worker as the local launcher (`gyre_cell.worker.CellWorkerProcess`), in process. An elastic cell may span nodes
(`bundles_per_cell` = n, `cell_strategy`): n bundles sharing its GPUs, the actor in bundle 0, a Megatron cell's
other ranks over the bundles (`gyre.launch.ray_ranks`).

Addresses are exchanged through the controller: each actor first reports its node's IP and free ports on that node;
the controller then writes every worker's config with its node's address (HTTP server, Mooncake `local_hostname`)
and the core's address and ports (the gloo rendezvous and the micro-step coordinator: `training.master_host`), and
starts them. Nothing binds 127.0.0.1 unless the node's address is loopback (a one-machine Ray instance).

Logs: each actor's stdout and stderr go to RUN/logs/cell-I.log (standalone-I.log); RUN/logs/placement.json lists
every worker's node, IP, PID and placement group. The run directory must be on a filesystem every node sees.

The proxy and the evaluator run beside the controller, or as actors on the nodes the config names
(`proxy_resources`, `eval_resources`: `gyre.launch.ray_services`), bound to those nodes' addresses. The controller
is Ray's driver: where `gyre run` runs, or on the node `controller_resources` names (`gyre.launch.placed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.config import LauncherConfig
from gyre.launch.base import Launcher, ServiceError, cell_name, free_ports
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import CellWorkerConfig

log = logging.getLogger("gyre.launch")

__all__ = ["CellActor", "RayLauncher", "connect", "place"]


def _import_ray():
    # Before Ray's first import (its constants are read then): the workers run this interpreter as it is, not
    # through `uv run` with the working tree uploaded; SIGINT/SIGTERM stay gyre's (one line, every process stopped).
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - the dev group has it
        raise ServiceError(
            f"[launcher] kind = 'ray' needs Ray ({exc}): install gyre-rl[ray] (uv sync --extra ray)"
        ) from None
    return ray


def connect(lc: LauncherConfig):
    """Ray, joined to the cluster `lc.address` names (or a new instance on this machine); idempotent."""
    ray = _import_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if lc.address:
        kwargs["address"] = lc.address
    else:  # a new instance on this machine, never one a previous `ray start` left in /tmp/ray
        kwargs["address"] = "local"
        if lc.num_cpus is not None:
            kwargs["num_cpus"] = lc.num_cpus
    # ray.init makes SIGTERM exit the driver at once (sys.exit); gyre's own handler stops every process and prints
    # one line, so it is put back.
    previous = signal.getsignal(signal.SIGTERM)
    ray.init(**kwargs)
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)
    return ray


class CellActor:
    """One cell worker inside a Ray actor: reports its node, then runs `CellWorkerProcess` until shut down."""

    def __init__(self, name: str, log_path: str) -> None:
        self.name, self.log_path = name, log_path
        self._done = threading.Event()
        self._worker: Any = None

    def node(self, taken: list[int] | None = None) -> dict:
        """This actor's node and four free ports there (HTTP; the core's gloo rendezvous and coordinator; an SGLang
        server's), none of `taken`: ports other actors chose and nobody has bound yet (they may be on the same
        node)."""
        import ray

        ip = ray.util.get_node_ip_address()
        ports = free_ports(4, ip, exclude=taken or ())
        return {
            "ip": ip,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "ports": ports,
        }

    def start(self, config_json: str, api_key: str | None = None, bundles: int = 1) -> int:
        """Redirect this process's output to the run's log, then serve the worker in a thread; returns the PID.

        `api_key` (the run's engine token) travels as a call argument over Ray's own channel: never argv or env.
        `bundles` > 1: the cell's ranks spread over its placement group's bundles (`gyre.launch.ray_ranks`)."""
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        import sys

        import torch

        from gyre.launch.ray_ranks import RayRanks, interface_of
        from gyre_cell.worker import CellWorkerProcess

        cfg = CellWorkerConfig.model_validate_json(config_json)
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s {self.name}: %(message)s", stream=sys.stderr, force=True
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)
        if "GLOO_SOCKET_IFNAME" not in os.environ and (iface := interface_of(cfg.host)) is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        torch.set_num_threads(cfg.cpu_threads)
        print(cfg.model_dump_json(), flush=True)  # the resolved config, first (as the local worker does)
        spawner = None
        if bundles > 1 and cfg.training is not None:
            size = cfg.training.tensor_parallel * cfg.training.pipeline_parallel
            spawner = RayRanks(bundles, size, Path(cfg.run_dir) / "logs" / f"cell-{cfg.cell}-ranks.jsonl")
        self._worker = CellWorkerProcess(cfg, api_key=api_key, rank_spawner=spawner)
        threading.Thread(target=self._serve, name="cell-worker", daemon=True).start()
        return os.getpid()

    def _serve(self) -> None:
        worker = self._worker
        try:
            worker.serve()
        except SystemExit:  # uvicorn could not start (its port is taken): the actor ends at once
            logging.getLogger("gyre_cell.worker").error("%s: HTTP server did not start", self.name)
            os._exit(1)
        except BaseException:
            logging.getLogger("gyre_cell.worker").exception("%s: worker stopped", self.name)
        finally:
            with contextlib.suppress(Exception):
                if worker.training is not None:
                    worker.training.close()
                worker.rollout.close()
            self._done.set()
            # Daemon threads (gloo, Mooncake, the coordinator) must not keep a finished cell alive: like the local
            # worker, the process ends here (Ray sees the actor exit).
            os._exit(0)

    def wait_exit(self) -> bool:
        """Returns when the worker stopped; its reference fails with an actor error when the actor died."""
        self._done.wait()
        return True


def place(configs: list[CellWorkerConfig], nodes: list[dict]) -> list[CellWorkerConfig]:
    """Every worker's config with its node's address (from `CellActor.node`): the HTTP server and Mooncake (weights,
    and the engine's KV migration: a destination on another node reads the pinned blocks there) bind the node's IP;
    the gloo rendezvous and the micro-step coordinator are on the core's node (cell 0, first)."""
    core_ip, (_, master_port, coordinator_port, _) = nodes[0]["ip"], nodes[0]["ports"]
    placed = []
    for wc, node in zip(configs, nodes, strict=True):
        update = _on_node(wc, node)
        if wc.training is not None:
            update["training"] = wc.training.model_copy(
                update={
                    "master_host": core_ip,
                    "master_port": master_port,
                    "coordinator_port": coordinator_port,
                }
            )
        placed.append(wc.model_copy(update=update))
    return placed


def _on_node(wc: CellWorkerConfig, node: dict) -> dict[str, Any]:
    """The fields of `wc` that bind to its node: HTTP address and port, Mooncake, the engine's KV transfer."""
    kv_transfer = wc.engine.kv_transfer.model_copy(update={"local_hostname": node["ip"]})
    sglang = wc.sglang and wc.sglang.model_copy(update={"host": node["ip"], "port": node["ports"][3]})
    vllm = wc.vllm and wc.vllm.model_copy(update={"host": node["ip"], "port": node["ports"][3]})
    return {
        "host": node["ip"],
        "port": node["ports"][0],
        "mooncake": wc.mooncake.model_copy(update={"local_hostname": node["ip"]}),
        "engine": wc.engine.model_copy(update={"kv_transfer": kv_transfer}),
        "sglang": sglang,
        "vllm": vllm,
    }


@dataclass
class RayLauncher(Launcher):
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    placement: list[dict] = field(default_factory=list)
    _actors: list[Any] = field(default_factory=list)
    _groups: list[Any] = field(default_factory=list)
    _exits: list[Any] = field(default_factory=list)
    _started_ray: bool = False
    _service_actors: dict[str, tuple[Any, dict]] = field(default_factory=dict)
    """Each service placed on the cluster: its actor and node (`ServiceActor.node`)."""

    kind = "ray"

    def _init_ray(self):
        ray = _import_ray()
        if not ray.is_initialized():
            connect(self.launcher)
            self._started_ray = True  # this launcher ends it (stop)
        return ray

    def _spread(self, wc: CellWorkerConfig) -> int:
        """Bundles of worker `wc`'s placement group: `bundles_per_cell` for an elastic cell, else 1."""
        return self.launcher.bundles_per_cell if wc.kind == "elastic" else 1

    def _bundles(self, i: int, wc: CellWorkerConfig) -> list[dict[str, float]]:
        """Worker i's bundles: each the cell's CPUs and its share of the GPUs; bundle 0 (the worker's) also the
        extra resources the config names for it."""
        lc, n = self.launcher, self._spread(wc)
        bundles = []
        for b in range(n):
            bundle = {"CPU": float(lc.cpus_per_cell if lc.cpus_per_cell is not None else wc.cpu_threads)}
            if lc.gpus_per_cell > 0:
                bundle["GPU"] = lc.gpus_per_cell / n
            if b == 0 and i < len(lc.cell_resources):
                bundle.update(lc.cell_resources[i])
            bundles.append(bundle)
        return bundles

    async def start_cells(self, configs: list[CellWorkerConfig], timeout_s: float = 300.0) -> None:
        ray = self._init_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t0 = time.monotonic()
        remote_cls = ray.remote(max_concurrency=4)(CellActor)
        names = [cell_name(wc) for wc in configs]
        for i, wc in enumerate(configs):
            strategy = self.launcher.cell_strategy if self._spread(wc) > 1 else "STRICT_PACK"
            pg = placement_group(
                self._bundles(i, wc), strategy=strategy, name=f"gyre-{names[i]}-{os.getpid()}"
            )
            self._groups.append(pg)
        try:
            await asyncio.to_thread(
                ray.get, [pg.ready() for pg in self._groups], timeout=self.launcher.start_timeout_s
            )
        except Exception as exc:
            wanted = [self._bundles(i, wc) for i, wc in enumerate(configs)]
            raise ServiceError(
                f"ray: placement groups not ready after {self.launcher.start_timeout_s:.0f} s ({type(exc).__name__}); "
                f"bundles {wanted}, cluster has {ray.cluster_resources()}"
            ) from None
        for i, wc in enumerate(configs):
            bundle = self._bundles(i, wc)[0]
            actor = remote_cls.options(
                name=f"gyre-{names[i]}-{os.getpid()}",
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._groups[i], placement_group_bundle_index=0
                ),
            ).remote(names[i], str(self.log_path(names[i])))
            self._actors.append(actor)
        # Each actor's node and free ports there, then the configs rewritten with them (through the controller).
        # One after the other: each actor chooses its ports knowing those chosen before it (none is bound yet).
        nodes: list[dict] = []
        deadline = time.monotonic() + timeout_s
        for a in self._actors:
            taken = [port for n in nodes for port in n["ports"]]
            left = max(1.0, deadline - time.monotonic())
            nodes.append(await asyncio.to_thread(ray.get, a.node.remote(taken), timeout=left))
        placed = place(configs, nodes)
        cfg_dir = self.run_dir / "cells"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        for name, wc in zip(names, placed, strict=True):
            (cfg_dir / f"{name}.json").write_text(wc.model_dump_json(indent=2))
        await asyncio.to_thread(
            ray.get,
            [
                a.start.remote(wc.model_dump_json(), self.tokens.engine, self._spread(wc))
                for a, wc in zip(self._actors, placed, strict=True)
            ],
        )
        self._exits = [a.wait_exit.remote() for a in self._actors]
        self.placement = [
            {
                "worker": n,
                "node_id": node["node_id"],
                "ip": node["ip"],
                "pid": node["pid"],
                "port": wc.port,
                "placement_group": pg.id.hex(),
                "bundles": self._bundles(i, wc),
            }
            for i, (n, node, wc, pg) in enumerate(zip(names, nodes, placed, self._groups, strict=True))
        ]
        self.log_path("placement").with_suffix(".json").write_text(
            json.dumps(self.placement, indent=1) + "\n"
        )
        for wc in placed:
            if wc.kind == "elastic":
                self._cell_configs[wc.cell] = wc
            client = self.worker_client(f"http://{wc.host}:{wc.port}")
            (self.cells if wc.kind == "elastic" else self.standalone).append(client)
        clients = self.cells + self.standalone

        async def ready(i: int) -> None:
            try:
                await clients[i].wait_ready(timeout_s, alive=lambda: self.alive(i))
            except Exception as exc:
                raise self.started_badly(names[i], exc) from None

        await asyncio.gather(*(ready(i) for i in range(len(clients))))
        log.info(
            "ray: %d worker actor(s) ready in %.1f s on node(s) %s",
            len(clients),
            time.monotonic() - t0,
            sorted({p["ip"] for p in self.placement}),
        )

    # ---- services placed by the config ----------------------------------------------------------------------
    def _service_resources(self, name: str) -> dict[str, float] | None:
        lc = self.launcher
        return {"proxy": lc.proxy_resources, "gyre-eval": lc.eval_resources}.get(name)

    async def _service_address(self, name: str) -> str:
        resources = self._service_resources(name)
        if resources is None:
            return await super()._service_address(name)
        ray = self._init_ray()
        from gyre.launch.ray_services import ServiceActor

        rest = dict(resources)
        num_cpus = rest.pop("CPU", 0.0)
        actor = (
            ray.remote(max_concurrency=2)(ServiceActor)
            .options(
                name=f"gyre-{name}-{os.getpid()}",
                num_cpus=num_cpus,
                resources=rest or None,
            )
            .remote(name, str(self.log_path(name)))
        )
        try:
            node = await asyncio.to_thread(
                ray.get, actor.node.remote(True), timeout=self.launcher.start_timeout_s
            )
        except Exception as exc:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise ServiceError(
                f"ray: {name} not placed after {self.launcher.start_timeout_s:.0f} s ({type(exc).__name__}); "
                f"it asks for {resources}, the cluster has {ray.cluster_resources()}"
            ) from None
        self._service_actors[name] = (actor, node)
        return node["ip"]

    async def _listen_args(self, name: str, host: str) -> tuple[int, list[str]]:
        if name in self._service_actors:  # bound and held on the service's node by its actor
            node = self._service_actors[name][1]
            return node["port"], ["--listen-fd", str(node["listen_fd"])]
        return await super()._listen_args(name, host)

    def _start_process(self, name: str, argv: list[str], tokens: dict[str, str], env: dict[str, str]):
        if name not in self._service_actors:
            return super()._start_process(name, argv, tokens, env)
        import ray

        from gyre.launch.ray_services import RemoteProcess

        actor, node = self._service_actors[name]
        try:  # fails when the actor (its node) is gone, or the service's binary could not start there
            pid = ray.get(actor.spawn.remote(argv, tokens, env), timeout=60)
        except Exception as exc:
            self.service_died = True
            raise ServiceError(
                f"{name} on node {node['ip']}: could not start ({type(exc).__name__}: {str(exc)[:300]}); "
                f"see {self.log_path(name)}"
            ) from None
        self._record_service(name, node, pid)
        return RemoteProcess(actor, pid)

    def _record_service(self, name: str, node: dict, pid: int) -> None:
        """RUN/logs/placement.json lists each placed service beside the workers (its latest process)."""
        row = {
            "worker": name,
            "node_id": node["node_id"],
            "ip": node["ip"],
            "pid": pid,
            "actor_pid": node["actor_pid"],
            "port": node["port"],
            "resources": self._service_resources(name),
        }
        self.placement = [p for p in self.placement if p["worker"] != name] + [row]
        self.log_path("placement").with_suffix(".json").write_text(
            json.dumps(self.placement, indent=1) + "\n"
        )

    async def _restart_cell(
        self, cell: int, wc: CellWorkerConfig, attempt: int, timeout_s: float
    ) -> CellWorkerClient:
        """A new actor in the cell's placement group (Ray places the group again if its node was lost), bound to
        the node it lands on; the old actor is killed first if it still runs (it hung)."""
        ray = self._init_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        name = cell_name(wc)
        with contextlib.suppress(Exception):
            ray.kill(self._actors[cell])
        bundle = self._bundles(cell, wc)[0]
        actor = (
            ray.remote(max_concurrency=4)(CellActor)
            .options(
                name=f"gyre-{name}-{os.getpid()}-restart-{attempt}",
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._groups[cell], placement_group_bundle_index=0
                ),
            )
            .remote(name, str(self.log_path(name)))
        )
        self._actors[cell] = actor
        try:
            node = await asyncio.to_thread(ray.get, actor.node.remote(), timeout=timeout_s)
            wc = wc.model_copy(update=_on_node(wc, node))
            (self.run_dir / "cells" / f"{name}.restart-{attempt}.json").write_text(
                wc.model_dump_json(indent=2)
            )
            await asyncio.to_thread(
                ray.get, actor.start.remote(wc.model_dump_json(), self.tokens.engine, self._spread(wc))
            )
            self._exits[cell] = actor.wait_exit.remote()
            client = self.worker_client(f"http://{wc.host}:{wc.port}")
            await client.wait_ready(timeout_s, alive=lambda: self.alive(cell))
        except Exception as exc:
            raise self.started_badly(name, exc, attempt) from None
        return client

    def alive(self, i: int) -> bool:
        """False once worker i's actor exited or died (its exit reference resolved)."""
        import ray

        ready, _ = ray.wait([self._exits[i]], timeout=0)
        return not ready

    def stop(self, grace_s: float | None = None) -> None:
        super().stop(grace_s)
        if not self._actors and not self._groups and not self._service_actors:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            for actor in [*self._actors, *(a for a, _ in self._service_actors.values())]:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            for pg in self._groups:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
            if self._started_ray:
                ray.shutdown()
        self._actors.clear()
        self._service_actors.clear()
        self._groups.clear()
        self._exits.clear()
