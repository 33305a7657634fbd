"""HF Qwen3 <-> Megatron GPTModel weight mapping: exact round trips, the fused layouts, TP sharding (no megatron)."""

from __future__ import annotations

import pytest
import torch

from gyre_train.megatron.weights import (
    Qwen3Shape,
    fuse_qkv,
    hf_to_megatron,
    layer_offset_names,
    megatron_to_hf,
    merge_tp,
    shard_tp,
    split_qkv,
)


def _hf(tied: bool, heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    from transformers import Qwen3Config, Qwen3ForCausalLM  # slow to import: not at collection

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tied,
    )
    model = Qwen3ForCausalLM(cfg)
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    return state, Qwen3Shape.from_hf_config(cfg)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("te_names", [False, True])
def test_round_trip_is_exact(tied: bool, te_names: bool) -> None:
    hf, shape = _hf(tied)
    mg = hf_to_megatron(hf, shape, te_norm_names=te_names)
    assert ("output_layer.weight" in mg) is not tied
    assert mg["decoder.layers.1.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert mg["decoder.layers.0.mlp.linear_fc1.weight"].shape == (256, 64)
    if te_names:
        assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in mg
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mg
    back = megatron_to_hf(mg, shape)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_qkv_is_interleaved_by_query_group() -> None:
    # Q: 4 heads, G: 2 groups -> per group [q_2g, q_2g+1, k_g, v_g]; fill each head with its own id.
    shape = Qwen3Shape(
        num_layers=1,
        hidden_size=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=2,
        tie_word_embeddings=False,
    )
    q = torch.arange(4).repeat_interleave(2)[:, None].expand(8, 3).float()  # heads 0..3
    k = (10 + torch.arange(2)).repeat_interleave(2)[:, None].expand(4, 3).float()
    v = (20 + torch.arange(2)).repeat_interleave(2)[:, None].expand(4, 3).float()
    qkv = fuse_qkv(q, k, v, shape)
    heads = qkv[::2, 0].tolist()
    assert heads == [0, 1, 10, 20, 2, 3, 11, 21]
    q2, k2, v2 = split_qkv(qkv, shape)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_fc1_is_gate_then_up() -> None:
    hf, shape = _hf(False)
    fc1 = hf_to_megatron(hf, shape)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:128], hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[128:], hf["model.layers.0.mlp.up_proj.weight"])


def test_tp_shards_merge_back_and_hold_whole_groups() -> None:
    hf, shape = _hf(False)
    mg = hf_to_megatron(hf, shape)
    for name, full in mg.items():
        parts = [shard_tp(name, full, r, 2) for r in range(2)]
        assert torch.equal(merge_tp(name, parts), full), name
    # rank 1 of linear_qkv = query group 1 exactly; rank 1 of fc1 = second halves of gate and up.
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = split_qkv(
        shard_tp("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 1, 2), shape_tp2(shape)
    )
    assert torch.equal(k, hf["model.layers.0.self_attn.k_proj.weight"][16:])
    assert torch.equal(q, hf["model.layers.0.self_attn.q_proj.weight"][32:])
    assert torch.equal(v, hf["model.layers.0.self_attn.v_proj.weight"][16:])
    fc1_r1 = shard_tp(
        "decoder.layers.0.mlp.linear_fc1.weight", mg["decoder.layers.0.mlp.linear_fc1.weight"], 1, 2
    )
    assert torch.equal(fc1_r1[:64], hf["model.layers.0.mlp.gate_proj.weight"][64:])
    assert torch.equal(fc1_r1[64:], hf["model.layers.0.mlp.up_proj.weight"][64:])
    o_r0 = shard_tp(
        "decoder.layers.0.self_attention.linear_proj.weight",
        hf["model.layers.0.self_attn.o_proj.weight"],
        0,
        2,
    )
    assert o_r0.shape == (64, 32)  # row-parallel: split along the input dim
    with pytest.raises(ValueError, match="does not divide"):
        shard_tp("embedding.word_embeddings.weight", torch.zeros(511, 4), 0, 2)


def shape_tp2(shape: Qwen3Shape) -> Qwen3Shape:
    """The per-rank shape at TP 2 (half the heads and groups)."""
    return Qwen3Shape(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads // 2,
        num_key_value_heads=shape.num_key_value_heads // 2,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
    )


def test_pipeline_layer_renumbering() -> None:
    mg = {
        "decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(1),
        "decoder.final_layernorm.weight": torch.zeros(1),
    }
    glob = layer_offset_names(mg, 3, to_global=True)
    assert set(glob) == {"decoder.layers.3.mlp.linear_fc2.weight", "decoder.final_layernorm.weight"}
    assert set(layer_offset_names(glob, 3, to_global=False)) == set(mg)


def test_unknown_tensors_are_refused_by_name() -> None:
    hf, shape = _hf(False)
    with pytest.raises(KeyError, match=r"q_proj\.bias"):
        hf_to_megatron({**hf, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, shape)
    missing = dict(hf)
    del missing["model.norm.weight"]
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        hf_to_megatron(missing, shape)
    with pytest.raises(KeyError, match="router"):
        megatron_to_hf({"decoder.layers.0.mlp.router.weight": torch.zeros(1)}, shape)
