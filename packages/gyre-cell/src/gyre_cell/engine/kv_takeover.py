"""The destination half of KV migration: take over pinned blocks, hold them as adopted sequences, admit on them.

`takeover` checks layout and identity, takes blocks in this engine's pool, reads the source's blocks straight into
them (one batched Mooncake read, adjacent blocks coalesced, outside the engine lock: nobody else references them),
installs them as an *adopted sequence* and acknowledges to the source. A retried request whose tokens start with an
adopted sequence's tokens is admitted on its blocks (`match`, `take`). Adopted sequences are bound to the weight
version they were computed with and expire into the prefix cache when nobody claims them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from gyre_cell.errors import KVCacheFullError, KVMigrationError

from .kv_cache import SeqBlocks
from .kv_types import KVExport, KVLayout, KVMigrationStats, KVTakeoverResult

if TYPE_CHECKING:
    from .core import TorchEngine


@dataclass(eq=False)
class _Adopted:
    mid: str
    blocks: list[int]
    tokens: list[int]
    weight_version: str
    expires_at: float
    timer: threading.Timer | None = None


class Takeovers:
    """Mixin of `KVMigrator`: takeovers this engine makes as a destination and the adopted sequences they leave."""

    engine: TorchEngine
    ttl_s: float
    api_key: str | None
    adopted: dict[str, _Adopted]
    stats: KVMigrationStats
    before_read: Callable[[KVExport], None] | None
    _te: Any
    _reads: int
    _idle: threading.Condition
    _ensure_registered: Callable[[], None]
    _geometry: Callable[[], tuple[int, int]]
    _notify: Callable[[str, str], None]
    layout: Callable[[], KVLayout]
    _ack_client: httpx.Client | None = None  # made at the first ack (this engine's, reused)

    # ---- destination: takeover ---------------------------------------------------------------------------------
    def _refusal(self, export: KVExport, token_ids: list[int] | None) -> str | None:
        mine, theirs = self.layout(), export.layout
        for f in (
            "model_fingerprint",
            "model_type",
            "dtype",
            "block_size",
            "num_layers",
            "kv_heads",
            "head_dim",
        ):
            if getattr(mine, f) != getattr(theirs, f):
                return f"layout mismatch: {f} {getattr(theirs, f)!r} (source) != {getattr(mine, f)!r} (here)"
        if mine.weight_version != theirs.weight_version:
            return f"weight version {theirs.weight_version!r} (source) != {mine.weight_version!r} (here)"
        n = len(export.token_ids)
        if n == 0 or len(export.blocks) != -(-n // mine.block_size):
            return f"{len(export.blocks)} blocks do not hold {n} tokens of block size {mine.block_size}"
        _, block_bytes = self._geometry()
        if export.block_bytes != block_bytes:
            return f"block bytes {export.block_bytes} (source) != {block_bytes} (here)"
        if token_ids is not None and not (n < len(token_ids) and token_ids[:n] == export.token_ids):
            return "token ids: the exported tokens are not a proper prefix of the request's tokens"
        bad = [t for t in export.token_ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            return f"token ids out of range: {bad[:5]}"
        return None

    def takeover(
        self,
        export: KVExport,
        *,
        token_ids: list[int] | None = None,
        timeout_s: float = 30.0,
        ack: Callable[[KVExport], bool] | None = None,
    ) -> KVTakeoverResult:
        """Read the exported blocks into this engine's pool, install them, acknowledge. Never raises for a
        transfer problem: the result says what happened (not installed = recompute)."""
        t0 = time.perf_counter()
        mid = export.migration_id

        def done(status: str, reason: str | None = None, **kw: Any) -> KVTakeoverResult:
            setattr(self.stats, f"takeovers_{status}", getattr(self.stats, f"takeovers_{status}") + 1)
            if reason is not None:
                self.stats.last_failure = reason
            return KVTakeoverResult(
                migration_id=mid, status=status, reason=reason, total_s=time.perf_counter() - t0, **kw
            )

        eng, kv = self.engine, self.engine.kv
        if not eng.config.kv_migration:
            return done("refused", "KV migration is disabled on this engine (kv_migration = false)")
        with eng._lock:
            if not kv.allocated:
                return done("failed", "KV cache is released here")
            refusal = self._refusal(export, token_ids)
            if refusal is not None:
                return done("refused", refusal)
            if ack is None and not export.source_url:
                return done("refused", "no source_url to acknowledge to")
            try:
                self._ensure_registered()
                blocks = kv.take_blocks(len(export.blocks))
            except (KVMigrationError, KVCacheFullError) as e:
                return done("failed", str(e))
            self._reads += 1
            layer_stride, block_bytes = self._geometry()
            assert kv.k_pool is not None and kv.v_pool is not None
            dst_k, dst_v = kv.k_pool.data_ptr(), kv.v_pool.data_ptr()
        # blocks are ours alone (refcount 1, unregistered): the read runs outside the lock
        dst, src, lengths = [], [], []
        runs = _coalesce(export.blocks, blocks)
        for s_base, d_base in ((export.k_addr, dst_k), (export.v_addr, dst_v)):
            for layer in range(kv.num_layers):
                for s0, d0, count in runs:
                    src.append(s_base + layer * export.layer_stride + s0 * block_bytes)
                    dst.append(d_base + layer * layer_stride + d0 * block_bytes)
                    lengths.append(count * block_bytes)
        nbytes = sum(lengths)
        fut: Future[int] = Future()
        handoff = threading.Lock()
        state = {"finished": False, "abandoned": False}

        def read() -> None:
            try:
                if self.before_read is not None:
                    self.before_read(export)
                fut.set_result(self._te.batch_transfer_sync_read(export.peer, dst, src, lengths))
            except BaseException as e:
                fut.set_exception(e)
            finally:
                with handoff:
                    state["finished"] = True
                    give_back = state["abandoned"]
                if give_back:  # the caller timed out: the blocks come back once the read has really ended
                    self._give_back(blocks)

        t_read = time.perf_counter()
        threading.Thread(target=read, name=f"kv-read-{mid[:8]}", daemon=True).start()
        try:
            rc = fut.result(timeout=timeout_s)
        except TimeoutError:
            with handoff:
                state["abandoned"] = True
                give_back = state["finished"]
            if give_back:
                self._give_back(blocks)
            return done("failed", f"Mooncake read from {export.peer} timed out after {timeout_s} s")
        except Exception as e:
            self._give_back(blocks)
            return done("failed", f"Mooncake read from {export.peer} raised {e!r}")
        read_s = time.perf_counter() - t_read
        if rc != 0:
            self._give_back(blocks)
            return done(
                "failed", f"Mooncake read of {nbytes} bytes from {export.peer} failed (rc {rc}): source gone?"
            )
        # install, then acknowledge: the pin was held for the whole read only if the source still knows it
        with eng._lock:
            if eng.weight_version != export.layout.weight_version or not kv.allocated:
                self._reads_done_locked(blocks)
                return done("refused", "weight version changed during the transfer")
            entry = _Adopted(
                mid, blocks, list(export.token_ids), eng.weight_version, time.time() + self.ttl_s
            )
            self.adopted[mid] = entry
        try:
            acked = ack(export) if ack is not None else self._http_ack(export)
        except Exception as e:
            acked, why = False, repr(e)
        else:
            why = "source refused the acknowledgement (pin expired or released)"
        with eng._lock:
            if not acked:
                if self.adopted.pop(mid, None) is not None:
                    kv.unpin_blocks(blocks)
                self._reads -= 1
                self._notify_idle_locked()
                return done("failed", f"acknowledgement failed: {why}")
            entry.timer = threading.Timer(self.ttl_s, self._expire_adopted, args=(mid,))
            entry.timer.daemon = True
            entry.timer.start()
            self._reads -= 1
            self._notify_idle_locked()
            self.stats.bytes_received += nbytes
            self.stats.migrated_tokens_installed += len(entry.tokens)
        return done("installed", migrated_tokens=len(entry.tokens), nbytes=nbytes, read_s=read_s)

    def _http_ack(self, export: KVExport) -> bool:
        assert export.source_url
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else None
        if self._ack_client is None:  # one client: a new one per ack built a TLS context each time (~ms)
            self._ack_client = httpx.Client()
        r = self._ack_client.post(
            f"{export.source_url.rstrip('/')}/kv/ack",
            json={"migration_id": export.migration_id},
            headers=headers,
            timeout=10.0,
        )
        return r.status_code == 200

    def _give_back(self, blocks: list[int]) -> None:
        with self.engine._lock:
            self._reads_done_locked(blocks)

    def _reads_done_locked(self, blocks: list[int]) -> None:
        if self.engine.kv.allocated:
            self.engine.kv.unpin_blocks(blocks)
        self._reads -= 1
        self._notify_idle_locked()

    def _notify_idle_locked(self) -> None:
        with self._idle:
            self._idle.notify_all()

    def _expire_adopted(self, mid: str) -> None:
        with self.engine._lock:
            entry = self.adopted.pop(mid, None)
            if entry is not None and self.engine.kv.allocated:
                self._retire(entry)
                self.stats.adopted_expired += 1
        if entry is not None:
            self._notify(mid, "adopted_expired")

    # ---- admission (engine lock held) --------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> _Adopted | None:
        """The longest adopted sequence whose tokens are a proper prefix of `tokens` (current weights only)."""
        best = None
        for e in self.adopted.values():
            n = len(e.tokens)
            fits = (
                n < len(tokens) and e.weight_version == self.engine.weight_version and tokens[:n] == e.tokens
            )
            if fits and (best is None or n > len(best.tokens)):
                best = e
        return best

    def take(self, entry: _Adopted) -> SeqBlocks:
        """Hand an adopted sequence's blocks to the request being admitted."""
        self.adopted.pop(entry.mid, None)
        if entry.timer is not None:
            entry.timer.cancel()
        self.stats.migrated_tokens_used += len(entry.tokens)
        return self.engine.kv.adopt_sequence(entry.blocks, len(entry.tokens))

    def drop_adopted(self) -> None:
        """Forget adopted sequences (flush_cache, weight update: their KV may be stale). Engine lock held."""
        for entry in list(self.adopted.values()):
            self.adopted.pop(entry.mid, None)
            if entry.timer is not None:
                entry.timer.cancel()
            self.engine.kv.unpin_blocks(entry.blocks)

    def _retire(self, entry: _Adopted) -> None:
        """An adopted sequence nobody claimed in time: its full blocks join the prefix cache (LRU, evictable), the
        rest is freed; either way it stops counting as used. Engine lock held."""
        kv = self.engine.kv
        if entry.weight_version == self.engine.weight_version and self.engine.config.enable_prefix_cache:
            kv.free_sequence(kv.adopt_sequence(entry.blocks, len(entry.tokens)), entry.tokens)
        else:
            kv.unpin_blocks(entry.blocks)


def _coalesce(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src block, dst block, count) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
