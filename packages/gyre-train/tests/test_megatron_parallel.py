"""Megatron backend with tensor and pipeline parallelism: two ranks under torchrun (gloo on CPU, NCCL on 2 GPUs).

The ranks run, one after the other in the same processes (megatron's groups are torn down in between): TP=2 (weights
sharded by KV group / vocab / FFN halves), PP=2 (one layer per stage), and PP=2 on a model with tied embeddings (the
last stage holds a copy of the embedding whose gradient is summed with the first stage's). Each layout computes packed log-probs, one backward of a GSPO-shaped
loss (a weighted sum of l_t), the global grad norm, and exports weights and gradients back to HF names; the test
compares them with a one-process HF forward/backward on the same shard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.slow,  # two processes each import megatron-core (~1.5 min on a shared 2-core box)
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="on GPU machines needs 2 devices"
    ),
]

TEMPERATURE = 0.7
LAYOUTS = ("tp2", "pp2", "pp2tied")

WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig, ParallelConfig
    from gyre_train.backends.base import PackedTensors
    from gyre_train.types import TokenStats

    model_path, tied_path, out, temperature = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    # The process group outlives both layouts; each backend creates (and its close() removes) megatron's groups only.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (24,), generator=g)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    pos = torch.cat([torch.arange(10), torch.arange(14)])
    labels = torch.cat([ids[1:10], torch.tensor([-100]), ids[11:24], torch.tensor([-100])])
    batch = PackedTensors(input_ids=ids, position_ids=pos, cu_seqlens=cu, labels=labels)
    weight_T = torch.linspace(0.5, 1.5, 24)
    layouts = {"tp2": (2, 1, model_path), "pp2": (1, 2, model_path), "pp2tied": (1, 2, tied_path)}
    for name, (tp, pp, path) in layouts.items():
        b = MegatronBackend(MegatronBackendConfig(
            model_path=path, parallel=ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), optimizer=False
        ))
        l_T = b.logprobs(batch, temperature)
        b.forward_backward(batch, temperature, lambda lp: ((weight_T * lp).sum(), TokenStats()))
        torch.save(
            {"ids": ids, "labels": labels, "cu": cu, "weight_T": weight_T, "l_T": l_T, "norm": b.grad_norm(),
             "weights": b.export_hf_weights(), "grads": b.export_hf_grads()},
            f"{out}.{name}.{dist.get_rank()}",
        )
        b.close()
    dist.destroy_process_group()
    """
)


def build_tiny_model(path, seed: int, tied: bool) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM  # slow to import: not at collection

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _reference(model_path: str, r: dict):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    rows, total = [], 0.0
    for a, b in zip(r["cu"][:-1].tolist(), r["cu"][1:].tolist(), strict=True):
        lab = r["labels"][a:b]
        lp = torch.log_softmax(model(r["ids"][None, a:b]).logits[0] / TEMPERATURE, -1)
        l_row = torch.where(lab == -100, 0.0, lp.gather(-1, lab.clamp(min=0)[:, None])[:, 0])
        rows.append(l_row.detach())
        total = total + (r["weight_T"][a:b] * l_row).sum()
    total.backward()
    return torch.cat(rows), dict(model.named_parameters())


def test_tp2_and_pp2_match_hf(tiny_model, tmp_path) -> None:
    tied = build_tiny_model(tmp_path / "tied", seed=5, tied=True)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Own session, so a hang kills torchrun and both workers (and nothing else).
    proc = subprocess.Popen(
        [*cmd, str(script), tiny_model, tied, str(out), str(TEMPERATURE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("torchrun workers did not finish in 480 s")
    assert proc.returncode == 0, stderr[-6000:]
    for layout in LAYOUTS:
        ref_l, params = _reference(
            tied if layout == "pp2tied" else tiny_model, torch.load(f"{out}.{layout}.0")
        )
        ref_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params.values())))
        ranks = [torch.load(f"{out}.{layout}.{r}", weights_only=False) for r in range(2)]
        seen: set[str] = set()
        for rank, res in enumerate(ranks):
            # log-probs exist on every TP rank, and on the last pipeline stage only
            if layout == "tp2" or rank == 1:
                torch.testing.assert_close(res["l_T"], ref_l, rtol=0, atol=1e-5)
            else:
                assert res["l_T"].numel() == 0
            assert res["norm"] == pytest.approx(ref_norm, rel=1e-5)
            for name, w in res["weights"].items():
                assert torch.equal(w, params[name].detach()), (layout, rank, name)
                torch.testing.assert_close(res["grads"][name], params[name].grad, rtol=1e-4, atol=1e-5)
            seen |= set(res["weights"])
        assert seen == set(params), layout  # the stages together hold every tensor
    # PP: stage 0 holds the embedding and layer 0, stage 1 layer 1, the final norm and lm_head.
    stage0 = set(torch.load(f"{out}.pp2.0", weights_only=False)["weights"])
    assert "model.embed_tokens.weight" in stage0 and "model.layers.0.mlp.up_proj.weight" in stage0
    assert not any(
        n.startswith("model.layers.1.") or n in ("model.norm.weight", "lm_head.weight") for n in stage0
    )
