"""KV-cache migration between torch engines (paper §4.3, DESIGN §8): pin, transfer, acknowledge, release.

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
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field

from ..transfer.mooncake import MooncakeConfig, open_transfer_engine, peer_address
from .kv_cache import KVCacheFullError, SeqBlocks
from .request import EngineInputError, EngineStateError

if TYPE_CHECKING:
    from .core import TorchEngine

KV_SCHEMA_VERSION = 1


class KVMigrationError(EngineStateError):
    """A pin the engine cannot make (nothing cached for the request, Mooncake unavailable, pool released)."""


# ---- wire types --------------------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVLayout(BaseModel):
    """What must be equal on both sides for KV blocks to be reusable as they are."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_fingerprint: str
    """sha256 (16 hex) of the architecture fields of the HF config (type, layers, widths, heads, vocab, RoPE)."""
    model_type: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    weight_version: str


class KVPinBody(_Body):
    """POST /kv/pin: pin a running request's KV (`rid`) or the cached prefix of `token_ids`."""

    rid: str | None = None
    token_ids: list[int] | None = None
    ttl_s: float | None = Field(None, gt=0, description="pin lifetime; None: the engine's kv_pin_ttl_s")
    abort: bool = True
    """With `rid`: end the request once its blocks are pinned (finish_reason abort; the client retries elsewhere)."""


class KVExport(BaseModel):
    """Answer of /kv/pin, body of /kv/takeover: where the pinned blocks are and what they hold.

    Block `b` of layer `l` is `block_bytes` contiguous bytes at `k_addr + l * layer_stride + b * block_bytes` (and
    the same at `v_addr`) in the source's registered pool."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = KV_SCHEMA_VERSION
    migration_id: str
    rid: str | None = None
    source_url: str | None = None
    """HTTP base URL of the source engine (the destination acknowledges there); filled in by whoever forwards it."""
    peer: str
    """Mooncake segment of the source (`host:rpc_port`, P2P handshake)."""
    k_addr: int
    v_addr: int
    layer_stride: int
    block_bytes: int
    blocks: list[int]
    token_ids: list[int]
    """Tokens whose KV the blocks hold, in order (the last block may be partly filled)."""
    layout: KVLayout
    ttl_s: float
    nbytes: int
    """Bytes a destination reads (K and V, every layer)."""


class KVTakeoverBody(_Body):
    """POST /kv/takeover on the destination."""

    export: KVExport
    token_ids: list[int] | None = None
    """The prompt the retry will send; the exported tokens must be a proper prefix of it (checked when given)."""
    timeout_s: float = Field(30.0, gt=0)


class KVTakeoverResult(BaseModel):
    """Answer of /kv/takeover: 200 installed, 409 refused (layout/identity mismatch), 502 failed (source gone,
    timeout, pin no longer held, no room). Not installed means: recompute."""

    model_config = ConfigDict(extra="forbid")

    migration_id: str
    status: Literal["installed", "refused", "failed"]
    reason: str | None = None
    migrated_tokens: int = 0
    nbytes: int = 0
    read_s: float = 0.0
    total_s: float = 0.0

    @property
    def installed(self) -> bool:
        return self.status == "installed"


class KVAckBody(_Body):
    """POST /kv/ack (destination -> source: received and taken over) and POST /kv/release (give the pin up)."""

    migration_id: str


# ---- engine side -------------------------------------------------------------------------------------------------
def model_fingerprint(cfg: Any) -> str:
    fields = (
        "model_type",
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rope_theta",
        "rope_scaling",
        "rms_norm_eps",
    )
    data = {f: getattr(cfg, f, None) for f in fields}
    return hashlib.sha256(orjson.dumps(data, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


@dataclass(eq=False)
class _Pin:
    mid: str
    blocks: list[int]
    tokens: list[int]
    expires_at: float
    timer: threading.Timer | None = None


@dataclass(eq=False)
class _Adopted:
    mid: str
    blocks: list[int]
    tokens: list[int]
    weight_version: str
    expires_at: float
    timer: threading.Timer | None = None


@dataclass
class KVMigrationStats:
    pins: int = 0
    pins_acked: int = 0
    pins_expired: int = 0
    pins_released: int = 0
    pinned_bytes_served: int = 0
    """Bytes of pins acknowledged by a destination (it read them all)."""
    takeovers_installed: int = 0
    takeovers_refused: int = 0
    takeovers_failed: int = 0
    bytes_received: int = 0
    migrated_tokens_installed: int = 0
    migrated_tokens_used: int = 0
    """Tokens of adopted sequences that a request was admitted on (never recomputed)."""
    adopted_expired: int = 0
    last_failure: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class KVMigrator:
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

    # ---- source: pin / ack / release / expiry --------------------------------------------------------------------
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
        r = httpx.post(
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


def _coalesce(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src block, dst block, count) runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


__all__ = [
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
