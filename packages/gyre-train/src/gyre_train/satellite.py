"""A satellite cell process of multi-cell training (the core side and the protocol: ``gyre_train.multicell``).

The process lives for the whole run and keeps one control connection to the core's coordinator. It trains in
**bursts** (``run_burst``), while the scheduler has the cell in the training role: join the open batch (waiting
while the coordinator answers ``wait``), load the batch's weight snapshot through its
:class:`~gyre_train.snapshot.SnapshotChannel`, claim and run items, ``reduce`` its gradient into the core at the end
of each batch, and receive the parameter broadcast after a non-final update (it stays for the next batch) or return
at the burst's end.

Leaving (``leave`` event) happens only at safe points, never inside a claimed item or a reduce: while waiting to
join (nothing to undo), between batches (after a broadcast: it is taken off the next batch), or while joined but
waiting for work it has not claimed (its reported train items of the open batch are requeued: their gradients stay
in this cell and are discarded). If the joining window closed with it inside, it first takes part in the reduce.
A reduce or broadcast that fails (another member died or hangs in it) ends the burst with ``"collective_failed"``:
the core runs this cell's items again, and the coordinator lets the cell join again once the world is re-formed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client

import orjson
import torch.distributed as dist

from gyre_train.cell import CellWorker
from gyre_train.multicell import MultiCellConfig, PrefixGroups
from gyre_train.snapshot import FileSnapshotChannel, SnapshotChannel
from gyre_train.types import CellRequest, CoordinatorReply, PrepassResult, WorkItem
from gyre_train.world import on_host

log = logging.getLogger(__name__)


class SatelliteRunner:
    """A satellite cell process: join, load the snapshot, claim and run items, reduce, receive broadcasts."""

    def __init__(
        self,
        cfg: MultiCellConfig,
        worker: CellWorker,
        groups: PrefixGroups,
        on_item: Callable[[WorkItem], None] | None = None,
        snapshots: SnapshotChannel | None = None,
    ) -> None:
        self.cfg = cfg
        self.worker = worker
        self.groups = groups
        self.on_item = on_item
        """Runs before each claimed item (failure tests kill the process here)."""
        self.before_collective: Callable[[str, int | None], None] | None = None
        """Runs before this cell's end-of-batch ``"reduce"`` and ``"broadcast"``, with the batch (failure tests stop
        or kill the process here)."""
        self.snapshots: SnapshotChannel = (
            snapshots if snapshots is not None else FileSnapshotChannel(cfg.snapshot_dir)
        )
        self.conn = self._connect()
        self.items_run = 0
        self.joined = False
        """Inside a batch or staying for the next one (after a broadcast)."""
        self.stop_members: list[int] = list(range(cfg.num_cells))
        """Live cells at stop (from the coordinator): the run ends with a barrier over them."""

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

    def _out(self) -> None:
        self.worker.backend.zero_grad()  # nothing of this cell is summed any more
        self.joined = False

    def run(self) -> int:
        """Serve until the core stops (bursts back to back); returns the number of items this cell ran."""
        never = threading.Event()
        while self.run_burst(never) != "stop":
            pass
        return self.items_run

    def run_burst(self, leave: threading.Event) -> str:
        """Train while in the training role; returns why it stopped.

        ``"burst_end"``: a ``batch_done`` without broadcast (the last step of the burst); ``"collective_failed"``:
        the end-of-batch reduce or broadcast failed (another member died or hangs; the core runs this cell's items
        again, and this cell joins no batch until the world is re-formed); ``"left"``: ``leave`` was
        set at a safe point (see the module docstring); ``"stop"``: the run is over (``stop_members`` holds the
        live cells). The control connection stays open for the next burst.
        """
        backend = self.worker.backend
        while True:
            if not self.joined:
                if leave.is_set():
                    return "left"
                reply = self._ask("join")
                if reply.status == "stop":
                    self.stop_members = reply.members or self.stop_members
                    return "stop"
                if reply.status != "joined":  # wait: no open window, or a predecessor has not joined yet
                    leave.wait(self.cfg.poll_s)
                    continue
                backend.zero_grad()
                try:
                    params = self.snapshots.load(reply.snapshot)  # the core's consistent snapshot
                except Exception:
                    self._ask("leave")  # the core must not wait for this cell in the reduce
                    self._out()
                    raise
                backend.load_flat_params(params)
                self.joined = True
            if leave.is_set():  # joined, holding no claim: out now (or reduce first if the window closed)
                reply = self._ask("leave")
                if reply.status == "ok":
                    self._out()
                    return "left"
            else:
                reply = self._ask("claim")
            while reply.status == "item":  # a report is answered with the next claim
                if self.on_item is not None:
                    self.on_item(reply.item)
                result = self.worker.run(reply.item)
                self.items_run += 1
                if isinstance(result, PrepassResult):
                    reply = self._ask("report", prepass=result)
                else:
                    reply = self._ask("report", train=result)
            if reply.status == "batch_done":
                group = self.groups.for_members(reply.members)
                if self.before_collective is not None:
                    self.before_collective("reduce", reply.batch)
                try:
                    dist.reduce(on_host(backend.flat_grads()), dst=0, op=dist.ReduceOp.SUM, group=group)
                    backend.zero_grad()
                    if not reply.broadcast:
                        self._out()  # burst over: back to rollout; a later join pulls a fresh snapshot
                        return "burst_end"
                    flat = on_host(backend.flat_params())
                    if self.before_collective is not None:
                        self.before_collective("broadcast", reply.batch)
                    dist.broadcast(flat, src=0, group=group)
                except RuntimeError as exc:  # another member died or hangs: the core runs our items again
                    log.warning(
                        "cell %d: the end-of-batch collective of batch %s failed (%s); out of training "
                        "until the world is re-formed",
                        self.worker.cell,
                        reply.batch,
                        exc,
                    )
                    self._out()
                    return "collective_failed"
                backend.load_flat_params(flat)  # stays in training for the next batch of the burst
            elif reply.status == "dropped":  # our work was requeued: these gradients must not be summed
                self._out()
            elif reply.status == "stop":
                self.stop_members = reply.members or self.stop_members
                self._out()
                return "stop"
            elif reply.status == "wait":
                leave.wait(self.cfg.poll_s)
