"""The controller placed on a Ray node by the config (`[launcher] controller_resources`).

With `controller_resources` set, `gyre run` does not run the controller itself. It joins the cluster, starts a
`ServiceActor` (gyre.launch.ray_services) on a node offering those resources, and has that actor start the same
`gyre run` command line there with `--placed-controller GCS_ADDRESS`: that child joins the same cluster as Ray's
driver and runs the controller (scheduler, execution runner and harnesses, trainer coordination), placing the cells
and services as usual. The run directory is fixed (absolute) before, so both processes know it; it is on a
filesystem every node sees, and the child starts in this process's working directory (relative paths in the config
mean the same there).

The placing `gyre run`:
- streams the controller's log (RUN/logs/controller.log: progress, warnings, the last line of a failure) to its own
  stderr while it runs, and prints the controller's stdout (the JSON summary) when it ends, with its exit status;
- on SIGINT or SIGTERM signals the controller's process group with SIGTERM (the controller stops every process and
  says so in one line), waits for it (`STOP_GRACE_S`, then SIGKILL) and exits 128 + the signal number;
- reports a controller whose actor is gone (its node lost) in one line naming the node and the `--resume` command.

Nothing outlives it: the controller dies with its actor, the actor with this driver, the cells with the controller.
RUN/logs/controller.json records where the controller ran (node, IP, PIDs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from gyre.config import RunConfig
from gyre.launch.base import ServiceError

log = logging.getLogger("gyre.launch")

__all__ = ["PLACED_FLAG", "run_placed"]

PLACED_FLAG = "--placed-controller"
"""The child's flag: it runs the controller, joined to the cluster at this GCS address (never places again)."""

STOP_GRACE_S = 120.0
"""After SIGTERM, how long the controller may take to stop its processes before it is killed."""

POLL_S = 0.5
"""How often the controller's state and log are read (the cadence of the streamed log, not an ordering)."""


def run_placed(cfg: RunConfig, argv: list[str], run_dir: Path, command: str = "run") -> int:
    """Place the controller for `gyre ARGV` (with run directory `run_dir`), follow it, return its exit status;
    `command` names it in this process's own lines."""
    from gyre.launch.ray import connect
    from gyre.launch.ray_services import RemoteProcess, ServiceActor

    lc = cfg.launcher
    assert lc.controller_resources is not None
    ray = connect(lc)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path, out_path = logs / "controller.log", logs / "controller.stdout"
    out_path.write_bytes(b"")  # this placement's stdout only (a resumed run places again)
    rest = dict(lc.controller_resources)
    num_cpus = rest.pop("CPU", 0.0)
    actor = (
        ray.remote(max_concurrency=2)(ServiceActor)
        .options(name=f"gyre-controller-{os.getpid()}", num_cpus=num_cpus, resources=rest or None)
        .remote("controller", str(log_path))
    )
    caught: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda s, _f: caught.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        ref, deadline = actor.node.remote(), time.monotonic() + lc.start_timeout_s
        # A signal meanwhile ends the wait: nothing of the run started yet.
        while not ray.wait([ref], timeout=POLL_S)[0]:
            if caught:
                name = signal.Signals(caught[0]).name
                print(
                    f"gyre {command}: interrupted by {name} before the controller was placed", file=sys.stderr
                )
                return 128 + caught[0]
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"ray: the controller not placed after {lc.start_timeout_s:.0f} s; it asks for "
                    f"{lc.controller_resources}, the cluster has {ray.cluster_resources()}"
                )
        try:
            node = ray.get(ref)
        except Exception as exc:
            raise ServiceError(
                f"ray: the controller's actor failed to start: {type(exc).__name__}: {exc}"
            ) from None
        gcs = ray.get_runtime_context().gcs_address
        offset = log_path.stat().st_size if log_path.exists() else 0  # a resumed run's log goes on
        child = [node["python"], "-m", "gyre.cli", *argv, PLACED_FLAG, gcs]
        pid = ray.get(actor.spawn.remote(child, {}, {}, os.getcwd(), str(out_path)), timeout=60)
        where = {"ip": node["ip"], "node_id": node["node_id"], "actor_pid": node["actor_pid"], "pid": pid}
        (logs / "controller.json").write_text(json.dumps(where, indent=1) + "\n")
        log.info("controller placed on node %s (pid %d); its log: %s", node["ip"], pid, log_path)
        returncode = _follow(RemoteProcess(actor, pid), log_path, offset, caught)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(Exception):
            ray.kill(actor)
        if lc.address is None:  # the instance this process started on this machine
            ray.shutdown()
    sys.stdout.write(out_path.read_text())
    sys.stdout.flush()
    if caught:
        return 128 + caught[0]
    if returncode < 0:
        how = signal.Signals(-returncode).name
        print(
            f"gyre {command}: the controller on node {node['ip']} ended: killed by {how} (its node lost?); "
            f"`gyre run --resume {run_dir}` continues the run",
            file=sys.stderr,
        )
        return 1
    return returncode


def _follow(proc, log_path: Path, offset: int, caught: list[int]) -> int:
    """Stream the controller's log from `offset` to stderr until it ends; pass a caught signal on as SIGTERM."""
    stop_deadline: float | None = None
    while True:
        returncode = proc.poll()
        offset = _copy_new(log_path, offset)
        if returncode is not None:
            return returncode
        if caught and stop_deadline is None:
            proc.signal_group(signal.SIGTERM)
            stop_deadline = time.monotonic() + STOP_GRACE_S
        elif stop_deadline is not None and time.monotonic() > stop_deadline:
            proc.signal_group(signal.SIGKILL)
            stop_deadline = float("inf")
        time.sleep(POLL_S)


def _copy_new(path: Path, offset: int) -> int:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    if chunk:
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
    return offset + len(chunk)
