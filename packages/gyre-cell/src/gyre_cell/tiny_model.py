"""A tiny Qwen3 causal LM built offline and deterministically (tests, benchmarks, demos).

The weights come from a seeded random init, so two builds with the same seed write byte-identical
safetensors. The tokenizer comes from `gyre_tito.tiny_tokenizer` (byte-level BPE with the Qwen special
tokens and a Qwen3-style chat template) when that module is available.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyModelConfig:
    """Shape and seed of the tiny model."""

    vocab_size: int = 512
    """Vocabulary size; the tiny tokenizer's ids (specials included) fit below it."""
    hidden_size: int = 64
    """Model width."""
    intermediate_size: int = 128
    """MLP width."""
    num_hidden_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention, as in Qwen3)."""
    head_dim: int = 16
    """Per-head width."""
    max_position_embeddings: int = 4096
    """Context length the engine enforces."""
    seed: int = 0
    """Seed of the random init."""


def _tokenizer_builder():
    """The tito tokenizer builder, or None while that module does not exist."""
    try:
        from gyre_tito.tiny_tokenizer import build_tiny_tokenizer
    except ImportError:
        return None
    return build_tiny_tokenizer


def build_tiny_model(out_dir: str | Path, config: TinyModelConfig | None = None) -> Path:
    """Write a tiny Qwen3ForCausalLM (safetensors) and, when available, its tokenizer into `out_dir`."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    cfg = config or TinyModelConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gyre_tiny_model.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")

    eos_ids: list[int] = []
    builder = _tokenizer_builder()
    if builder is not None:
        builder(out)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)
        if len(tok) > cfg.vocab_size:
            raise ValueError(f"tokenizer has {len(tok)} entries, more than vocab_size={cfg.vocab_size}")
        for name in ("<|im_end|>", "<|endoftext|>"):
            tid = tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tok.unk_token_id and tid not in eos_ids:
                eos_ids.append(tid)

    hf_config = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_ids[0] if eos_ids else None,
        torch_dtype="float32",
    )
    # Seed, build and init in one place: the same seed gives the same bytes on every machine.
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(hf_config).to(torch.float32)
    finally:
        torch.random.set_rng_state(gen_state)
    model.save_pretrained(out, safe_serialization=True)
    if eos_ids:
        GenerationConfig(eos_token_id=eos_ids).save_pretrained(out)
    return out
