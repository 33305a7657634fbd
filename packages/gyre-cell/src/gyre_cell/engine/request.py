"""One generation request inside the torch engine, and its SGLang-shaped response."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gyre_cell.errors import EngineInputError

from .kv_cache import SeqBlocks


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingSpec:
    """The subset of SGLang sampling_params the engine implements."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    def validate(self, vocab_size: int) -> None:
        if self.max_new_tokens <= 0:
            raise EngineInputError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise EngineInputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise EngineInputError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise EngineInputError(f"stop_token_ids out of range [0, {vocab_size}): {bad[:5]}")


Sink = Callable[[dict[str, Any], bool], None]
"""Receives (response snapshot, finished). Called from the engine thread."""


@dataclass(slots=True, eq=False)  # identity: two requests are never equal
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingSpec
    return_logprob: bool
    stream: bool
    sink: Sink
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    seq: SeqBlocks | None = None
    cached_tokens: int = 0
    pending: list[int] = field(default_factory=list)
    """Tokens whose KV is not written yet; the last one's logits give the next token."""
    version_spans: list[list[Any]] = field(default_factory=list)
    """[version, start, end) over output positions (SGLang 0.5.23 `weight_versions`)."""
    num_retractions: int = 0
    migrated_tokens: int = 0
    """Tokens whose KV was migrated from another engine (KV-cache migration) instead of being computed."""
    forced: list[int] | None = None
    """A scripted reply's tokens still to produce, in order, instead of sampled ones (`engine.script`)."""

    def all_tokens(self) -> list[int]:
        return self.input_ids + self.output_ids

    def append(self, token: int, logprob: float, version: str) -> None:
        n = len(self.output_ids)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][2] = n + 1
        else:
            self.version_spans.append([version, n, n + 1])
        self.output_ids.append(token)
        self.logprobs.append(logprob)

    def response(self, *, text: str | None, weight_version: str) -> dict[str, Any]:
        """SGLang's /generate response (cumulative output, as SGLang streams it by default)."""
        n = len(self.output_ids)
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": len(self.input_ids),
            "weight_version": self.version_spans[-1][0] if self.version_spans else weight_version,
            "num_retractions": self.num_retractions,
            "completion_tokens": n,
            "cached_tokens": self.cached_tokens,
        }
        # of cached_tokens, those taken over from another engine (0 too: a client can tell them from its own cache)
        meta["migrated_tokens"] = self.migrated_tokens
        if self.version_spans:
            meta["weight_versions"] = [{"version": v, "start": s, "end": e} for v, s, e in self.version_spans]
        if self.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(self.logprobs, self.output_ids, strict=True)
            ]
        out: dict[str, Any] = {}
        if text is not None:
            out["text"] = text
        out["output_ids"] = list(self.output_ids)
        out["meta_info"] = meta
        return out


def check_finish(
    req: Request, token: int, *, eos_ids: set[int], tokenizer: Any | None, context_len: int
) -> dict[str, Any] | None:
    """SGLang's finish_reason after `token` was appended, or None while the request goes on."""
    sp = req.sampling
    if token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_ids):
        return {"type": "stop", "matched": token}
    if sp.stop and tokenizer is not None:
        text = tokenizer.decode(req.output_ids, skip_special_tokens=sp.skip_special_tokens)
        for s in sp.stop:
            if s and s in text:
                return {"type": "stop", "matched": s}
    if len(req.output_ids) >= sp.max_new_tokens or len(req.input_ids) + len(req.output_ids) >= context_len:
        return {"type": "length", "length": len(req.output_ids)}
    return None


def render_response(req: Request, *, tokenizer: Any | None, weight_version: str) -> dict[str, Any]:
    """The response with `text` when a tokenizer exists (trimmed at a matched stop string, as SGLang)."""
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(req.output_ids, skip_special_tokens=req.sampling.skip_special_tokens)
        matched = (req.finish or {}).get("matched")
        if isinstance(matched, str) and not req.sampling.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
    return req.response(text=text, weight_version=weight_version)
