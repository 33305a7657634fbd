"""Weight broadcast groups over gloo, shared by the trainer side and the torch engine.

SGLang's `/init_weights_update_group` semantics: the trainer is rank 0 and hosts the rendezvous store at
`master_address:master_port`; engines join as `rank_offset + i`. `/update_weights_from_distributed` then
receives one broadcast from rank 0 per tensor, in the order of `names`. We build standalone
`ProcessGroupGloo` objects (no global default group), so a trainer and an engine can even share a process.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gyre_train.world import bound_store

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (SGLang callers send either form)."""
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (supported: {sorted(DTYPES)})")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSpec:
    """Rendezvous of one weight-update group."""

    master_address: str
    """Host of the trainer's rendezvous store."""
    master_port: int
    """Port of the trainer's rendezvous store."""
    world_size: int
    """Trainer rank 0 plus every engine rank."""
    group_name: str = "weight_update_group"
    """Name shared by every member (prefixes the store keys)."""
    timeout_s: float = 60.0
    """Rendezvous and collective timeout."""


def join_group(spec: GroupSpec, rank: int) -> dist.ProcessGroup:
    """Join (rank 0: host) a gloo group; blocks until all `world_size` members have joined."""
    if not 0 <= rank < spec.world_size:
        raise ValueError(f"rank {rank} outside world_size {spec.world_size}")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = bound_store(  # the trainer's server listens on master_address only, not on every interface
        spec.master_address,
        spec.master_port,
        spec.world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    return dist.ProcessGroupGloo(dist.PrefixStore(spec.group_name, store), rank, spec.world_size, timeout)


def broadcast_(pg: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """In-place broadcast from rank 0 (CPU tensors)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def send_weights(pg: dist.ProcessGroup, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Trainer side of `/update_weights_from_distributed`: broadcast each tensor in order."""
    for _, t in named:
        broadcast_(pg, t.detach().to("cpu").contiguous())


def receive_weights(
    pg: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> dict[str, torch.Tensor]:
    """Engine side: receive one broadcast per name into freshly allocated CPU tensors."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtypes and shapes must have the same length")
    out: dict[str, torch.Tensor] = {}
    for name, dt, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=dtype_from_name(dt))
        broadcast_(pg, t)
        out[name] = t
    return out
