"""The source half of KV migration: pin a request's blocks (or a cached prefix), then acknowledge, release or expire.

A pin takes one more reference on the blocks under the engine lock; every writer appends only to blocks it took
itself, so pinned blocks never change while a destination reads them. Only the destination's acknowledgement, an
explicit release or the pin's expiry gives the reference back.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gyre_cell.errors import EngineInputError, KVMigrationError

from .kv_types import KVExport, KVLayout, KVMigrationStats

if TYPE_CHECKING:
    from .core import TorchEngine


@dataclass(eq=False)
class _Pin:
    mid: str
    blocks: list[int]
    tokens: list[int]
    expires_at: float
    timer: threading.Timer | None = None


class SourcePins:
    """Mixin of `KVMigrator`: the pins this engine holds for destinations."""

    engine: TorchEngine
    ttl_s: float
    pins: dict[str, _Pin]
    stats: KVMigrationStats
    on_release: list[Callable[[str, str], None]]
    _peer: str | None
    _idle: threading.Condition
    _ensure_registered: Callable[[], None]
    _geometry: Callable[[], tuple[int, int]]
    layout: Callable[[], KVLayout]

    def pin(
        self,
        *,
        rid: str | None = None,
        token_ids: list[int] | None = None,
        ttl_s: float | None = None,
        abort: bool = True,
    ) -> KVExport:
        """Pin a running request's blocks (then end it when `abort`) or the cached prefix of `token_ids`."""
        eng, kv = self.engine, self.engine.kv
        if (rid is None) == (token_ids is None):
            raise EngineInputError("give exactly one of rid or token_ids")
        if not eng.config.kv_migration:
            raise KVMigrationError("KV migration is disabled on this engine (kv_migration = false)")
        ttl = ttl_s if ttl_s is not None else self.ttl_s
        with eng._lock:
            eng._drain_inbox()
            if not kv.allocated:
                raise KVMigrationError("KV cache is released")
            if rid is not None:
                with eng._inbox_lock:
                    req = eng._by_rid.get(rid)
                if req is None:
                    raise EngineInputError(f"unknown rid {rid!r}")
                if req.seq is not None and req.seq.num_tokens > 0:
                    n = req.seq.num_tokens
                    tokens = req.all_tokens()[:n]
                    blocks = list(req.seq.blocks[: -(-n // kv.block_size)])
                else:  # waiting or retracted: what the prefix cache holds of it
                    tokens = req.all_tokens()
                    blocks = kv.match_prefix(tokens, max_tokens=len(tokens))
                    tokens = tokens[: len(blocks) * kv.block_size]
            else:
                assert token_ids is not None
                blocks = kv.match_prefix(token_ids, max_tokens=len(token_ids))
                tokens = list(token_ids[: len(blocks) * kv.block_size])
            if not blocks:
                raise KVMigrationError("nothing to migrate: no KV is held for these tokens")
            self._ensure_registered()
            kv.pin_blocks(blocks)
            mid = uuid.uuid4().hex
            pin = _Pin(mid, blocks, tokens, time.time() + ttl)
            self.pins[mid] = pin
            pin.timer = threading.Timer(ttl, self._expire_pin, args=(mid,))
            pin.timer.daemon = True
            pin.timer.start()
            self.stats.pins += 1
            if rid is not None and abort:
                eng.abort(rid, message="Migrating: KV pinned for takeover at another engine")
            layer_stride, block_bytes = self._geometry()
            assert kv.k_pool is not None and kv.v_pool is not None and self._peer is not None
            return KVExport(
                migration_id=mid,
                rid=rid,
                peer=self._peer,
                k_addr=kv.k_pool.data_ptr(),
                v_addr=kv.v_pool.data_ptr(),
                layer_stride=layer_stride,
                block_bytes=block_bytes,
                blocks=blocks,
                token_ids=tokens,
                layout=self.layout(),
                ttl_s=ttl,
                nbytes=2 * kv.num_layers * len(blocks) * block_bytes,
            )

    def _end_pin(self, mid: str, how: str) -> _Pin | None:
        """Engine lock held."""
        pin = self.pins.pop(mid, None)
        if pin is None:
            return None
        if pin.timer is not None:
            pin.timer.cancel()
        if self.engine.kv.allocated:
            self.engine.kv.unpin_blocks(pin.blocks)
        if how != "dropped":
            setattr(self.stats, f"pins_{how}", getattr(self.stats, f"pins_{how}") + 1)
        return pin

    def _notify(self, mid: str, how: str) -> None:
        for cb in list(self.on_release):
            cb(mid, how)
        with self._idle:
            self._idle.notify_all()

    def ack(self, mid: str) -> int:
        """The destination received and took over: release the pin. Unknown (expired, dropped): EngineInputError,
        which tells the destination its read cannot be trusted."""
        with self.engine._lock:
            pin = self._end_pin(mid, "acked")
            if pin is None:
                raise EngineInputError(f"no pin {mid!r} (expired or released)")
            _, block_bytes = self._geometry()
            self.stats.pinned_bytes_served += 2 * self.engine.kv.num_layers * len(pin.blocks) * block_bytes
        self._notify(mid, "acked")
        return len(pin.blocks)

    def release(self, mid: str) -> int:
        """Give a pin up without takeover (the caller recomputes instead)."""
        with self.engine._lock:
            pin = self._end_pin(mid, "released")
        if pin is None:
            raise EngineInputError(f"no pin {mid!r} (expired or released)")
        self._notify(mid, "released")
        return len(pin.blocks)

    def _expire_pin(self, mid: str) -> None:
        with self.engine._lock:
            pin = self._end_pin(mid, "expired")
        if pin is not None:
            self._notify(mid, "expired")
