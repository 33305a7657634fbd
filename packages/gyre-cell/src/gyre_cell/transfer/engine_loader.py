"""Feeding a Mooncake snapshot into a rollout engine.

- In-process CPU torch engine (`pull_into_engine`, `published_weights_loader`): on the publisher's host the engine
  serves the publisher's newest buffer as its parameters (`TorchEngine.bind_weights`: no copy); elsewhere, or when
  dtypes differ, the subscriber reads next to the engine and the tensors are applied by HF name with
  `TorchEngine.update_weights` (no HTTP, no serialization), copied in place into the parameters.
- Any engine over HTTP (`mooncake_engine_loader`, for SGLang): no engine has an "update from Mooncake" endpoint, so
  the subscriber reads next to the client and pushes the tensors with `/update_weights_from_tensor` inside a
  begin/end session (SGLang 0.5.23 rules; `push_tensors`, which a cell worker also uses for the core's own buffer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from ..client import RolloutEngine
from ..weight_sync import dtype_name
from .subscriber import WeightSubscriber

if TYPE_CHECKING:
    from ..engine import TorchEngine


def pull_into_engine(engine: TorchEngine, subscriber: WeightSubscriber, *, bind: bool = True) -> str:
    """Read a consistent snapshot of HF-named weights and apply it to an in-process engine; return its version.

    On the publisher's host, when every parameter's dtype and shape match the manifest, the engine binds the newest
    slot: its parameters become read-only views of the publisher's pages (no copy), held by a lease so the publisher
    writes its next publications into the other slot (`WeightStore.bind`). Otherwise the tensors are copied in:
    every parameter must be in the snapshot (all-or-nothing: names and shapes are checked before any copy).
    The update lands between two engine steps: running requests continue on the new weights (their per-token
    weight-version spans show where), the prefix cache is flushed, and `/model_info` reports the new version.
    Blocking (Mooncake read + copy): call it from a worker thread in async code. `bind=False` always copies.
    """
    if bind and subscriber.shared and engine.weights.bindable(_layout(subscriber)):
        with subscriber.lock:
            held = subscriber.lease_newest()
        engine.bind_weights(held.tensors, held.lease, weight_version=str(held.version))
        return str(held.version)
    # The publisher refused NaN/inf (finite_checked): no second pass over the weights here.
    checked = subscriber.manifest.finite_checked

    def apply(tensors: dict[str, torch.Tensor], version: int) -> None:
        engine.update_weights(
            tensors, weight_version=str(version), flush_cache=True, strict=True, check_finite=not checked
        )

    # From the publisher's shared buffer, a write overlapping the copy makes it run again: no step may run on the
    # weights in between. A Mooncake read fills the subscriber's own buffer first, while the engine keeps stepping.
    held_steps = engine.between_steps() if subscriber.shared else contextlib.nullcontext()
    with subscriber.lock, held_steps:  # the snapshot's views are refilled by the next read on this subscriber
        version = str(subscriber.read_apply(apply))
    return version


def _layout(subscriber: WeightSubscriber) -> list[tuple[str, str, list[int]]]:
    return [(e.name, e.dtype, e.shape) for e in subscriber.manifest.tensors]


def bind_published(engine: TorchEngine, own: Mapping[str, torch.Tensor], weight_version: str) -> bool:
    """The core's own engine (same process as the publisher): serve `own` (`WeightPublisher.tensors()`) as its
    parameters, read-only views of that publication's slot under a lease, if dtypes and shapes match and the slot
    still holds it. False: nothing changed, copy `own` in instead."""
    hold = getattr(own, "hold", None)
    layout = [(n, dtype_name(t.dtype), list(t.shape)) for n, t in own.items()]
    if hold is None or not engine.weights.bindable(layout):
        return False
    held = hold()
    if held is None:
        return False
    engine.bind_weights(held.tensors, held.lease, weight_version=weight_version)
    return True


def published_weights_loader(
    subscriber: WeightSubscriber, engine: TorchEngine
) -> Callable[[RolloutEngine], Awaitable[str]]:
    """A `CellRoleManager.to_rollout` loader for an in-process TorchEngine: pulls into `engine` directly.

    The role manager passes its HTTP client of that same engine; the load bypasses it (`engine` is the handle
    the client talks to), so the weights never cross HTTP.
    """

    async def load(_client: RolloutEngine) -> str:
        return await asyncio.to_thread(pull_into_engine, engine, subscriber)

    return load


def mooncake_engine_loader(
    subscriber: WeightSubscriber, *, bucket_tensors: int = 64
) -> Callable[[RolloutEngine], Awaitable[str]]:
    """An async loader for `CellRoleManager.to_rollout`: read a consistent snapshot, push it, return its version."""

    async def load(engine: RolloutEngine) -> str:
        snap = await asyncio.to_thread(subscriber.read)
        version = str(snap.version)
        await push_tensors(engine, snap.tensors.items(), version, bucket_tensors=bucket_tensors)
        return version

    return load


async def push_tensors(
    engine: RolloutEngine,
    named: Iterable[tuple[str, torch.Tensor]],
    version: str,
    *,
    bucket_tensors: int = 64,
) -> None:
    """Push HF-named tensors to an engine over HTTP, `bucket_tensors` per request, inside one weight-update session.
    Tied names share bytes and the encoder refuses shared storage: each later name gets a copy."""
    items, seen = [], set()
    for name, t in named:
        items.append((name, t.clone() if t.data_ptr() in seen else t))
        seen.add(t.data_ptr())
    async with engine.weight_update_session():
        for i in range(0, len(items), bucket_tensors):
            await engine.update_weights_from_tensor(items[i : i + bucket_tensors], weight_version=version)
