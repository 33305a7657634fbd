"""A Megatron cell spread over nodes (`[launcher] bundles_per_cell = n`): its ranks over its placement group's bundles.

The cell worker's actor sits in bundle 0 and is the cell's rank 0. It starts the cell's other ranks (the same
`python -m gyre_cell.worker_stages --rank R` processes the local launcher starts) through :class:`RayRanks`, the
worker's `RankSpawner`: rank r goes to bundle r * n // (T * P); those of bundle 0 are the worker's own children, as
on one machine, and each further bundle's are started by one :class:`RankHost` actor placed on it, on its node, with
gloo bound to that node's interface. The ranks reach the core's rendezvous and the leader's control channel at the
addresses in their config (both bound to node addresses, never loopback across hosts).

Fate: a `RankHost` is owned by the worker's actor, so Ray ends it when the worker dies, and its children die with
the thread that started them (parent-death signal). The other way, a rank's end (or its host's: the node lost) is
seen by the worker's watch on `RankHost.wait`, which takes the worker down: the controller sees a dead cell. Where
each rank runs is appended to RUN/logs/cell-C-ranks.jsonl (rank, bundle, node, IP, PID) when it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gyre.launch.base import spawn_child
from gyre_cell.worker_stages import LocalRanks, RankProcess

__all__ = ["RankHost", "RayRanks", "interface_of"]


def interface_of(ip: str) -> str | None:
    """The network interface holding `ip` (gloo must use it, not whatever the host name resolves to)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def _node() -> dict:
    import ray

    ip = ray.util.get_node_ip_address()
    return {
        "ip": ip,
        "node_id": ray.get_runtime_context().get_node_id(),
        "iface": interface_of(ip),
        "python": sys.executable,
    }


class RankHost:
    """The actor on one further bundle of a cell: starts that bundle's ranks on its node and reports their ends."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}
        self._ended: dict[int, threading.Event] = {}

    def node(self) -> dict:
        return _node()

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> int:
        """Start one rank; returns its PID. One thread forks the child and waits for it, living as long as it:
        the child's parent-death signal fires when the thread that forked it ends."""
        started = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                proc = spawn_child(argv, {}, env, Path(log_path))
            except BaseException as exc:  # reported to the caller below
                box.append(exc)
                started.set()
                return
            self._procs[proc.pid], self._ended[proc.pid] = proc, threading.Event()
            box.append(proc.pid)
            started.set()
            proc.wait()
            self._ended[proc.pid].set()

        threading.Thread(target=run, name="rank-child", daemon=True).start()
        started.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The rank's exit status once it ended; None while it still runs after `timeout`."""
        if not self._ended[pid].wait(timeout):
            return None
        return self._procs[pid].returncode

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


class _RemoteRank:
    """A rank inside a `RankHost`, as the worker sees it (`gyre_cell.worker_stages.RankProcess`). A host that is
    gone (its node lost, its actor killed) reads as a rank killed by SIGKILL."""

    def __init__(self, host: Any, pid: int) -> None:
        self.host, self.pid = host, pid

    def wait(self, timeout: float | None = None) -> int:
        import ray

        try:
            code = ray.get(self.host.wait.remote(self.pid, timeout))
        except ray.exceptions.RayError:
            return -signal.SIGKILL
        if code is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.host.kill.remote(self.pid), timeout=10)


class RayRanks:
    """The worker's `RankSpawner` for a cell of `bundles` bundles and `size` ranks, inside the worker's actor."""

    def __init__(self, bundles: int, size: int, ranks_log: Path) -> None:
        import ray

        self.bundles, self.size, self.ranks_log = bundles, size, ranks_log
        self.group = ray.util.get_current_placement_group()
        if self.group is None:
            raise RuntimeError("a cell spread over bundles runs in its placement group (none found)")
        self._local = LocalRanks()
        self._hosts: dict[int, tuple[Any, dict]] = {}
        self._me = _node()

    def bundle_of(self, local: int) -> int:
        return local * self.bundles // self.size

    def _host(self, bundle: int) -> tuple[Any, dict]:
        if bundle not in self._hosts:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            ranks_here = sum(self.bundle_of(r) == bundle for r in range(self.size))
            actor = (
                ray.remote(max_concurrency=2 * ranks_here + 2)(RankHost)
                .options(
                    num_cpus=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.group, placement_group_bundle_index=bundle
                    ),
                )
                .remote()
            )
            self._hosts[bundle] = (actor, ray.get(actor.node.remote(), timeout=300))
        return self._hosts[bundle]

    def spawn(self, local: int, argv: list[str], log_path: Path) -> RankProcess:
        bundle = self.bundle_of(local)
        if bundle == 0:
            proc: RankProcess = self._local.spawn(local, argv, log_path)
            node = self._me
        else:
            import ray

            actor, node = self._host(bundle)
            env = {"GLOO_SOCKET_IFNAME": node["iface"]} if node["iface"] else {}
            argv = [node["python"], *argv[1:]]  # that node's interpreter
            proc = _RemoteRank(actor, ray.get(actor.spawn.remote(argv, env, str(log_path)), timeout=120))
        row = {"rank": local, "bundle": bundle, "node_id": node["node_id"], "ip": node["ip"], "pid": proc.pid}
        with self.ranks_log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return proc
