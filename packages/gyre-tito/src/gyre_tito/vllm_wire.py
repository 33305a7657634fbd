"""vLLM's token-in/token-out route as the engine pool speaks it (`EnginePoolConfig.api = "vllm"`).

A vLLM server started with `--enable-scale-out` serves `POST /inference/v1/generate`: `{"request_id", "token_ids",
"sampling_params", "stream"}` in; out (as server-sent events when streaming, each chunk the *new* tokens) per choice
`token_ids`, `logprobs.content[] = {token_id, logprob}`, `finish_reason` (`stop`, `length`, `abort`), `stop_reason`
(the stop string or stop token id that ended it; None at an EOS) and, with the last chunk only, `weight_versions`
(`{version, start, end}` spans over the whole output). The pool's sampling parameters are SGLang's (the proxy writes them once for every engine);
this module translates them to vLLM's `SamplingParams` and reads the answer into the pool's attempt.

vLLM names a request of this route `generate-tokens-<request_id>`; `/inference/v1/abort_requests` takes that name
(the abort a drain sends, so the call continues on another engine from what it produced).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["GENERATE_PATH", "abort_body", "apply_chunk", "generate_body", "sampling_params"]

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
_RENAMED = {
    "max_new_tokens": "max_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
}
_SAME = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_tokens",
}


def sampling_params(sp: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `SamplingParams` for the pool's (SGLang-named) sampling parameters: the sampled token's log-prob and
    nothing else (`logprobs: 0`), token ids out, the proxy's stops. A key neither engine shares is refused."""
    out: dict[str, Any] = {"logprobs": 0, "n": 1}
    for key, value in sp.items():
        if key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key in _SAME:
            out[key] = value
        else:
            raise ValueError(f"sampling parameter {key!r} has no vLLM equivalent")
    if out.get("top_k") is not None and out["top_k"] < 0:
        out["top_k"] = 0  # SGLang's -1 (all tokens) is vLLM's 0
    # stop strings are matched on text: vLLM detokenizes only for them (token ids are the record either way)
    out["detokenize"] = bool(out.get("stop"))
    return out


def generate_body(rid: str, ids: list[int], sp: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {"request_id": rid, "token_ids": ids, "sampling_params": sampling_params(sp), "stream": stream}


def abort_body(rid: str) -> dict[str, Any]:
    return {"request_ids": [f"generate-tokens-{rid}"]}


def apply_chunk(att: Any, obj: dict[str, Any], version: str) -> None:
    """Add one answer (a streamed chunk: its new tokens; or the whole answer) to the attempt `att` (the pool's
    `_Attempt`: ids, logprobs, versions, finish, matched, cached_tokens). vLLM reports `weight_versions` only with
    the request's last chunk, as spans over its whole output: until then each token is taken to come from `version`
    (what the engine last reported), which the spans then correct."""
    if "error" in obj and "choices" not in obj:
        err = obj["error"]
        raise ValueError(f"engine error: {err.get('message', err) if isinstance(err, dict) else err}")
    (choice,) = obj["choices"]
    ids = [int(t) for t in choice.get("token_ids") or ()]
    content = (choice.get("logprobs") or {}).get("content")
    if content is None and ids:
        raise ValueError("engine returned no log-probs (the pool asks for them)")
    content = content or []
    if [int(c["token_id"]) for c in content] != ids:
        raise ValueError("engine's log-probs name other tokens than its output")
    lps = [float(c["logprob"]) if c.get("logprob") is not None else math.nan for c in content]
    if not all(math.isfinite(v) for v in lps):
        raise ValueError("engine returned a null or non-finite log-prob")
    att.ids += ids
    att.logprobs += lps
    att.versions += [version] * len(ids)
    for span in choice.get("weight_versions") or ():
        for i in range(int(span["start"]), min(int(span["end"]), len(att.versions))):
            att.versions[i] = str(span["version"])
    usage = obj.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        att.cached_tokens = details["cached_tokens"]
    finish = choice.get("finish_reason")
    if finish is not None:
        att.finish = finish
        reason = choice.get("stop_reason")
        att.matched = (
            reason if reason is not None else (att.ids[-1] if finish == "stop" and att.ids else None)
        )
