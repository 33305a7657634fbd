"""Multi-cell training on CPU: the core and its satellites are separate processes (gloo for tensors, a socket for control).

- **Data plane** (torch.distributed, gloo): rank = cell index (one rank per cell on the torch backend). At start-up
  every process builds the K-1 prefix communication groups (cells 0..p-1 for p = 2..K, :class:`PrefixGroups`);
  each batch's collectives use the group of its participating prefix. At the end of a batch the participants
  ``reduce(SUM)`` their pre-scaled flat gradients into the core (plain sum, no averaging); after a non-final update
  of the burst the core ``broadcast``s the new parameters to them and they stay for the next batch.
- **Control plane**: the core runs a :class:`Coordinator` (a thread serving ``multiprocessing.connection`` clients with
  ``CellRequest`` / ``CoordinatorReply`` JSON) in front of the one shared micro-step queue of its
  :class:`~gyre_train.trainer.Trainer`. A satellite joins a running batch (only while its predecessor trains: the
  training set is always a prefix), loads the core's weight snapshot (published at batch open through a
  :class:`~gyre_train.snapshot.SnapshotChannel`, fixed during accumulation), claims items, reports results. The
  joining window closes when the queue drains, before the update; a late joiner waits for the next batch.
- **Bursts**: a satellite process lives for the whole run and trains only while the scheduler has it in the
  training role (``SatelliteRunner.run_burst``); it leaves at a safe point (``leave`` request: never inside a
  claimed item or a reduce) and joins again later over the same control connection. The core's ``step`` takes
  ``final`` from the scheduler (does this step end the burst: no broadcast) and waits for ready groups as long as
  needed, until its ``abort`` event is set (:class:`StepAborted`).

The core itself also claims and runs items between serving satellites (its main thread), like any cell. The
satellite side is :class:`gyre_train.satellite.SatelliteRunner`.

**Lost satellites.** The coordinator drops a satellite from the open batch when its control connection closes (the
process died: it is dead for the rest of the run) or when it holds a claim longer than ``claim_timeout_s`` (it is
only dropped from this batch; a later request is answered ``dropped``, it discards its gradients and may join
again). The queue requeues the items it claimed and did not report, and the train items it did report (their
gradients are in its backend, which is not summed); its late reports are refused. The batch completes with the
remaining cells, and the end-of-batch collectives run over exactly the remaining members: their prefix group when
they form a prefix, otherwise a fresh gloo group of just those ranks (``new_group(use_local_synchronization=True)``,
cached, created only by its members, so the dead rank is never contacted).

**A failed end-of-batch collective.** A member that dies inside the reduce (its connection closes: the collective
fails at once) or hangs there (a stopped host: it fails after ``collective_timeout_s``) leaves a broken world: gloo
cannot use a group again after one of its collectives failed. The core then keeps its own gradients (the reduce
wrote into a copy), requeues every satellite's train items of the batch (``Coordinator.collective_failed``), runs
them itself and updates alone, with no broadcast. Those satellites are *unformed*: their joins are answered
``wait`` and they are left out of the stop members, until every cell re-formed the world (``new_world``); a live
one that fails on its side of the collective discards its gradients and returns ``"collective_failed"`` from its
burst. The step's report names them (``StepReport.collective_failed``), so the controller re-forms the world at the
next burst boundary.

**World generations** (a lost satellite restarted, a failed collective) are :mod:`gyre_train.world`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path

import orjson
import torch
import torch.distributed as dist

from gyre_train.errors import DataStarvation, RendezvousTimeout, StepAborted
from gyre_train.snapshot import FileSnapshotChannel, SnapshotChannel
from gyre_train.trainer import Trainer
from gyre_train.types import CellRequest, CoordinatorReply, StepReport, WorkItem
from gyre_train.world import PrefixGroups, init_cell_process, on_host, reform_cell_world

__all__ = [
    "Coordinator",
    "CoreRunner",
    "MultiCellConfig",
    "PrefixGroups",
    "RendezvousTimeout",
    "StepAborted",
    "coordinator_key",
    "init_cell_process",
    "reform_cell_world",
]

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 32
"""A control key shorter than this is refused (the library's old default, ``gyre-train``, among them)."""


def coordinator_key(run_secret: str) -> str:
    """The coordinator's key derived from a run's secret (every cell of the run holds it, no agent does): a key of
    its own for this one purpose, so no other use of the secret can give the coordinator's key away."""
    if not run_secret:
        raise ValueError("a run secret is required to derive the coordinator's key")
    return hmac.new(run_secret.encode(), b"gyre-train coordinator", hashlib.sha256).hexdigest()


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
    """Directory of the default snapshot channel (``FileSnapshotChannel``): one weight file per batch."""
    authkey: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    """Shared secret of the control connection: every satellite must prove it holds it. No usable default: a config
    built without one gets a fresh random key, which only the processes handed this config know (a run passes
    :func:`coordinator_key` of its secret to every cell)."""
    steps_per_burst: int = 1
    """mu: after the last step of a burst satellites leave training (no broadcast); ``CoreRunner.step(final=...)``
    overrides it per step (the scheduler decides)."""
    host: str = "127.0.0.1"
    """Address of the core."""
    poll_s: float = 0.005
    """Sleep between polls when there is nothing to claim."""
    starve_timeout_s: float = math.inf
    """How long the core waits for more ready groups (added by another thread) before DataStarvation (default:
    as long as needed; ``step(abort=...)`` ends the wait)."""
    claim_timeout_s: float = 300.0
    """Claim lease: a satellite holding one item longer than this is dropped from the batch, its work requeued."""
    collective_timeout_s: float | None = None
    """Timeout of the collectives between cells (the end-of-batch reduce and broadcast, the end barrier); None:
    gloo's default (30 min). A member that hangs inside one fails it after this long. No micro-step runs inside
    them (the reduce starts once every claimed item is reported); the longest wait is a satellite's for the core's
    optimizer update before the broadcast, which this must exceed."""

    def __post_init__(self) -> None:
        if len(self.authkey) < MIN_KEY_CHARS:
            raise ValueError(
                f"authkey: at least {MIN_KEY_CHARS} characters (use coordinator_key(run secret))"
            )
        if self.num_cells < 1 or self.steps_per_burst < 1:
            raise ValueError("num_cells and steps_per_burst must be >= 1")
        if self.claim_timeout_s <= 0:
            raise ValueError("claim_timeout_s must be > 0")
        if self.collective_timeout_s is not None and self.collective_timeout_s <= 0:
            raise ValueError("collective_timeout_s must be > 0 (or None: gloo's default)")

    def collective_timeout(self) -> timedelta:
        if self.collective_timeout_s is None:
            return dist.default_pg_timeout
        return timedelta(seconds=self.collective_timeout_s)


class Coordinator:
    """The core's control plane in front of the trainer's queue (thread-safe)."""

    def __init__(
        self, cfg: MultiCellConfig, trainer: Trainer, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self._clock = clock  # claim leases run on it (tests inject one instead of waiting)
        self._lock = threading.Condition()
        self._batch: int | None = None
        self._snapshot: str | None = None
        self._participants: set[int] = {0}
        self._carry: set[int] = set()
        self._window_open = False
        self._done: tuple[int, list[int], bool] | None = None  # (batch, members, broadcast)
        self._acked: set[int] = set()
        self._stopping = False
        self._dead: set[int] = set()  # control connection closed: gone for the rest of the run
        self._dropped: set[int] = set()  # dropped (lease expired), not yet told
        self._unformed: set[int] = set()  # a collective with them failed: no batch until a re-form
        self._leases: dict[int, float] = {}  # cell -> monotonic deadline of its current claim
        self._claimed: set[int] = set()  # cells that claimed an item of the open batch
        self.lost: list[tuple[int | None, int, str, int]] = []
        """(batch, cell, reason, items requeued) of every drop, in order."""
        # No authkey on the listener: its accept() would run the handshake in the accept thread, where a peer that
        # connects and closes (or never answers) ended or blocked accepting for every later satellite. Each
        # connection authenticates in its own thread instead (`_serve`).
        self._listener = Listener((cfg.host, cfg.control_port))
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
            self._claimed = set()
            self._window_open = True
            self._lock.notify_all()

    def close_window(self, broadcast: bool) -> list[int]:
        """Close the joining window; returns the cells that take part in the reduce (sorted, core first)."""
        with self._lock:
            self._window_open = False
            self._leases.clear()
            members = sorted(self._participants)
            self._done = (self._batch, members, broadcast)
            self._carry = (self._participants - {0}) if broadcast else set()
            self._lock.notify_all()
            return members

    def lose(self, cell: int, reason: str, dead: bool, tell: bool = True) -> int:
        """Drop ``cell`` from the open batch and requeue its work; returns the number of items requeued.

        ``dead``: the process is gone (never rejoins). ``tell``: answer its next request ``dropped`` (False when
        it asked to leave and is told directly). Outside the accumulation window only the bookkeeping changes
        (it no longer stays for the next batch).
        """
        with self._lock:
            if dead:
                self._dead.add(cell)
                self._lock.notify_all()  # wait_claimed for it ends
            self._leases.pop(cell, None)
            self._carry.discard(cell)
            if not (self._window_open and cell in self._participants):
                return 0
            self._participants.discard(cell)
            requeued = self.trainer.queue.drop_cell(cell)
            if not dead and tell:
                self._dropped.add(cell)
            self.lost.append((self._batch, cell, reason, len(requeued)))
            self._lock.notify_all()
            return len(requeued)

    def expire_leases(self) -> list[int]:
        """Drop every satellite whose claim lease ran out (called from the core's loop); returns them."""
        now = self._clock()
        with self._lock:
            expired = [c for c, deadline in self._leases.items() if deadline <= now]
        for cell in expired:
            self.lose(cell, f"claim lease expired ({self.cfg.claim_timeout_s} s)", dead=False)
        return expired

    def revive(self, cell: int) -> None:
        """``cell``'s process was restarted and is in the current world generation: it may join batches again."""
        with self._lock:
            self._dead.discard(cell)
            self._dropped.discard(cell)

    def collective_failed(self, members: list[int], reason: str) -> dict[int, int]:
        """The end-of-batch collective over ``members`` failed: the world is broken for them. Requeues every
        satellite's work of the batch (the core keeps its own gradients) and reopens the batch for the core alone;
        the satellites are unformed until ``new_world``. Returns the items requeued per satellite."""
        with self._lock:
            requeued = {}
            for cell in members:
                if cell == 0:
                    continue
                requeued[cell] = len(self.trainer.queue.drop_cell(cell))
                self.lost.append((self._batch, cell, f"collective failed: {reason}", requeued[cell]))
                self._unformed.add(cell)
                self._dropped.discard(cell)
                self._leases.pop(cell, None)
            self._participants = {0}
            self._carry = set()
            self._done = None
            self._window_open = True  # joins are refused (unformed); only the core claims the requeued items
            self._lock.notify_all()
            return requeued

    def unform(self, cells: list[int]) -> None:
        """A collective with ``cells`` failed outside a batch (the broadcast after the update): they stay out of
        every batch until ``new_world``."""
        with self._lock:
            self._unformed.update(cells)
            self._carry.difference_update(cells)

    def new_world(self) -> None:
        """Every cell re-formed the world: cells unformed by a failed collective may join batches again."""
        with self._lock:
            self._unformed.clear()

    @property
    def unformed(self) -> set[int]:
        with self._lock:
            return set(self._unformed)

    def live_cells(self) -> list[int]:
        """Cells whose process has not been lost and whose world with the core holds (the end barrier's)."""
        with self._lock:
            return [c for c in range(self.cfg.num_cells) if c not in self._dead and c not in self._unformed]

    def wait_joined(self, cell: int, timeout: float) -> None:
        """Block until ``cell`` participates in the open batch (tests use it to force a mid-batch join)."""
        with self._lock:
            if not self._lock.wait_for(lambda: cell in self._participants, timeout):
                raise TimeoutError(f"cell {cell} did not join within {timeout} s")

    def wait_claimed(self, cell: int, timeout: float) -> None:
        """Block until ``cell`` has claimed an item of the open batch: joined is not enough (a joining satellite
        still loads the snapshot, and a fast core can claim every item meanwhile). Tests gate on it. A cell that
        died first ends the wait at once (TimeoutError too: it will not claim)."""
        with self._lock:
            if not self._lock.wait_for(lambda: cell in self._claimed or cell in self._dead, timeout):
                raise TimeoutError(f"cell {cell} claimed no item within {timeout} s")
            if cell not in self._claimed:
                raise TimeoutError(f"cell {cell} died before it claimed an item")

    def wait_dead(self, cell: int, timeout: float) -> None:
        """Block until ``cell``'s process is known gone (its connection closed). Tests gate on it."""
        with self._lock:
            if not self._lock.wait_for(lambda: cell in self._dead, timeout):
                raise TimeoutError(f"cell {cell} was not lost within {timeout} s")

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
        cell = None  # the satellite on this connection (one per process)
        with conn:
            key = self.cfg.authkey.encode()
            try:  # what Listener(authkey=...) does in accept(): both sides prove they hold the key
                deliver_challenge(conn, key)
                answer_challenge(conn, key)
            except (AuthenticationError, EOFError, OSError) as exc:
                log.warning(
                    "coordinator: refused a connection that failed the handshake (%s)", type(exc).__name__
                )
                return
            while True:
                try:
                    raw = conn.recv_bytes()
                except (EOFError, OSError):
                    break
                try:
                    req = CellRequest.model_validate(orjson.loads(raw))
                    cell = req.cell
                    reply = self.handle(req)
                except Exception as exc:  # a malformed request gets an error reply, not a dead server
                    reply = CoordinatorReply(status="wait", error=f"{type(exc).__name__}: {exc}")
                try:
                    conn.send_bytes(reply.model_dump_json().encode())
                except OSError:
                    break
        with self._lock:
            stopping = self._stopping
        if cell is not None and not stopping:  # the satellite's process is gone
            self.lose(cell, "control connection closed", dead=True)

    def _stop_reply(self) -> CoordinatorReply:
        members = [c for c in range(self.cfg.num_cells) if c not in self._dead and c not in self._unformed]
        return CoordinatorReply(status="stop", members=members)

    def handle(self, req: CellRequest) -> CoordinatorReply:
        if req.cell >= self.cfg.num_cells:
            raise ValueError(f"cell {req.cell} does not exist (K={self.cfg.num_cells})")
        with self._lock:
            if req.cell in self._dead:
                return self._stop_reply()
            if req.op == "leave":
                return self._leave(req.cell)
            if req.cell in self._dropped and req.op != "join":  # its late report is refused (work requeued)
                self._dropped.discard(req.cell)
                return CoordinatorReply(status="dropped", batch=self._batch)
            if req.op == "report":  # record, then answer like a claim (one round trip per item)
                self._leases.pop(req.cell, None)
                self.trainer.report(req.prepass if req.prepass is not None else req.train)
            if req.op == "join":
                self._dropped.discard(req.cell)
                if self._stopping and not self._window_open:
                    return self._stop_reply()
                # cells join serially (the training set is a prefix, up to dead cells)
                ahead = all(c in self._participants or c in self._dead for c in range(req.cell))
                if not self._window_open or not ahead or req.cell in self._unformed:
                    return CoordinatorReply(status="wait")
                self._participants.add(req.cell)
                self._lock.notify_all()
                return CoordinatorReply(status="joined", batch=self._batch, snapshot=self._snapshot)
            # claim (or report)
            done = self._batch_done(req.cell)
            if done is not None:
                return done
            if req.cell not in self._participants or not self._window_open:
                if self._stopping and self._done is not None:
                    return self._stop_reply()
                return CoordinatorReply(status="wait")
            # claim under the lock, so a concurrent drop (lease expiry) sees the claim and requeues it
            item: WorkItem | None = self.trainer.claim(req.cell)
            if item is None:
                return CoordinatorReply(status="wait")
            self._leases[req.cell] = self._clock() + self.cfg.claim_timeout_s
            self._claimed.add(req.cell)
            self._lock.notify_all()
            return CoordinatorReply(status="item", batch=item.microstep.batch, item=item)

    def _batch_done(self, cell: int) -> CoordinatorReply | None:
        """The end-of-batch answer ``cell`` still owes a reduce for (None if it has none)."""
        if self._done is None or cell in self._acked or cell not in self._participants:
            return None
        batch, members, broadcast = self._done
        self._acked.add(cell)
        prefix = len(members) if members == list(range(len(members))) else None
        return CoordinatorReply(
            status="batch_done", batch=batch, prefix=prefix, members=members, broadcast=broadcast
        )

    def _leave(self, cell: int) -> CoordinatorReply:
        """``cell`` leaves training (not inside an item). If the window already closed with it inside, it must
        take part in the reduce first (``batch_done``, then it leaves again); otherwise it is out now: its
        reported train items of the open batch are requeued and it does not stay for the next batch."""
        self._dropped.discard(cell)  # a pending `dropped` is moot: its work is requeued already
        done = self._batch_done(cell)
        if done is not None:
            return done
        self.lose(cell, "left training", dead=False, tell=False)
        return CoordinatorReply(status="ok", batch=self._batch)

    def close(self) -> None:
        self._listener.close()


class CoreRunner:
    """The core process: trains, coordinates satellites, sums gradients, updates, broadcasts.

    ``snapshots``: how joining satellites get the batch's weights (default: ``FileSnapshotChannel(cfg.snapshot_dir)``).
    """

    def __init__(
        self,
        cfg: MultiCellConfig,
        trainer: Trainer,
        groups: PrefixGroups,
        snapshots: SnapshotChannel | None = None,
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.groups = groups
        self.snapshots: SnapshotChannel = (
            snapshots if snapshots is not None else FileSnapshotChannel(cfg.snapshot_dir)
        )
        self.coordinator = Coordinator(cfg, trainer)

    def step(
        self,
        before_core_item: Callable[[int], None] | None = None,
        on_summed_grads: Callable[[torch.Tensor], None] | None = None,
        *,
        final: bool | None = None,
        abort: threading.Event | None = None,
        dump_dir: str | Path | None = None,
        on_wait: Callable[[int], None] | None = None,
    ) -> StepReport:
        """One batch: publish the snapshot, train with the satellites that join, reduce, update, broadcast.

        - ``before_core_item(n)`` runs before each attempt of the core's n-th item; ``on_summed_grads`` sees the
          gradient summed over the cells (before clipping).
        - ``final``: this step ends the burst (satellites leave training: no broadcast); None: ``(batch + 1) %
          steps_per_burst == 0``.
        - While starving (the batch needs groups the buffer does not hold yet; another thread adds them) the core
          waits up to ``cfg.starve_timeout_s`` (default: as long as needed; then ``DataStarvation``), calling
          ``on_wait(groups assigned so far)`` once per wait; if ``abort`` is set while the core waits (for groups
          or for satellites' items) it raises :class:`StepAborted`.
        - ``dump_dir``: dump the batch for ``gyre_train.replay.replay_batch`` (exactness check).
        """
        trainer, coord = self.trainer, self.coordinator
        batch = trainer.version
        coord.open_batch(batch, self.snapshots.publish(batch, trainer.core.backend.flat_params()))
        trainer.open_batch()
        self._accumulate(batch, before_core_item, abort, on_wait)
        if final is None:
            final = (batch + 1) % self.cfg.steps_per_burst == 0
        members = coord.close_window(broadcast=not final)  # lost cells excluded
        group = self.groups.for_members(members)
        backend = trainer.core.backend
        failed: list[int] = []
        if group is not None:
            # a copy: a failed reduce leaves the core's own gradients whole
            flat = on_host(backend.flat_grads())
            try:
                dist.reduce(flat, dst=0, op=dist.ReduceOp.SUM, group=group)
            except RuntimeError as exc:  # a member died (closed connection) or hangs (collective timeout)
                failed = [c for c in members if c != 0]
                requeued = coord.collective_failed(members, str(exc).splitlines()[0][:300])
                log.warning(
                    "batch %d: the reduce with cell(s) %s failed (%s); the core runs their %d item(s) "
                    "itself and updates alone",
                    batch,
                    failed,
                    exc,
                    sum(requeued.values()),
                )
                self._accumulate(batch, None, abort, on_wait)
                coord.close_window(broadcast=False)
                group = None
            else:
                backend.set_flat_grads(flat)
        if on_summed_grads is not None:
            on_summed_grads(backend.flat_grads())
        report = trainer.finish(dump_dir=dump_dir)
        if group is not None and not final:
            try:
                dist.broadcast(on_host(backend.flat_params()), src=0, group=group)
            except RuntimeError as exc:  # the update is done; the satellites that stayed have no weights
                failed = [c for c in members if c != 0]
                coord.unform(failed)
                log.warning("batch %d: the broadcast to cell(s) %s failed (%s)", batch, failed, exc)
        return report.model_copy(update={"collective_failed": failed}) if failed else report

    def _accumulate(
        self,
        batch: int,
        before_core_item: Callable[[int], None] | None,
        abort: threading.Event | None,
        on_wait: Callable[[int], None] | None,
    ) -> None:
        """Run items on the core, serving satellites meanwhile, until every item of the batch is reported."""
        trainer, coord = self.trainer, self.coordinator
        done = 0
        starving_since: float | None = None
        waited_at: int | None = None
        while not trainer.queue.finished:
            coord.expire_leases()
            if before_core_item is not None:
                before_core_item(done)
            if trainer.run_one(trainer.core):
                done += 1
                continue
            if abort is not None and abort.is_set():
                what = "ready groups" if trainer.starving else "the satellites' items"
                raise StepAborted(f"batch {batch} aborted while the core waited for {what}")
            if not trainer.starving:
                starving_since = None
                time.sleep(self.cfg.poll_s)  # satellites hold the remaining items
                continue
            now = time.monotonic()
            if starving_since is None:
                starving_since = now
            assigned = len(trainer.packer.groups)
            if on_wait is not None and waited_at != assigned:
                waited_at = assigned
                on_wait(assigned)
            if now - starving_since >= self.cfg.starve_timeout_s:
                raise DataStarvation(f"batch {batch} needs more ready groups than the buffer holds")
            trainer.buffer.wait_ready(self.cfg.poll_s)  # wakes as soon as a group arrives

    def stop(self) -> None:
        """Tell satellites the run is over (they get ``stop`` on their next request), then close the listener."""
        self.coordinator.stop()
        time.sleep(10 * self.cfg.poll_s)
