"""Feeding a Mooncake snapshot into a rollout engine through its SGLang weight-update endpoints.

No engine has an "update from Mooncake" endpoint (SGLang neither), so the subscriber reads next to the client and
pushes the tensors with `/update_weights_from_tensor` inside a begin/end session (SGLang 0.5.23 rules).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ..client import RolloutEngine
from .subscriber import WeightSubscriber


def mooncake_engine_loader(
    subscriber: WeightSubscriber, *, bucket_tensors: int = 64
) -> Callable[[RolloutEngine], Awaitable[str]]:
    """An async loader for `CellRoleManager.to_rollout`: read a consistent snapshot, push it, return its version."""

    async def load(engine: RolloutEngine) -> str:
        snap = await asyncio.to_thread(subscriber.read)
        version = str(snap.version)
        items, seen = [], set()
        for name, t in snap.tensors.items():  # tied names share bytes; the encoder refuses shared storage
            items.append((name, t.clone() if t.data_ptr() in seen else t))
            seen.add(t.data_ptr())
        async with engine.weight_update_session():
            for i in range(0, len(items), bucket_tensors):
                await engine.update_weights_from_tensor(items[i : i + bucket_tensors], weight_version=version)
        return version

    return load
