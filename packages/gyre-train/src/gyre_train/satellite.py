"""A satellite cell process of multi-cell training (the core side and the protocol: ``gyre_train.multicell``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Client

import orjson
import torch
import torch.distributed as dist

from gyre_train.cell import CellWorker
from gyre_train.multicell import MultiCellConfig, PrefixGroups
from gyre_train.types import CellRequest, CoordinatorReply, PrepassResult, WorkItem


class SatelliteRunner:
    """A satellite cell process: join, load the snapshot, claim and run items, reduce, receive broadcasts."""

    def __init__(
        self,
        cfg: MultiCellConfig,
        worker: CellWorker,
        groups: PrefixGroups,
        on_item: Callable[[WorkItem], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.worker = worker
        self.groups = groups
        self.on_item = on_item
        """Runs before each claimed item (failure tests kill the process here)."""
        self.conn = self._connect()
        self.items_run = 0
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

    def run(self) -> int:
        """Serve until the core stops; returns the number of items this cell ran."""
        backend = self.worker.backend
        joined = False
        while True:
            if not joined:
                reply = self._ask("join")
                if reply.status == "stop":
                    self.stop_members = reply.members or self.stop_members
                    return self.items_run
                if reply.status == "wait":
                    time.sleep(self.cfg.poll_s)
                    continue
                backend.zero_grad()
                backend.load_flat_params(torch.load(reply.snapshot))  # the core's consistent snapshot
                joined = True
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
                dist.reduce(backend.flat_grads(), dst=0, op=dist.ReduceOp.SUM, group=group)
                backend.zero_grad()
                if reply.broadcast:
                    flat = backend.flat_params()
                    dist.broadcast(flat, src=0, group=group)
                    backend.load_flat_params(flat)  # stays in training for the next batch of the burst
                else:
                    joined = False  # burst over: back to rollout; a later join pulls a fresh snapshot
            elif reply.status == "dropped":  # our work was requeued: these gradients must not be summed
                backend.zero_grad()
                joined = False
            elif reply.status == "stop":
                self.stop_members = reply.members or self.stop_members
                return self.items_run
            else:
                time.sleep(self.cfg.poll_s)
