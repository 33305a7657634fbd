"""The control plane of a pipelined cell: one ordered token stream from the cell's leader to its other ranks.

The leader (cell rank 0) decides -- claim an item, pause, drain -- and appends one token per decision; every other
rank reads them in the same order (the schedule in :mod:`gyre_train.megatron.pipeline`, the batch-end operations
in :mod:`gyre_train.megatron.cell`). The stream and the last stages' per-item results live in a
``torch.distributed.TCPStore`` hosted by the leader, which never waits for readers.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch.distributed as dist

from gyre_train.world import bound_store

__all__ = ["ControlChannel"]


class ControlChannel:
    """The cell's token stream and result mailbox in a ``torch.distributed.TCPStore`` hosted by the leader.

    Tokens are keys ``t/<seq>`` (seq counts across batches); the last stage of data-parallel pipeline d posts
    ``r/<seq>/<d>``. Readers acknowledge each batch (``ack/<drain seq>``) and the leader deletes the batch's keys
    once all have. Every thread uses its own store client (``client()``).
    """

    def __init__(self, host: str, port: int, *, rank: int, world: int, timeout_s: float = 3600.0) -> None:
        self.host, self.port, self.rank, self.world = host, port, rank, world
        self.timeout_s = timeout_s
        self._master: Any = None
        if rank == 0:
            self._master = self._store(is_master=True)
            self.port = self._master.port
        self.store = self._store(is_master=False)
        self.seq = 0
        """Next token's sequence number; counts across batches and across the pipelines that use this channel."""
        self._acked: list[tuple[int, int]] = []  # leader: (first seq, drain seq) of batches to delete

    def _store(self, *, is_master: bool) -> Any:
        # the leader's server listens on its own address only (torch's would listen on every interface)
        return bound_store(
            self.host,
            self.port,
            is_master=is_master,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )

    @classmethod
    def create(cls, group: Any = None, host: str | None = None, timeout_s: float = 3600.0) -> ControlChannel:
        """Collective over ``group`` (default: the whole world = the cell): its rank 0 hosts the store on a free
        port and broadcasts the address."""
        host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        chan = cls(host, 0, rank=0, world=world, timeout_s=timeout_s) if rank == 0 else None
        box = [(chan.host, chan.port) if chan is not None else None]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
        )
        if chan is None:
            chan = cls(box[0][0], box[0][1], rank=rank, world=world, timeout_s=timeout_s)
        return chan

    def client(self) -> Any:
        return self._store(is_master=False)

    def _get(self, store: Any, key: str) -> bytes:
        """Block until ``key`` exists (a reader may wait through a long pause), at most ``timeout_s``."""
        try:
            return store.get(key)
        except dist.DistStoreError as exc:
            raise TimeoutError(f"control channel: no {key!r} within {self.timeout_s:.0f} s") from exc

    def publish(self, seq: int, token: dict) -> None:
        self.store.set(f"t/{seq}", json.dumps(token))

    def read(self, seq: int) -> dict:
        return json.loads(self._get(self.store, f"t/{seq}"))

    def post_result(self, seq: int, dp: int, payload: dict) -> None:
        self.store.set(f"r/{seq}/{dp}", json.dumps(payload))

    def take_result(self, store: Any, seq: int, dp: int) -> dict:
        key = f"r/{seq}/{dp}"
        out = json.loads(self._get(store, key))
        store.delete_key(key)
        return out

    def ack(self, drain_seq: int) -> None:
        self.store.add(f"ack/{drain_seq}", 1)

    def retire(self, first: int, drain_seq: int) -> None:
        """Leader: delete the tokens of batch [first, drain_seq] once every reader acknowledged it."""
        self._acked.append((first, drain_seq))
        keep = []
        for a, d in self._acked:
            if self.store.add(f"ack/{d}", 0) >= self.world - 1:
                for s in range(a, d + 1):
                    self.store.delete_key(f"t/{s}")
                self.store.delete_key(f"ack/{d}")
            else:
                keep.append((a, d))
        self._acked = keep
