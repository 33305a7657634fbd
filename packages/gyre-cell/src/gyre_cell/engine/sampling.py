"""Sampling and behaviour log-probs with SGLang's semantics.

The returned log-prob of a sampled token is `log_softmax(logits / T)[token]`, taken *before* top-p/top-k
truncation (what the trainer's `l_t` recomputes). Greedy (T == 0) reports `log_softmax(logits)[token]`.

Temperatures below `SAMPLING_EPS` are greedy, as in SGLang: dividing logits by a temperature such as 1e-40 overflows
to inf and the distribution becomes NaN. A row that still cannot be sampled (non-finite logits) never takes the other
rows of its batch down: `sample_batch` reports it in `failed` and the engine ends only that request.
"""

from __future__ import annotations

import math

import torch

from gyre_cell.errors import SamplingError

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (SGLang's `_SAMPLING_EPS` rule: `logits / T` overflows for tiny T)."""


def effective_temperature(temperature: float) -> float:
    """0.0 (greedy) for temperatures below `SAMPLING_EPS`, else the temperature."""
    return 0.0 if temperature < SAMPLING_EPS else temperature


def truncated_probs(logits_V: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Sampling distribution after temperature, top-k and top-p (float32, sums to 1)."""
    probs_V = torch.softmax(logits_V / temperature, dim=-1)
    if 0 < top_k < probs_V.numel():
        kth = torch.topk(probs_V, top_k).values[-1]
        probs_V = torch.where(probs_V >= kth, probs_V, torch.zeros_like(probs_V))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs_V, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep_sorted = (cum - sorted_p) < top_p  # keep the smallest prefix whose mass reaches top_p
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        probs_V = torch.where(keep, probs_V, torch.zeros_like(probs_V))
    return probs_V / probs_V.sum()


def sample_token(
    logits_V: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
    logprobs_V: torch.Tensor | None = None,
) -> tuple[int, float]:
    """Draw one token from float32 logits `[V]`; returns (token id, behaviour log-prob).
    `logprobs_V` may carry the row of `batched_logprobs` (computed once for the whole step)."""
    temperature = effective_temperature(temperature)
    if temperature <= 0.0:
        token = int(torch.argmax(logits_V))
        lp_V = logprobs_V if logprobs_V is not None else torch.log_softmax(logits_V, dim=-1)
        return token, float(lp_V[token])
    lp_V = logprobs_V if logprobs_V is not None else torch.log_softmax(logits_V / temperature, dim=-1)
    if top_p >= 1.0 and not 0 < top_k < logits_V.numel():
        probs_V = lp_V.exp()  # no truncation: sample the tempered distribution directly
    else:
        probs_V = truncated_probs(logits_V, temperature, top_p, top_k)
    if not bool(torch.isfinite(probs_V).all()) or not float(probs_V.sum()) > 0:  # NaN-safe: `not x > 0`
        raise SamplingError("the sampling distribution is not finite (non-finite logits)")
    token = int(torch.multinomial(probs_V.cpu(), 1, generator=generator))
    return token, float(lp_V[token])


def batched_logprobs(logits_BV: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """`log_softmax(logits / T)` per row, with T = 1 for greedy rows; `[B, V]`."""
    t_B1 = torch.tensor(
        [t if (t := effective_temperature(x)) > 0 else 1.0 for x in temperatures],
        dtype=logits_BV.dtype,
        device=logits_BV.device,
    )
    return torch.log_softmax(logits_BV / t_B1[:, None], dim=-1)


def sample_batch(
    logits_BV: torch.Tensor,
    params: list[tuple[float, float, int, torch.Generator | None]],
    default_generator: torch.Generator,
    forced: list[int | None] | None = None,
) -> tuple[list[int], list[float], dict[int, str]]:
    """Sample one token per row. `params[b] = (temperature, top_p, top_k, generator or None)`; `forced[b]`, when
    not None, is row b's token, taken instead of a sample (a scripted reply), with its log-prob all the same.

    The common rows (greedy, or untruncated sampling without a per-request generator) are handled with
    batched ops; the rest row by row. Returns (tokens, behaviour log-probs, failed rows -> reason): a row whose
    logits are not finite is failed alone (its token is a placeholder the caller must not use)."""
    logits_BV = logits_BV.float().cpu()
    params = [(effective_temperature(t), top_p, top_k, gen) for t, top_p, top_k, gen in params]
    lp_BV = batched_logprobs(logits_BV, [p[0] for p in params])
    bad_B = (torch.isnan(lp_BV) | torch.isposinf(lp_BV)).any(dim=-1).tolist()  # -inf: a masked token, fine
    failed = {b: "non-finite logits" for b, bad in enumerate(bad_B) if bad}
    tokens = [0] * len(params)
    scripted = {b: tok for b, tok in enumerate(forced or []) if tok is not None and b not in failed}
    for b, tok in scripted.items():
        tokens[b] = tok
    greedy_rows = [b for b, p in enumerate(params) if p[0] <= 0.0 and b not in failed and b not in scripted]
    plain_rows = [
        b
        for b, (t, top_p, top_k, gen) in enumerate(params)
        if t > 0.0
        and gen is None
        and top_p >= 1.0
        and not 0 < top_k < logits_BV.shape[1]
        and b not in failed
        and b not in scripted
    ]
    if greedy_rows:
        for b, tok in zip(greedy_rows, logits_BV[greedy_rows].argmax(dim=-1).tolist(), strict=True):
            tokens[b] = tok
    if plain_rows:
        drawn = torch.multinomial(lp_BV[plain_rows].exp(), 1, generator=default_generator)[:, 0].tolist()
        for b, tok in zip(plain_rows, drawn, strict=True):
            tokens[b] = tok
    done = set(greedy_rows) | set(plain_rows) | set(failed) | set(scripted)
    for b, (t, top_p, top_k, gen) in enumerate(params):
        if b not in done:
            try:
                tokens[b], _ = sample_token(
                    logits_BV[b], temperature=t, top_p=top_p, top_k=top_k, generator=gen or default_generator
                )
            except (SamplingError, RuntimeError) as e:
                failed[b] = str(e)
    logprobs = lp_BV.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    for b, lp in enumerate(logprobs):
        if b not in failed and not math.isfinite(lp):
            failed[b] = "non-finite log-prob"
    return tokens, logprobs, failed
