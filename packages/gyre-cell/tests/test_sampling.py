import torch

from gyre_cell.engine.sampling import sample_token, truncated_probs


def test_top_k_and_top_p_truncate_but_logprob_is_pre_truncation():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.equal(truncated_probs(logits, 1.0, 1.0, 2) > 0, torch.tensor([True, True, False, False]))
    assert torch.equal(truncated_probs(logits, 1.0, 0.7, -1) > 0, torch.tensor([True, True, False, False]))
    assert torch.equal(truncated_probs(logits, 1.0, 0.5, -1) > 0, torch.tensor([True, False, False, False]))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tok, lp = sample_token(logits, temperature=0.5, top_p=1.0, top_k=2, generator=g)
        assert tok in (0, 1)
        assert abs(lp - float(torch.log_softmax(logits / 0.5, -1)[tok])) < 1e-6


def test_greedy():
    logits = torch.tensor([0.1, 2.0, -1.0])
    tok, lp = sample_token(logits, temperature=0.0, top_p=1.0, top_k=-1, generator=None)
    assert tok == 1 and abs(lp - float(torch.log_softmax(logits, -1)[1])) < 1e-7
