"""Megatron backend with tensor parallelism on GPUs (``pytest -m gpu``; needs 2 CUDA devices, skipped elsewhere).

Two ranks under torchrun load the tiny Qwen3 with TP=2 (weights sharded by KV group / vocab / FFN), compute packed
log-probs, take one GSPO-shaped backward and export weights and gradients gathered back to HF names; the test
compares them with a one-process HF forward/backward on the same shard.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

WORKER = textwrap.dedent(
    """
    import json, sys, torch
    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig, ParallelConfig
    from gyre_train.backends.base import PackedTensors
    from gyre_train.types import TokenStats
    model_path, out = sys.argv[1], sys.argv[2]
    b = MegatronBackend(MegatronBackendConfig(model_path=model_path, parallel=ParallelConfig(tensor_parallel=2)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (24,), generator=g)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    pos = torch.cat([torch.arange(10), torch.arange(14)])
    labels = torch.cat([ids[1:10], torch.tensor([-100]), ids[11:24], torch.tensor([-100])])
    batch = PackedTensors(input_ids=ids, position_ids=pos, cu_seqlens=cu, labels=labels)
    l_T = b.logprobs(batch, 0.7)
    b.forward_backward(batch, 0.7, lambda lp: (lp.sum(), TokenStats()))
    weights, grads = b.export_hf_weights(), b.export_hf_grads()
    if torch.distributed.get_rank() == 0:
        torch.save({"ids": ids, "labels": labels, "cu": cu, "l_T": l_T, "weights": weights, "grads": grads}, out)
    b.close()
    """
)


def test_tp2_matches_hf(tiny_model, tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        str(script),
        tiny_model,
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    total, ref = 0.0, []
    for a, b in zip(res["cu"][:-1].tolist(), res["cu"][1:].tolist(), strict=True):
        lab = res["labels"][a:b]
        lp = torch.log_softmax(model(res["ids"][None, a:b]).logits[0] / 0.7, -1)
        l_row = torch.where(lab == -100, 0.0, lp.gather(-1, lab.clamp(min=0)[:, None])[:, 0])
        ref.append(l_row)
        total = total + l_row.sum()
    total.backward()
    torch.testing.assert_close(res["l_T"], torch.cat(ref).detach(), rtol=0, atol=1e-4)
    for name, p in model.named_parameters():
        assert torch.equal(res["weights"][name], p.detach()), name
        torch.testing.assert_close(res["grads"][name], p.grad, rtol=1e-3, atol=1e-5, msg=name)
    print(json.dumps({"max_logprob_err": float((res["l_T"] - torch.cat(ref).detach()).abs().max())}))
