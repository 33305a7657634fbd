"""Qwen3-MoE on the Megatron backend: the HF <-> Megatron expert/router mapping (exact round trips, EP renumbering;
no megatron import), and (slow) expert parallelism over gloo under torchrun: EP=2 log-probs equal the one-rank
(EP=1) log-probs and a per-row HF forward, expert gradients collect every rank's tokens.

The tiny model has 3 layers, layer 1 dense (``mlp_only_layers``), 4 experts, top-2 with renormalized weights, and
random router weights (HF initializes them to zero, which would make every token pick the same experts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file

from gyre_train.megatron.weights import (
    Qwen3Shape,
    expert_offset_names,
    hf_to_megatron,
    is_expert_name,
    megatron_to_hf,
    merge_tp,
    shard_tp,
)

if TYPE_CHECKING:  # transformers' modeling takes seconds to import: inside the functions, not at collection
    from transformers import Qwen3MoeConfig

TEMPERATURE = 0.7
EXPERTS = 4


def _config(norm_topk: bool = True) -> Qwen3MoeConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk,
        mlp_only_layers=[1],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def build_tiny_moe(path, seed: int = 0, norm_topk: bool = True) -> str:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(_config(norm_topk))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # distinct routing per token
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


def test_checkpoint_names_are_per_expert_and_round_trip_exactly(tiny_moe) -> None:
    hf = load_file(f"{tiny_moe}/model.safetensors")
    shape = Qwen3Shape.from_hf_config(_config())
    assert shape.num_experts == EXPERTS and shape.moe_layers == (0, 2)
    # What real Qwen3-MoE checkpoints (and save_pretrained) hold: one tensor per expert and projection.
    assert hf["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (32, 64)
    assert hf["model.layers.2.mlp.experts.0.down_proj.weight"].shape == (64, 32)
    assert hf["model.layers.0.mlp.gate.weight"].shape == (EXPERTS, 64)
    assert "model.layers.1.mlp.gate_proj.weight" in hf  # the dense layer
    for te_names in (False, True):
        mg = hf_to_megatron(hf, shape, te_norm_names=te_names)
        fc1 = mg["decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"]
        assert torch.equal(fc1[:32], hf["model.layers.2.mlp.experts.1.gate_proj.weight"])
        assert torch.equal(fc1[32:], hf["model.layers.2.mlp.experts.1.up_proj.weight"])
        assert torch.equal(mg["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
        # An MoE layer's pre-MLP norm stays separate in both specs; the dense layer's fuses into fc1 under TE.
        assert "decoder.layers.0.pre_mlp_layernorm.weight" in mg
        assert ("decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in mg) is te_names
        back = megatron_to_hf(mg, shape)
        assert set(back) == set(hf)
        for name, t in hf.items():
            assert torch.equal(back[name], t), name
    # Router and expert names exist only on the MoE layers of the shape (layer 1 is dense).
    for name in (
        "decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight",
    ):
        with pytest.raises(KeyError, match=r"layers\.1\."):
            megatron_to_hf({name: torch.zeros(1)}, shape)


def test_expert_parallel_renumbering_and_tp_split_round_trip(tiny_moe) -> None:
    hf = load_file(f"{tiny_moe}/model.safetensors")
    shape = Qwen3Shape.from_hf_config(_config())
    mg = hf_to_megatron(hf, shape)
    experts = {k: v for k, v in mg.items() if is_expert_name(k)}
    assert len(experts) == 2 * 2 * EXPERTS  # 2 MoE layers x fc1/fc2 x experts
    assert not is_expert_name("decoder.layers.0.mlp.router.weight")
    # EP=2: rank 1 holds global experts 2, 3 as local 0, 1.
    rank1 = {k: v for k, v in experts.items() if ".local_experts.2." in k or ".local_experts.3." in k}
    local = expert_offset_names(rank1, 2, to_global=False)
    assert "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight" in local
    assert expert_offset_names(local, 2, to_global=True) == rank1
    # Experts split over TP like the dense MLP (fc1 by gate/up halves, fc2 by input dim).
    for name, full in experts.items():
        parts = [shard_tp(name, full, r, 2) for r in range(2)]
        assert parts[0].shape[0] == full.shape[0] // 2 or parts[0].shape[1] == full.shape[1] // 2
        assert torch.equal(merge_tp(name, parts), full), name


WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig, ParallelConfig
    from gyre_train.backends.base import PackedTensors
    from gyre_train.types import TokenStats

    model_path, out, temperature = sys.argv[1], sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 512, (30,), generator=g)
        cu = torch.tensor([0, 12, 30], dtype=torch.int32)
        pos = torch.cat([torch.arange(12), torch.arange(18)])
        labels = torch.cat([ids[1:12], torch.tensor([-100]), ids[13:30], torch.tensor([-100])])
        return PackedTensors(input_ids=ids, position_ids=pos, cu_seqlens=cu, labels=labels)

    mine = batch(100 + rank)  # each rank its own tokens: the all-to-all really moves them
    weight_T = torch.linspace(0.5, 1.5, 30)
    for ep in (1, 2):
        b = MegatronBackend(MegatronBackendConfig(
            model_path=model_path, parallel=ParallelConfig(expert_parallel=ep), optimizer=False))
        local = sorted({n.split(".local_experts.")[1].split(".")[0]
                        for n, _ in b.model.named_parameters() if ".local_experts." in n})
        l_T = b.logprobs(mine, temperature)
        b.forward_backward(mine, temperature, lambda lp: ((weight_T * lp).sum(), TokenStats()))
        torch.save({"l_T": l_T, "grads": b.export_hf_grads(), "weights": b.export_hf_weights(),
                    "local_experts": local, "norm": b.grad_norm(), "ids": mine.input_ids,
                    "labels": mine.labels, "cu": mine.cu_seqlens, "weight_T": weight_T},
                   f"{out}.ep{ep}.{rank}")
        b.close()
    dist.destroy_process_group()
    """
)


def _hf_reference(model_path: str, r: dict):
    """Per-row HF log-probs and the gradient of sum(weight_T * l_T) for one rank's tokens."""
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
    # transformers fuses experts in memory; map its gradients back to per-expert checkpoint names.
    grads = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            for e in range(EXPERTS):
                gate, up = p.grad[e].chunk(2, dim=0)
                grads[f"{pre}{e}.gate_proj.weight"], grads[f"{pre}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(EXPERTS):
                grads[f"{pre}{e}.down_proj.weight"] = p.grad[e]
        else:
            grads[name] = p.grad
    return torch.cat(rows), grads


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU/gloo variant")
def test_ep2_logprobs_and_gradients_equal_one_rank(tiny_moe, tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*cmd, str(script), tiny_moe, str(out), str(TEMPERATURE)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("torchrun workers did not finish in 480 s")
    assert proc.returncode == 0, stderr[-6000:]
    res = {(ep, r): torch.load(f"{out}.ep{ep}.{r}", weights_only=False) for ep in (1, 2) for r in (0, 1)}
    hf_weights = load_file(f"{tiny_moe}/model.safetensors")
    refs = [_hf_reference(tiny_moe, res[(1, r)]) for r in (0, 1)]
    for r in (0, 1):
        one, two = res[(1, r)], res[(2, r)]
        assert one["local_experts"] == ["0", "1", "2", "3"]
        assert two["local_experts"] == ["0", "1"]  # each EP rank holds half of the experts
        # EP=2 log-probs equal the one-rank (EP=1) ones, and a per-row HF forward.
        torch.testing.assert_close(two["l_T"], one["l_T"], rtol=0, atol=1e-6)
        torch.testing.assert_close(two["l_T"], refs[r][0], rtol=0, atol=1e-5)
        # Export gathers the experts over the EP group: every rank returns the whole checkpoint, exactly.
        assert set(two["weights"]) == set(hf_weights)
        for name, w in hf_weights.items():
            assert torch.equal(two["weights"][name], w), name
        # Gradients: dense tensors see this rank's tokens; an expert sees the tokens routed to it from both ranks.
        for name, g in two["grads"].items():
            want = refs[0][1][name] + refs[1][1][name] if ".experts." in name else refs[r][1][name]
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5, msg=name)
            if ".experts." not in name:
                torch.testing.assert_close(one["grads"][name], g, rtol=1e-5, atol=1e-6, msg=name)
        dense = sum(float((g.double() ** 2).sum()) for n, g in refs[r][1].items() if ".experts." not in n)
        expert = sum(
            float(((refs[0][1][n] + refs[1][1][n]).double() ** 2).sum())
            for n in refs[r][1]
            if ".experts." in n
        )
        assert two["norm"] == pytest.approx((dense + expert) ** 0.5, rel=1e-4)
