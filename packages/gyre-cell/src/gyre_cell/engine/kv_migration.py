"""KV-cache migration between torch engines (paper §4.3, docs/design/cells.md): pin, transfer, acknowledge, release.

When a request moves off an engine (its cell leaves rollout), the destination would normally prefill the whole
context again. Instead:

1. **Pin** (source, `POST /kv/pin`): under the engine lock, take one more reference on the request's KV blocks (its
   execution's reusable prefix is the leading part of them) or on the cached prefix of given token ids, then end the
   request (`finish_reason.type == "abort"`). Every writer appends to blocks it took itself, so pinned blocks no
   longer change. The pool is registered with the Mooncake transfer engine; the answer (`KVExport`) names the peer,
   the pool addresses, the blocks, the token ids they hold and the layout. A pin expires after `ttl_s`.
2. **Take over** (destination, `POST /kv/takeover`): check layout and identity (model fingerprint, dtype, block
   size, layer/head geometry, weight version, and that the exported token ids are a proper prefix of the prompt
   the retry will send), take blocks in its own pool, read the source's blocks straight into them (one batched
   Mooncake read, adjacent blocks coalesced), install them as an *adopted sequence* and **acknowledge**
   (`POST {source_url}/kv/ack`). Only the acknowledgement releases the source's pin; if the source no longer
   holds the pin (expired, dropped), the ack fails and the destination discards what it read (its contents are
   only trusted when the pin was held for the whole read).
3. The retried `/generate` whose tokens start with an adopted sequence's tokens is admitted on those blocks: only
   the tokens after them are computed (for a request cut mid-decode: the one token the source emitted but had not
   written yet). Adopted sequences are bound to the weight version they were computed with and expire too.

Any failure (source gone, timeout, mismatch, no room) leaves no block behind and answers "not installed": the
caller retries normally and the destination recomputes. Never a wrong cache, never a lost request.

The source half lives in `kv_pins.py`, the destination half in `kv_takeover.py`, the wire types in `kv_types.py`;
`KVMigrator` joins them with what both share: the engine's identity, the Mooncake registration of its pool, and
the lifecycle (wait for idle, drop everything before the pool goes away, snapshot).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gyre_cell.errors import KVMigrationError

from ..transfer.mooncake import MooncakeConfig, open_transfer_engine, peer_address
from .kv_pins import SourcePins, _Pin
from .kv_takeover import Takeovers, _Adopted
from .kv_types import (
    KV_SCHEMA_VERSION,
    KVAckBody,
    KVExport,
    KVLayout,
    KVMigrationStats,
    KVPinBody,
    KVTakeoverBody,
    KVTakeoverResult,
    model_fingerprint,
)

if TYPE_CHECKING:
    from .core import TorchEngine


class KVMigrator(SourcePins, Takeovers):
    """The engine's half of KV migration: source pins, destination takeovers, adopted sequences, expiry.

    Pool state is changed only under the engine's lock; Mooncake reads run outside it (the engine keeps stepping)
    into blocks nobody else references."""

    def __init__(
        self, engine: TorchEngine, *, mooncake: MooncakeConfig | None = None, ttl_s: float = 30.0
    ) -> None:
        self.engine = engine
        self.mooncake = mooncake or MooncakeConfig()
        self.ttl_s = ttl_s
        self.api_key: str | None = None
        """Bearer token sent with acknowledgements (the engines of one deployment share it)."""
        self.pins: dict[str, _Pin] = {}
        self.adopted: dict[str, _Adopted] = {}
        self.stats = KVMigrationStats()
        self.before_read: Callable[[KVExport], None] | None = None
        """Test hook: runs on the destination after its blocks are taken, before the Mooncake read."""
        self.on_release: list[Callable[[str, str], None]] = []
        """Callbacks (migration_id, how) when a source pin ends (acked | expired | released) or an adopted sequence
        expires unused (adopted_expired). Called from the thread that ended it, engine lock not held."""
        self._te: Any = None
        self._peer: str | None = None
        self._registered: list[int] = []
        self._reads = 0
        self._idle = threading.Condition(threading.Lock())
        self._fp = model_fingerprint(engine.model.config)

    # ---- identity ----------------------------------------------------------------------------------------------
    def layout(self) -> KVLayout:
        kv = self.engine.kv
        return KVLayout(
            model_fingerprint=self._fp,
            model_type=str(self.engine.model.config.model_type),
            dtype=str(kv.dtype).removeprefix("torch."),
            block_size=kv.block_size,
            num_layers=kv.num_layers,
            kv_heads=kv.kv_heads,
            head_dim=kv.head_dim,
            weight_version=self.engine.weight_version,
        )

    # ---- Mooncake ----------------------------------------------------------------------------------------------
    def _ensure_registered(self) -> None:
        """Open the transfer engine and register the current pool (again if it was re-allocated). Engine lock held."""
        kv = self.engine.kv
        if kv.k_pool is None or kv.v_pool is None:
            raise KVMigrationError("KV cache is released")
        if self._te is None:
            try:
                self._te = open_transfer_engine(self.mooncake)
            except Exception as e:
                raise KVMigrationError(f"KV migration unavailable: {e}") from e
            self._peer = peer_address(self.mooncake, self._te)
        ptrs = [kv.k_pool.data_ptr(), kv.v_pool.data_ptr()]
        if ptrs == self._registered:
            return
        self._unregister()
        for t in (kv.k_pool, kv.v_pool):
            rc = self._te.register_memory(t.data_ptr(), t.nbytes)
            if rc != 0:
                self._unregister()
                raise KVMigrationError(f"Mooncake register_memory of the KV pool returned {rc}")
            self._registered.append(t.data_ptr())

    def _unregister(self) -> None:
        for p in self._registered:
            self._te.unregister_memory(p)
        self._registered = []

    def _geometry(self) -> tuple[int, int]:
        kv = self.engine.kv
        assert kv.k_pool is not None
        elem = kv.k_pool.element_size()
        block_bytes = kv.block_size * kv.kv_heads * kv.head_dim * elem
        return kv.k_pool.stride(0) * elem, block_bytes

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (engine lock NOT held) until no pin is live and no read runs; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self.pins or self._reads:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def drop_all(self) -> None:
        """Before the pool goes away (engine lock held): end every pin and adopted sequence, unregister the pool."""
        for mid in list(self.pins):
            self._end_pin(mid, "dropped")
        for entry in list(self.adopted.values()):
            self.adopted.pop(entry.mid, None)
            if entry.timer is not None:
                entry.timer.cancel()
            if self.engine.kv.allocated:
                self.engine.kv.unpin_blocks(entry.blocks)
        if self._te is not None:
            self._unregister()

    def snapshot(self) -> dict[str, Any]:
        with self.engine._lock:
            now = time.time()
            s = self.stats
            return {
                "layout": self.layout().model_dump(),
                "peer": self._peer,
                "pins": [
                    {
                        "migration_id": p.mid,
                        "blocks": len(p.blocks),
                        "tokens": len(p.tokens),
                        "expires_in_s": round(p.expires_at - now, 3),
                    }
                    for p in self.pins.values()
                ],
                "adopted": [
                    {
                        "migration_id": a.mid,
                        "tokens": len(a.tokens),
                        "weight_version": a.weight_version,
                        "expires_in_s": round(a.expires_at - now, 3),
                    }
                    for a in self.adopted.values()
                ],
                "reads_in_flight": self._reads,
                "stats": {k: v for k, v in s.__dict__.items() if k != "extra"},
                "prefill_tokens_total": self.engine.prefill_tokens_total,
                "context_prefill_tokens_total": self.engine.context_prefill_tokens_total,
            }

    def close(self) -> None:
        with self.engine._lock:
            for p in self.pins.values():
                if p.timer is not None:
                    p.timer.cancel()
            for a in self.adopted.values():
                if a.timer is not None:
                    a.timer.cancel()
            if self._te is not None:
                self._unregister()
                self._te = None


__all__ = [
    "KV_SCHEMA_VERSION",
    "KVAckBody",
    "KVExport",
    "KVLayout",
    "KVMigrationError",
    "KVMigrationStats",
    "KVMigrator",
    "KVPinBody",
    "KVTakeoverBody",
    "KVTakeoverResult",
    "model_fingerprint",
]
