"""Batched forward of a Hugging Face decoder (Llama / Qwen2 / Qwen3 families) over the paged KV cache.

We reuse the HF modules' weights and submodules (projections, norms, rotary embedding, MLP) but run the
attention ourselves so that sequences of different lengths, some prefilling and some decoding, step
together in one forward with their KV read from and written to the shared pool.

Shape legend: B sequences in the step, L = longest new-token run in the step, T = longest total length,
H query heads, G kv heads, D head dim, E hidden size, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import PagedKVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(slots=True)
class StepInput:
    """One sequence's part of a step: tokens to run, their first position, and KV slots."""

    new_tokens: list[int]
    start_pos: int
    write_slots: list[int]
    all_slots: list[int]
    """Slots of every token of the sequence after this step (past + new), in order."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ModelRunner:
    """Runs steps of a causal LM whose KV lives in a `PagedKVCache`."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {cfg.model_type!r} not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the torch engine")
        self.model = model
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size

    @torch.inference_mode()
    def step(self, batch: list[StepInput], kv: PagedKVCache) -> torch.Tensor:
        """Run one step; returns float32 logits of each sequence's last new token, `[B, V]`."""
        assert kv.k_pool is not None and kv.v_pool is not None, "KV cache is released"
        dev = kv.device
        B = len(batch)
        L = max(len(s.new_tokens) for s in batch)
        T = max(len(s.all_slots) for s in batch)
        n_new = torch.tensor([len(s.new_tokens) for s in batch], device=dev)
        total = torch.tensor([len(s.all_slots) for s in batch], device=dev)
        start = torch.tensor([s.start_pos for s in batch], device=dev)

        # one host->device copy per index tensor; padding reads the reserved slot 0
        ids_BL = torch.tensor([s.new_tokens + [0] * (L - len(s.new_tokens)) for s in batch], device=dev)
        gather_BT = torch.tensor([s.all_slots + [0] * (T - len(s.all_slots)) for s in batch], device=dev)
        q_idx_L = torch.arange(L, device=dev)
        real_BL = q_idx_L[None, :] < n_new[:, None]
        write_slots = torch.tensor([x for s in batch for x in s.write_slots], dtype=torch.long, device=dev)
        pos_BL = start[:, None] + q_idx_L[None, :]
        k_idx_T = torch.arange(T, device=dev)
        # key t is visible to query j of sequence b iff t is a real key and not in the future of (start + j)
        mask_B1LT = (k_idx_T[None, None, :] < total[:, None, None]) & (
            k_idx_T[None, None, :] <= pos_BL[:, :, None]
        )
        mask_B1LT = mask_B1LT[:, None]

        inner = self.model.model
        x_BLE = inner.embed_tokens(ids_BL)
        cos_BLD, sin_BLD = inner.rotary_emb(x_BLE, pos_BL)
        cos_BL1D, sin_BL1D = cos_BLD[:, :, None, :], sin_BLD[:, :, None, :]
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h_BLE = layer.input_layernorm(x_BLE)
            q_BLHD = attn.q_proj(h_BLE).view(B, L, -1, self.head_dim)
            k_BLGD = attn.k_proj(h_BLE).view(B, L, -1, self.head_dim)
            v_BLGD = attn.v_proj(h_BLE).view(B, L, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over the head dim before RoPE
                q_BLHD = attn.q_norm(q_BLHD)
                k_BLGD = attn.k_norm(k_BLGD)
            q_BLHD = q_BLHD * cos_BL1D + _rotate_half(q_BLHD) * sin_BL1D
            k_BLGD = k_BLGD * cos_BL1D + _rotate_half(k_BLGD) * sin_BL1D
            kv.k_pool[li, write_slots] = k_BLGD[real_BL].to(kv.dtype)
            kv.v_pool[li, write_slots] = v_BLGD[real_BL].to(kv.dtype)
            k_BGTD = kv.k_pool[li][gather_BT].transpose(1, 2).to(q_BLHD.dtype)
            v_BGTD = kv.v_pool[li][gather_BT].transpose(1, 2).to(q_BLHD.dtype)
            o_BHLD = F.scaled_dot_product_attention(
                q_BLHD.transpose(1, 2),
                k_BGTD,
                v_BGTD,
                attn_mask=mask_B1LT,
                scale=attn.scaling,
                enable_gqa=True,
            )
            x_BLE = x_BLE + attn.o_proj(o_BHLD.transpose(1, 2).reshape(B, L, -1))
            x_BLE = x_BLE + layer.mlp(layer.post_attention_layernorm(x_BLE))
        last_BE = x_BLE[torch.arange(B, device=dev), n_new - 1]
        return self.model.lm_head(inner.norm(last_BE)).float()
