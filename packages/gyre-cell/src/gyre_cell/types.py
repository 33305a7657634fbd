"""Wire types produced by gyre-cell: what a RolloutEngine client returns for one generation."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    schema_version: Literal[1] = 1


class FinishReason(_Wire):
    """SGLang's finish_reason: stop (matched token id or string), length, or abort (with message)."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class WeightVersionSpan(_Wire):
    """Output positions [start, end) generated under one weight version (SGLang 0.5.23)."""

    version: str
    start: int
    end: int


class GenerationResult(_Wire):
    """One /generate answer (or a cumulative streaming snapshot when `finish_reason` is None)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    """Behaviour log-probs `log_softmax(logits / T)[token]`, one per output id; None if not requested."""
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    weight_versions: list[WeightVersionSpan] = []
    text: str | None = None

    @classmethod
    def from_sglang(cls, resp: dict[str, Any]) -> GenerationResult:
        """Parse SGLang's /generate response (also the torch engine's, which has the same shape)."""
        meta = resp["meta_info"]
        lps = meta.get("output_token_logprobs")
        output_ids = resp.get("output_ids")
        if output_ids is None and lps is not None:  # slime's fallback: ids from the logprob triples
            output_ids = [t[1] for t in lps]
        fr = meta.get("finish_reason")
        if isinstance(fr, dict):
            fr = {k: fr.get(k) for k in ("type", "matched", "length", "message") if fr.get(k) is not None}
        return cls(
            rid=str(meta["id"]),
            output_ids=list(output_ids or []),
            output_logprobs=None if lps is None else [float(t[0]) for t in lps],
            finish_reason=fr,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids or []))),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=str(meta.get("weight_version", "default")),
            weight_versions=[
                {"version": str(s["version"]), "start": s["start"], "end": s["end"]}
                for s in meta.get("weight_versions") or []
            ],
            text=resp.get("text"),
        )
