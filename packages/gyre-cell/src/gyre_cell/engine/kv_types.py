"""Wire types, errors and counters of KV-cache migration (see `kv_migration.py` for the protocol).

The endpoints (`server_kv.py`) speak these models; the migrator's two halves (`kv_pins.py`, `kv_takeover.py`) share
the error, the counters and the model fingerprint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

KV_SCHEMA_VERSION = 1


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


__all__ = [
    "KV_SCHEMA_VERSION",
    "KVAckBody",
    "KVExport",
    "KVLayout",
    "KVMigrationStats",
    "KVPinBody",
    "KVTakeoverBody",
    "KVTakeoverResult",
    "model_fingerprint",
]
