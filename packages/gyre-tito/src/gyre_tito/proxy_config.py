"""The proxy's configuration (`ProxyConfig`) and the rule for execution and group ids, apart from the proxy core
(`gyre_tito.proxy`, which re-exports both)."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, Field

from gyre_tito.conversation import DEFAULT_VOLATILE_PATTERNS
from gyre_tito.engine_client import EnginePoolConfig
from gyre_tito.records import LOG_SUFFIX

__all__ = ["MAX_ID_CHARS", "ProxyConfig", "check_execution_id"]

MAX_ID_CHARS = 128


def check_execution_id(value: Any) -> str | None:
    """Why an execution or group id is unusable (None when it is fine): 1-128 printable characters whose
    percent-quoted log file name fits every filesystem (255 bytes)."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > MAX_ID_CHARS:
        return f"at most {MAX_ID_CHARS} characters, got {len(value)}"
    if not value.isprintable():
        return "must not contain control characters"
    if len(quote(value, safe="").encode()) + len(LOG_SUFFIX) > 255:
        return "too long once percent-quoted into a file name (255 bytes)"
    if value in (".", ".."):
        return "must not be '.' or '..'"
    return None


class ProxyConfig(BaseModel):
    engines: list[str] = Field(default_factory=list, description="engine base URLs (SGLang /generate)")
    tokenizer: str = Field(description="tokenizer directory with tokenizer.json and a chat template")
    store: str = Field(description="directory for executions, records and the resolved config")
    model_name: str = Field("gyre-policy", description="model name reported to harnesses")
    admin_token: str | None = Field(None, description="token for /admin endpoints (None: admin API disabled)")
    engine_api_key: str | None = Field(
        None, description="bearer token sent to every engine (None: engines without a token, loopback only)"
    )
    max_context_tokens: int = Field(131072, description="model context limit (prompt + max new tokens)")
    encode_cache_bytes: int = Field(
        64 << 20, description="budget of each of the two shared encoding caches (turns, pieces), in bytes"
    )
    max_request_bytes: int | None = Field(
        None,
        description="largest request body accepted (413 above it); None: 32 bytes per context token, >= 1 MiB",
    )
    context_from_engines: bool = Field(
        True,
        description="also limit prompts to the smallest context length the route's engines report (GET /server_info)",
    )
    volatile_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_VOLATILE_PATTERNS),
        description="system lines dropped before rendering",
    )
    classifier: str = Field(
        "claude-code", description="role classifier for Anthropic requests (roles.CLASSIFIERS)"
    )
    openai_classifier: str = Field("static", description="role classifier for OpenAI requests")
    keepalive_s: float = Field(5.0, description="ping interval on a streamed response while the engine works")
    fsync: bool = Field(True, description="fsync every record (off only for benchmarks)")
    group_commit: bool = Field(
        True,
        description="records that complete together share one fsync of a journal (`_commit.wal`); False: one "
        "fsync per record in its own log (the old behaviour, kept as the benchmark's baseline)",
    )
    incremental_encode: bool = Field(
        True,
        description="encode only the messages after the part of the request that the execution's last request "
        "already had (natively rendered templates); False: render and encode the whole conversation each call (the "
        "old behaviour, kept as the benchmark's baseline)",
    )
    export_dirs: list[str] = Field(
        default_factory=list, description="directories admin export may write under, besides the store"
    )
    context_overflow: Literal["clamp", "refuse"] = Field(
        "clamp",
        description="a request whose max_tokens exceeds the room left in the context: 'clamp' max_tokens to the room "
        "(the harness goes on; Claude Code always asks for its full output cap), or 'refuse' with Anthropic's "
        "'input length and `max_tokens` exceed context limit' 400",
    )
    sampling_policy: Literal["pin", "refuse", "pass"] = Field(
        "pin",
        description="per-call temperature/top_p/top_k: 'pin' to the run's values below, 'refuse' (400 naming the "
        "parameter) when a request asks for another value, 'pass' the harness's values through; both what was asked "
        "and what was used are recorded in CallRecord.metadata['sampling']",
    )
    temperature: float = Field(1.0, gt=0, description="the run's sampling temperature (the trainer's)")
    top_p: float = Field(
        1.0, gt=0, le=1, description="the run's top_p (docs/design/training.md#objective: 1)"
    )
    top_k: int = Field(-1, description="the run's top_k (docs/design/training.md#objective: -1 = off)")
    engine: EnginePoolConfig = Field(default_factory=EnginePoolConfig, description="engine pool settings")
