"""The gloo world of a multi-cell run: the prefix groups its collectives use, and its generations.

**World generations.** A dead rank's place in the fixed K-rank world cannot be taken by a new process. When a lost
satellite was restarted, every cell re-forms the world at a burst boundary (no batch open, no collective in flight):
``reform_cell_world`` destroys the old world and its groups and joins a new one of the same K ranks on a fresh
rendezvous port (the restarted process takes its old rank); the coordinator's control connection is untouched, and
:meth:`gyre_train.multicell.Coordinator.revive` lets the restarted cell join batches again. A cell that is gone for
good (its restarts spent) is left out of the new generation (``members``): the world then has one rank per member,
in cell order (rank = position, the core still rank 0), and ``PrefixGroups`` maps the cells it is given to those
ranks.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gyre_train.errors import RendezvousTimeout

if TYPE_CHECKING:
    from gyre_train.multicell import MultiCellConfig

__all__ = [
    "PrefixGroups",
    "RendezvousTimeout",
    "bound_store",
    "init_cell_process",
    "on_host",
    "reform_cell_world",
]


def bound_store(
    host: str,
    port: int,
    world_size: int | None = None,
    *,
    is_master: bool,
    timeout: timedelta,
    wait_for_workers: bool = True,
) -> dist.TCPStore:
    """A ``TCPStore`` whose server (``is_master``) listens on ``host`` only, the address its clients use.

    torch's TCPStore has no bind address: its server listens on every interface (``::`` or ``0.0.0.0``), and the
    store answers anyone with no credential. It does take a socket already listening (``master_listen_fd``), so the
    server's socket is bound here, to ``host`` (loopback on one machine, the node's cluster address on many).
    ``port`` 0 takes a free one (the store's ``port`` tells which)."""
    if not is_master:
        return dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=wait_for_workers
        )
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's own server does
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # The store owns the socket from here (its server closes it, also when the constructor fails waiting for
    # workers): closing it again on an error could close an unrelated fd that took the number meanwhile.
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=sock.detach(),
    )


def on_host(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` in host memory: the world's collectives run over gloo, whose reduce takes CPU tensors only (a cell
    training on CUDA sends a host copy; the backends' ``set_flat_grads`` / ``load_flat_params`` move it back)."""
    return flat if flat.device.type == "cpu" else flat.cpu()


def init_cell_process(cfg: MultiCellConfig, cell: int) -> PrefixGroups:
    """Join the gloo world as rank ``cell`` and build the prefix groups (every process, same order)."""
    store = bound_store(
        cfg.host, cfg.master_port, cfg.num_cells, is_master=cell == 0, timeout=dist.default_pg_timeout
    )
    dist.init_process_group("gloo", store=store, rank=cell, world_size=cfg.num_cells)
    return PrefixGroups(cfg.num_cells, timeout=cfg.collective_timeout())


def reform_cell_world(
    cfg: MultiCellConfig,
    cell: int,
    master_port: int,
    rendezvous_timeout_s: float = 120.0,
    members: list[int] | None = None,
) -> PrefixGroups:
    """A new generation of the gloo world (see the module docstring): every cell calls it, with the same fresh
    ``master_port``, while none is inside a batch; returns the new prefix groups (the old ones are destroyed).

    The rendezvous is bounded: a rank that died or hangs after the others were told to re-form would otherwise
    hold every cell for gloo's default timeout (30 min). The core (rank 0) hosts the rendezvous store and waits
    ``rendezvous_timeout_s`` for all K ranks; past it every waiting rank raises :class:`RendezvousTimeout` and is
    left without a world (none is initialized: the old one is destroyed), ready to call this again with the next
    port. The new world's collectives take ``cfg.collective_timeout_s``.

    ``members``: the cells of the new generation, None for all K; a cell gone for good is left out, and every member
    passes the same list. Rank = position in it (the core, first, stays rank 0)."""
    members = sorted(members) if members is not None else list(range(cfg.num_cells))
    if not members or members[0] != 0 or cell not in members or members[-1] >= cfg.num_cells:
        raise ValueError(f"members {members}: need the core (0), this cell ({cell}) and cells below K")
    size = len(members)
    if dist.is_initialized():
        dist.destroy_process_group()
    timeout = timedelta(seconds=rendezvous_timeout_s)
    try:
        store = bound_store(cfg.host, master_port, size, is_master=cell == 0, timeout=timeout)
        # Every rank checks in, so a non-core rank too stops waiting once the timeout passed (it may have reached
        # the store while another rank never did).
        store.add("arrived", 1)
        deadline = time.monotonic() + rendezvous_timeout_s
        while int(store.add("arrived", 0)) < size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{int(store.add('arrived', 0))} of {size} ranks arrived")
            time.sleep(0.05)
    except Exception as exc:  # DistStoreError / TimeoutError / a closed store (the core gave up first)
        raise RendezvousTimeout(
            f"world generation on port {master_port}: not every one of the cells {members} arrived "
            f"within {rendezvous_timeout_s:g} s ({type(exc).__name__}: {exc})"
        ) from exc
    # A rank can also die after checking in: gloo's own rendezvous (inside init) then waits for it, bounded by the
    # same timeout. Only the world's default group gets it: every collective runs on the prefix and member groups,
    # which take the collective timeout.
    try:
        dist.init_process_group(
            "gloo", store=store, rank=members.index(cell), world_size=size, timeout=timeout
        )
    except Exception as exc:
        _forget_failed_world()
        raise RendezvousTimeout(
            f"world generation on port {master_port}: a rank of the cells {members} checked in but the world was "
            f"not built within {rendezvous_timeout_s:g} s ({type(exc).__name__}: {exc})"
        ) from exc
    return PrefixGroups(cfg.num_cells, members, timeout=cfg.collective_timeout())


def _forget_failed_world() -> None:
    """After a world that was not built: torch names groups by a per-process count, which the failed init advanced
    and only a destroyed world resets. A restarted process starts from zero, so without this the next generation's
    ranks would wait for each other under different names. A one-rank world on a local store, destroyed at once,
    resets it with public calls only."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()


class PrefixGroups:
    """Communication groups over the world's ranks, one per prefix of 2..n ranks, built once per world.

    ``cells``: the cell of each position (None: position = cell, all K). A cell's rank is ``position * stride``:
    1 for one-process cells, a cell's rank count ``T`` for tensor-parallel cells, whose leaders megatron's rank
    order puts T apart (``gyre_train.megatron.cell``). Callers speak cells; a world that left out a cell gone for
    good maps them to its ranks."""

    def __init__(
        self,
        num_cells: int,
        cells: list[int] | None = None,
        timeout: timedelta | None = None,
        *,
        stride: int = 1,
    ) -> None:
        self.num_cells = num_cells
        self.cells = list(cells) if cells is not None else list(range(num_cells))
        self.stride = stride
        self._rank = {c: r * stride for r, c in enumerate(self.cells)}
        self._timeout = timeout  # of every group's collectives (None: the world's)
        self.groups = {
            p: dist.new_group([r * stride for r in range(p)], timeout=timeout)
            for p in range(2, len(self.cells) + 1)
        }
        self._fresh: dict[tuple[int, ...], object] = {}

    def for_prefix(self, prefix: int):
        """The group of positions 0..prefix-1 (cells 0..prefix-1 when no cell was left out)."""
        if prefix not in self.groups:
            raise ValueError(f"no communication group for a prefix of {prefix} ranks (cells {self.cells})")
        return self.groups[prefix]

    def rank_of(self, cell: int) -> int:
        if cell not in self._rank:
            raise ValueError(f"cell {cell} is not in this world (cells {self.cells})")
        return self._rank[cell]

    def for_members(self, members: list[int]):
        """Group of exactly the cells ``members`` (None for one cell): a prefix group, else a fresh group of their
        ranks.

        A fresh group is created by its members only (``use_local_synchronization``), so a dead rank outside it
        is never contacted; it is cached by rank set, and every member calls this with the same set in the same
        order (the coordinator's ``members``), so their group names agree.
        """
        ranks = sorted(self.rank_of(c) for c in members)
        if len(ranks) <= 1:
            return None
        if ranks == [r * self.stride for r in range(len(ranks))]:
            return self.for_prefix(len(ranks))
        key = tuple(ranks)
        if key not in self._fresh:
            self._fresh[key] = dist.new_group(ranks, timeout=self._timeout, use_local_synchronization=True)
        return self._fresh[key]

    def barrier(self, members: list[int]) -> None:
        """Barrier over ``members`` (the live cells at the end of a run)."""
        group = self.for_members(members)
        if group is not None:
            dist.barrier(group=group)
