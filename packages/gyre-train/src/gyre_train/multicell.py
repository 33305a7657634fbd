"""Multi-cell training on CPU: the core and its satellites are separate processes (gloo for tensors, a socket for control).

- **Data plane** (torch.distributed, gloo): rank = cell index (one rank per cell on the torch backend). At start-up
  every process builds the K-1 prefix communication groups (cells 0..p-1 for p = 2..K, :class:`PrefixGroups`);
  each batch's collectives use the group of its participating prefix. At the end of a batch the participants
  ``reduce(SUM)`` their pre-scaled flat gradients into the core (plain sum, no averaging); after a non-final update
  of the burst the core ``broadcast``s the new parameters to them and they stay for the next batch.
- **Control plane**: the core runs a :class:`Coordinator` (a thread serving ``multiprocessing.connection`` clients with
  ``CellRequest`` / ``CoordinatorReply`` JSON) in front of the one shared micro-step queue of its
  :class:`~gyre_train.trainer.Trainer`. A satellite joins a running batch (only while its predecessor trains: the
  training set is always a prefix), loads the core's weight snapshot (written at batch open, fixed during
  accumulation), claims items, reports results. The joining window closes when the queue drains, before the update;
  a late joiner waits for the next batch.

The core itself also claims and runs items between serving satellites (its main thread), like any cell.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

import orjson
import torch
import torch.distributed as dist

from gyre_train.cell import CellWorker
from gyre_train.trainer import DataStarvation, Trainer
from gyre_train.types import CellRequest, CoordinatorReply, PrepassResult, StepReport


@dataclass(frozen=True, kw_only=True, slots=True)
class MultiCellConfig:
    """Process layout of multi-cell training on one machine."""

    num_cells: int
    """K: ordered cells (0 = core)."""
    master_port: int
    """TCP port of the gloo rendezvous (torch.distributed init_method)."""
    control_port: int
    """TCP port of the core's coordinator."""
    snapshot_dir: str
    """Directory where the core writes the weight snapshot of each batch."""
    authkey: str = "gyre-train"
    """Shared secret of the control connection."""
    steps_per_burst: int = 1
    """mu: after the last step of a burst satellites leave training (no broadcast)."""
    host: str = "127.0.0.1"
    """Address of the core."""
    poll_s: float = 0.005
    """Sleep between polls when there is nothing to claim."""
    starve_timeout_s: float = 0.0
    """How long the core waits for more ready groups (added by another thread) before DataStarvation."""

    def __post_init__(self) -> None:
        if self.num_cells < 1 or self.steps_per_burst < 1:
            raise ValueError("num_cells and steps_per_burst must be >= 1")


def init_cell_process(cfg: MultiCellConfig, cell: int) -> PrefixGroups:
    """Join the gloo world as rank ``cell`` and build the prefix groups (every process, same order)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://{cfg.host}:{cfg.master_port}", rank=cell, world_size=cfg.num_cells
    )
    return PrefixGroups(cfg.num_cells)


class PrefixGroups:
    """K-1 communication-group sets, one per prefix of 2..K cells, built once at start-up."""

    def __init__(self, num_cells: int) -> None:
        self.num_cells = num_cells
        self.groups = {p: dist.new_group(list(range(p))) for p in range(2, num_cells + 1)}

    def for_prefix(self, prefix: int):
        if prefix not in self.groups:
            raise ValueError(f"no communication group for a prefix of {prefix} cells (K={self.num_cells})")
        return self.groups[prefix]


class Coordinator:
    """The core's control plane in front of the trainer's queue (thread-safe)."""

    def __init__(self, cfg: MultiCellConfig, trainer: Trainer) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self._lock = threading.Condition()
        self._batch: int | None = None
        self._snapshot: str | None = None
        self._participants: set[int] = {0}
        self._carry: set[int] = set()
        self._window_open = False
        self._done: tuple[int, int, bool] | None = None  # (batch, prefix, broadcast)
        self._acked: set[int] = set()
        self._stopping = False
        self._listener = Listener((cfg.host, cfg.control_port), authkey=cfg.authkey.encode())
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True, name="coordinator-accept").start()

    # --- core side -------------------------------------------------------------------------------------------

    def open_batch(self, batch: int, snapshot: str) -> None:
        with self._lock:
            self._batch, self._snapshot = batch, snapshot
            self._participants = {0} | self._carry
            self._carry = set()
            self._done = None
            self._acked = set()
            self._window_open = True
            self._lock.notify_all()

    def close_window(self, broadcast: bool) -> int:
        """Close the joining window; returns the participating prefix size."""
        with self._lock:
            self._window_open = False
            prefix = max(self._participants) + 1
            self._done = (self._batch, prefix, broadcast)
            self._carry = (self._participants - {0}) if broadcast else set()
            self._lock.notify_all()
            return prefix

    def wait_joined(self, cell: int, timeout: float) -> None:
        """Block until ``cell`` participates in the open batch (tests use it to force a mid-batch join)."""
        with self._lock:
            if not self._lock.wait_for(lambda: cell in self._participants, timeout):
                raise TimeoutError(f"cell {cell} did not join within {timeout} s")

    def stop(self) -> None:
        with self._lock:
            self._stopping = True

    @property
    def participants(self) -> set[int]:
        with self._lock:
            return set(self._participants)

    # --- satellite side (server threads) ---------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="coordinator-conn")
            t.start()
            self._threads.append(t)

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    raw = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                try:
                    reply = self.handle(CellRequest.model_validate(orjson.loads(raw)))
                except Exception as exc:  # a malformed request gets an error reply, not a dead server
                    reply = CoordinatorReply(status="wait", error=f"{type(exc).__name__}: {exc}")
                conn.send_bytes(reply.model_dump_json().encode())

    def handle(self, req: CellRequest) -> CoordinatorReply:
        if req.cell >= self.cfg.num_cells:
            raise ValueError(f"cell {req.cell} does not exist (K={self.cfg.num_cells})")
        with self._lock:
            if req.op == "report":  # record, then answer like a claim (one round trip per item)
                self.trainer.report(req.prepass if req.prepass is not None else req.train)
            if req.op == "join":
                if self._stopping and not self._window_open:
                    return CoordinatorReply(status="stop")
                if not self._window_open or req.cell - 1 not in self._participants:
                    return CoordinatorReply(
                        status="wait"
                    )  # cells join serially: the training set is a prefix
                self._participants.add(req.cell)
                self._lock.notify_all()
                return CoordinatorReply(status="joined", batch=self._batch, snapshot=self._snapshot)
            # claim (or report)
            if self._done is not None and req.cell not in self._acked and req.cell in self._participants:
                batch, prefix, broadcast = self._done
                self._acked.add(req.cell)
                return CoordinatorReply(status="batch_done", batch=batch, prefix=prefix, broadcast=broadcast)
            if req.cell not in self._participants or not self._window_open:
                if self._stopping and self._done is not None:
                    return CoordinatorReply(status="stop")
                return CoordinatorReply(status="wait")
        item = self.trainer.claim(req.cell)
        if item is None:
            return CoordinatorReply(status="wait")
        return CoordinatorReply(status="item", batch=item.microstep.batch, item=item)

    def close(self) -> None:
        self._listener.close()


class CoreRunner:
    """The core process: trains, coordinates satellites, sums gradients, updates, broadcasts."""

    def __init__(self, cfg: MultiCellConfig, trainer: Trainer, groups: PrefixGroups) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.groups = groups
        self.coordinator = Coordinator(cfg, trainer)
        Path(cfg.snapshot_dir).mkdir(parents=True, exist_ok=True)

    def _write_snapshot(self, batch: int) -> str:
        path = Path(self.cfg.snapshot_dir) / f"snapshot-{batch}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(self.trainer.core.backend.flat_params(), tmp)
        os.replace(tmp, path)  # readers never see a partial file
        old = Path(self.cfg.snapshot_dir) / f"snapshot-{batch - 1}.pt"
        old.unlink(missing_ok=True)
        return str(path)

    def step(
        self,
        before_core_item: Callable[[int], None] | None = None,
        on_summed_grads: Callable[[torch.Tensor], None] | None = None,
    ) -> StepReport:
        """One batch; ``before_core_item(n)`` runs before the core's n-th item, ``on_summed_grads`` sees the sum."""
        trainer, coord = self.trainer, self.coordinator
        batch = trainer.version
        coord.open_batch(batch, self._write_snapshot(batch))
        trainer.open_batch()
        done = 0
        starving_since = None
        while not trainer.queue.finished:
            if before_core_item is not None:
                before_core_item(done)
            if trainer.run_one(trainer.core):
                done += 1
                starving_since = None
                continue
            if trainer.starving:
                starving_since = starving_since or time.monotonic()
                if time.monotonic() - starving_since >= self.cfg.starve_timeout_s:
                    raise DataStarvation(f"batch {batch} needs more ready groups than the buffer holds")
            time.sleep(self.cfg.poll_s)  # satellites hold the remaining items, or groups are still arriving
        final = (batch + 1) % self.cfg.steps_per_burst == 0
        prefix = coord.close_window(broadcast=not final)
        backend = trainer.core.backend
        if prefix > 1:
            flat = backend.flat_grads()
            dist.reduce(flat, dst=0, op=dist.ReduceOp.SUM, group=self.groups.for_prefix(prefix))
            backend.set_flat_grads(flat)
        if on_summed_grads is not None:
            on_summed_grads(backend.flat_grads())
        report = trainer.finish()
        if prefix > 1 and not final:
            dist.broadcast(backend.flat_params(), src=0, group=self.groups.for_prefix(prefix))
        return report

    def stop(self) -> None:
        """Tell satellites the run is over (they get ``stop`` on their next request), then close the listener."""
        self.coordinator.stop()
        time.sleep(10 * self.cfg.poll_s)


class SatelliteRunner:
    """A satellite cell process: join, load the snapshot, claim and run items, reduce, receive broadcasts."""

    def __init__(self, cfg: MultiCellConfig, worker: CellWorker, groups: PrefixGroups) -> None:
        self.cfg = cfg
        self.worker = worker
        self.groups = groups
        self.conn = self._connect()
        self.items_run = 0

    def _connect(self, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return Client((self.cfg.host, self.cfg.control_port), authkey=self.cfg.authkey.encode())
            except (ConnectionRefusedError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _ask(self, op: str, **kw) -> CoordinatorReply:
        self.conn.send_bytes(CellRequest(op=op, cell=self.worker.cell, **kw).model_dump_json().encode())
        reply = CoordinatorReply.model_validate(orjson.loads(self.conn.recv_bytes()))
        if reply.error:
            raise RuntimeError(f"coordinator refused {op}: {reply.error}")
        return reply

    def run(self) -> int:
        """Serve until the core stops; returns the number of items this cell ran."""
        backend = self.worker.backend
        joined = False
        while True:
            if not joined:
                reply = self._ask("join")
                if reply.status == "stop":
                    return self.items_run
                if reply.status == "wait":
                    time.sleep(self.cfg.poll_s)
                    continue
                backend.zero_grad()
                backend.load_flat_params(torch.load(reply.snapshot))  # the core's consistent snapshot
                joined = True
            reply = self._ask("claim")
            while reply.status == "item":  # a report is answered with the next claim
                result = self.worker.run(reply.item)
                self.items_run += 1
                if isinstance(result, PrepassResult):
                    reply = self._ask("report", prepass=result)
                else:
                    reply = self._ask("report", train=result)
            if reply.status == "batch_done":
                group = self.groups.for_prefix(reply.prefix)
                dist.reduce(backend.flat_grads(), dst=0, op=dist.ReduceOp.SUM, group=group)
                backend.zero_grad()
                if reply.broadcast:
                    flat = backend.flat_params()
                    dist.broadcast(flat, src=0, group=group)
                    backend.load_flat_params(flat)  # stays in training for the next batch of the burst
                else:
                    joined = False  # burst over: back to rollout; a later join pulls a fresh snapshot
            elif reply.status == "stop":
                return self.items_run
            else:
                time.sleep(self.cfg.poll_s)
