"""The torch engine on CUDA (pytest -m gpu on a GPU machine): exact log-probs, real memory release."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_cuda_logprobs_and_memory_release(tiny_model, serve_engine):
    from transformers import AutoModelForCausalLM  # slow to import: not at collection

    # Selected only with `-m gpu`: a GPU run without a CUDA device is a broken machine, not a pass.
    assert torch.cuda.is_available(), "pytest -m gpu ran on a machine without CUDA"
    with serve_engine(tiny_model, device="cuda", max_total_tokens=1 << 20) as s:
        body = {
            "input_ids": [1, 2, 3, 4],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 32, "temperature": 0.8, "ignore_eos": True},
        }
        out = s.http.post("/generate", json=body).json()
        ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = ref(torch.tensor([[1, 2, 3, 4, *out["output_ids"]]])).logits[0].float()
        lp = torch.log_softmax(logits / 0.8, -1)
        expected = [float(lp[3 + j, t]) for j, t in enumerate(out["output_ids"])]
        got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-4

        before = torch.cuda.memory_allocated()
        kv_bytes = s.engine.kv.nbytes()
        assert s.http.post("/release_memory_occupation", json={}).status_code == 200
        freed = before - torch.cuda.memory_allocated()
        assert freed >= kv_bytes  # the KV pool (and the weights) really left the GPU
        assert s.http.post("/resume_memory_occupation", json={}).status_code == 200
        assert torch.cuda.memory_allocated() >= before - 1024
        again = s.http.post(
            "/generate", json={**body, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        )
        assert again.status_code == 200
