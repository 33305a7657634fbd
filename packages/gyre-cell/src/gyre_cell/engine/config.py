"""Configuration of the CPU/CUDA torch engine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..transfer.mooncake import MooncakeConfig


class EngineConfig(BaseModel):
    """How the torch engine loads its model and sizes its KV cache and batches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    """Local Hugging Face checkpoint directory (Qwen3, Qwen2 or Llama family)."""
    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N`, or `auto` (CUDA when present)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and KV dtype; float32 keeps log-probs exact against a float32 forward."""
    kv_block_size: int = 16
    """Tokens per KV block (paged cache; prefix reuse works on whole blocks)."""
    max_total_tokens: int = 65536
    """KV pool capacity in tokens (all running sequences plus cached prefixes)."""
    max_running_requests: int = 64
    """Most sequences stepped together in one batch."""
    max_prefill_tokens: int = 8192
    """Most uncached prompt tokens admitted in one step (bounds a step's latency)."""
    enable_prefix_cache: bool = True
    """Keep finished sequences' full KV blocks and reuse them for requests that share the prefix."""
    weight_version: str = "default"
    """Initial weight version reported in responses and /model_info."""
    weights_backup: Literal["auto", "cpu", "disk", "none"] = "auto"
    """Where released weights go: `cpu` copy (CUDA), a temp safetensors file (`disk`), or dropped (`none`:
    an update must follow resume). `auto` = cpu on CUDA, disk on CPU, so a release really frees memory."""
    require_update_session: bool = True
    """Mirror SGLang 0.5.23: from_tensor/from_distributed updates need /begin_weight_update first."""
    cpu_threads: int | None = None
    """torch intra-op threads when running on CPU (None: torch's default). 1 is fastest for tiny models on
    shared machines, where a descheduled worker thread stalls every op."""
    seed: int = 0
    """Seed of the engine's sampler (per-request `sampling_seed` overrides it)."""
    weight_dirs: list[str] | None = None
    """Directories `/update_weights_from_disk` may load from (a `model_path` must resolve under one); None: any
    directory the engine's user can read. `gyre run` sets its model and checkpoint directories."""
    served_model_name: str | None = None
    """Name reported by /model_info (default: the model path)."""
    kv_migration: bool = True
    """Serve /kv/pin and /kv/takeover (KV-cache migration on reroute; see engine/kv_migration.py)."""
    kv_transfer: MooncakeConfig = Field(default_factory=MooncakeConfig)
    """Mooncake transfer engine the KV pool is exposed through: TCP on loopback by default; on GPU nodes set
    `protocol = "rdma"`, `device_name` and a `local_hostname` peers can reach."""
    scripted_replies: str | None = None
    """A script file whose replies the engine produces instead of sampling, each token with the model's own
    log-prob (`gyre_cell.engine.script`): for runs whose harness needs replies the policy cannot give yet. None:
    the engine samples, as a model does."""
    kv_pin_ttl_s: float = 30.0
    """How long a pinned (source) or adopted (destination) KV sequence lives without acknowledgement / use."""
