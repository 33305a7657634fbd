"""Sampling and behaviour log-probs with SGLang's semantics.

The returned log-prob of a sampled token is `log_softmax(logits / T)[token]`, taken *before* top-p/top-k
truncation (what the trainer's `l_t` recomputes). Greedy (T == 0) reports `log_softmax(logits)[token]`.
"""

from __future__ import annotations

import torch


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
    if temperature <= 0.0:
        token = int(torch.argmax(logits_V))
        lp_V = logprobs_V if logprobs_V is not None else torch.log_softmax(logits_V, dim=-1)
        return token, float(lp_V[token])
    lp_V = logprobs_V if logprobs_V is not None else torch.log_softmax(logits_V / temperature, dim=-1)
    if top_p >= 1.0 and not 0 < top_k < logits_V.numel():
        probs_V = lp_V.exp()  # no truncation: sample the tempered distribution directly
    else:
        probs_V = truncated_probs(logits_V, temperature, top_p, top_k)
    token = int(torch.multinomial(probs_V.cpu(), 1, generator=generator))
    return token, float(lp_V[token])


def batched_logprobs(logits_BV: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """`log_softmax(logits / T)` per row, with T = 1 for greedy rows; `[B, V]`."""
    t_B1 = torch.tensor(
        [t if t > 0 else 1.0 for t in temperatures], dtype=logits_BV.dtype, device=logits_BV.device
    )
    return torch.log_softmax(logits_BV / t_B1[:, None], dim=-1)


def sample_batch(
    logits_BV: torch.Tensor,
    params: list[tuple[float, float, int, torch.Generator | None]],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Sample one token per row. `params[b] = (temperature, top_p, top_k, generator or None)`.

    The common rows (greedy, or untruncated sampling without a per-request generator) are handled with
    batched ops; the rest row by row. Returns (tokens, behaviour log-probs)."""
    logits_BV = logits_BV.float().cpu()
    lp_BV = batched_logprobs(logits_BV, [p[0] for p in params])
    greedy_rows = [b for b, p in enumerate(params) if p[0] <= 0.0]
    plain_rows = [
        b
        for b, (t, top_p, top_k, gen) in enumerate(params)
        if t > 0.0 and gen is None and top_p >= 1.0 and not 0 < top_k < logits_BV.shape[1]
    ]
    tokens = [0] * len(params)
    if greedy_rows:
        for b, tok in zip(greedy_rows, logits_BV[greedy_rows].argmax(dim=-1).tolist(), strict=True):
            tokens[b] = tok
    if plain_rows:
        drawn = torch.multinomial(lp_BV[plain_rows].exp(), 1, generator=default_generator)[:, 0].tolist()
        for b, tok in zip(plain_rows, drawn, strict=True):
            tokens[b] = tok
    done = set(greedy_rows) | set(plain_rows)
    for b, (t, top_p, top_k, gen) in enumerate(params):
        if b not in done:
            tokens[b], _ = sample_token(
                logits_BV[b], temperature=t, top_p=top_p, top_k=top_k, generator=gen or default_generator
            )
    logprobs = lp_BV.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    return tokens, logprobs
