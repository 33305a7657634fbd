"""Hugging Face Qwen3 <-> Megatron-core GPTModel weight names and layouts (pure tensor code, no megatron import).

Name map (layer i; Megatron names are local-spec names, the TE spec fuses the two pre-norms into the linear that
follows them: ``input_layernorm.weight`` -> ``self_attention.linear_qkv.layer_norm_weight`` and
``pre_mlp_layernorm.weight`` -> ``mlp.linear_fc1.layer_norm_weight``):

    model.embed_tokens.weight                    embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight        decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.weight decoder.layers.i.self_attention.linear_qkv.weight     (fused, see below)
    model.layers.i.self_attn.q_norm.weight       decoder.layers.i.self_attention.q_layernorm.weight
    model.layers.i.self_attn.k_norm.weight       decoder.layers.i.self_attention.k_layernorm.weight
    model.layers.i.self_attn.o_proj.weight       decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm.weight  decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight     decoder.layers.i.mlp.linear_fc1.weight                (cat[gate, up])
    model.layers.i.mlp.down_proj.weight          decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                            decoder.final_layernorm.weight
    lm_head.weight                               output_layer.weight                                   (absent if tied)

Qwen3-MoE layers (``num_experts > 0``; layer i has experts unless ``i in mlp_only_layers`` or ``(i + 1) %
decoder_sparse_step``) replace the MLP with a router and E experts (HF checkpoint names, as real Qwen3-MoE
checkpoints and ``save_pretrained`` write them; transformers fuses them in memory only):

    model.layers.i.mlp.gate.weight                     decoder.layers.i.mlp.router.weight                  [E, H]
    model.layers.i.mlp.experts.e.{gate,up}_proj.weight decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight  (cat[gate, up])
    model.layers.i.mlp.experts.e.down_proj.weight      decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight

Expert indices e are global in the full dicts here; with expert parallelism (EP) rank r holds experts
``r * E / EP ... (r + 1) * E / EP - 1`` as local experts 0.. (:func:`expert_offset_names`). The pre-MLP norm of an
MoE layer is never fused into a linear (``pre_mlp_layernorm.weight`` with either spec).

linear_qkv layout: Megatron splits the fused projection per query group (``get_query_key_value_tensors`` views the
output as [s, b, ng, (np/ng + 2) * hd]), so rows are interleaved by KV head: for each group g the np/ng query heads
of g, then k_g, then v_g, each head hd rows. Tensor parallelism shards whole groups, so a contiguous slice of dim 0
is one rank's part. linear_fc1 is [gate; up] (Megatron's SwiGLU takes silu(first half) * second half); a rank holds
[gate_r; up_r].

Tensor shape suffixes: H hidden, D head_dim, V vocab, F ffn, G kv groups, Q query heads per group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Qwen3Shape",
    "expert_offset_names",
    "hf_to_megatron",
    "is_expert_name",
    "megatron_to_hf",
    "merge_tp",
    "shard_tp",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Qwen3Shape:
    """The architecture numbers the mapping needs (read from a HF Qwen3 config)."""

    num_layers: int
    """Decoder layers."""
    hidden_size: int
    """Model width H."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """KV heads (= Megatron query groups)."""
    head_dim: int
    """Per-head width D (Qwen3 sets it explicitly; not always H / heads)."""
    tie_word_embeddings: bool
    """Whether lm_head shares the embedding matrix."""
    num_experts: int = 0
    """Experts per MoE layer (0: a dense Qwen3)."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the layers with experts (Qwen3-MoE)."""

    @classmethod
    def from_hf_config(cls, cfg) -> Qwen3Shape:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        experts = int(getattr(cfg, "num_experts", 0) or 0)
        skip = set(getattr(cfg, "mlp_only_layers", None) or ())
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        moe_layers = (
            tuple(i for i in range(cfg.num_hidden_layers) if i not in skip and (i + 1) % step == 0)
            if experts
            else ()
        )
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            num_experts=experts,
            moe_layers=moe_layers,
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


# HF per-layer suffix -> Megatron per-layer suffix, for the tensors that map one to one.
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# Norm names in the Transformer Engine spec, where the norm lives inside the following fused linear.
_TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MG_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MG_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def fuse_qkv(
    q_QDxH: torch.Tensor, k_GDxH: torch.Tensor, v_GDxH: torch.Tensor, shape: Qwen3Shape
) -> torch.Tensor:
    """HF q/k/v projections -> Megatron's group-interleaved linear_qkv weight [G*(Q+2)*D, H]."""
    g, q, d = shape.num_key_value_heads, shape.heads_per_group, shape.head_dim
    hidden = q_QDxH.shape[1]
    q_GQDH = q_QDxH.reshape(g, q * d, hidden)
    k_GDH = k_GDxH.reshape(g, d, hidden)
    v_GDH = v_GDxH.reshape(g, d, hidden)
    return torch.cat([q_GQDH, k_GDH, v_GDH], dim=1).reshape(g * (q + 2) * d, hidden)


def split_qkv(qkv: torch.Tensor, shape: Qwen3Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    g, q, d = shape.num_key_value_heads, shape.heads_per_group, shape.head_dim
    hidden = qkv.shape[1]
    grouped = qkv.reshape(g, (q + 2) * d, hidden)
    q_w, k_w, v_w = torch.split(grouped, [q * d, d, d], dim=1)
    return q_w.reshape(g * q * d, hidden), k_w.reshape(g * d, hidden), v_w.reshape(g * d, hidden)


def hf_to_megatron(
    hf: dict[str, torch.Tensor], shape: Qwen3Shape, *, te_norm_names: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) HF Qwen3 state dict -> full Megatron GPTModel state dict (all layers, global numbering)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"HF checkpoint has no tensor {name!r} (not a Qwen3 checkpoint?)")
        used.add(name)
        return hf[name]

    out["embedding.word_embeddings.weight"] = take("model.embed_tokens.weight")
    for i in range(shape.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        moe = i in shape.moe_layers
        for hf_suffix, mg_suffix in _LAYER_DIRECT.items():
            if moe and hf_suffix == "mlp.down_proj.weight":
                continue
            if te_norm_names and not (moe and mg_suffix == "pre_mlp_layernorm.weight"):
                mg_suffix = _TE_NORM_NAMES.get(mg_suffix, mg_suffix)
            out[mp + mg_suffix] = take(hp + hf_suffix)
        out[mp + "self_attention.linear_qkv.weight"] = fuse_qkv(
            take(hp + "self_attn.q_proj.weight"),
            take(hp + "self_attn.k_proj.weight"),
            take(hp + "self_attn.v_proj.weight"),
            shape,
        )
        if moe:
            out[mp + "mlp.router.weight"] = take(hp + "mlp.gate.weight")
            for e in range(shape.num_experts):
                he, me = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{e}."
                out[me + "linear_fc1.weight"] = torch.cat(
                    [take(he + "gate_proj.weight"), take(he + "up_proj.weight")], dim=0
                )
                out[me + "linear_fc2.weight"] = take(he + "down_proj.weight")
            continue
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [take(hp + "mlp.gate_proj.weight"), take(hp + "mlp.up_proj.weight")], dim=0
        )
    out["decoder.final_layernorm.weight"] = take("model.norm.weight")
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    else:
        used.add("lm_head.weight")
    unused = sorted(set(hf) - used)
    if unused:
        raise KeyError(f"HF tensors with no Megatron counterpart (bias? MoE?): {unused[:5]}")
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], shape: Qwen3Shape) -> dict[str, torch.Tensor]:
    """Full Megatron GPTModel state dict (local or TE names) -> HF Qwen3 names. Unknown names raise KeyError."""
    inverse = {mg_s: hf_s for hf_s, mg_s in _LAYER_DIRECT.items()}
    inverse.update({te: inverse[local] for local, te in _TE_NORM_NAMES.items()})
    out: dict[str, torch.Tensor] = {}
    for name, t in mg.items():
        if name.endswith("._extra_state"):
            continue
        m = _MG_LAYER.match(name)
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t
        elif m and m.group(2) == "self_attention.linear_qkv.weight":
            q, k, v = split_qkv(t, shape)
            hp = f"model.layers.{m.group(1)}.self_attn."
            out[hp + "q_proj.weight"], out[hp + "k_proj.weight"], out[hp + "v_proj.weight"] = q, k, v
        elif m and m.group(2) == "mlp.linear_fc1.weight":
            gate, up = torch.chunk(t, 2, dim=0)
            hp = f"model.layers.{m.group(1)}.mlp."
            out[hp + "gate_proj.weight"], out[hp + "up_proj.weight"] = gate, up
        elif m and m.group(2) == "mlp.router.weight" and int(m.group(1)) in shape.moe_layers:
            out[f"model.layers.{m.group(1)}.mlp.gate.weight"] = t
        elif m and int(m.group(1)) in shape.moe_layers and (x := _MG_EXPERT.match(m.group(2))):
            he = f"model.layers.{m.group(1)}.mlp.experts.{x.group(1)}."
            if x.group(2) == "linear_fc1":
                out[he + "gate_proj.weight"], out[he + "up_proj.weight"] = torch.chunk(t, 2, dim=0)
            else:
                out[he + "down_proj.weight"] = t
        elif m and m.group(2) in inverse:
            out[f"model.layers.{m.group(1)}.{inverse[m.group(2)]}"] = t
        else:
            raise KeyError(f"Megatron tensor {name!r} has no HF Qwen3 counterpart")
    return out


# --- tensor parallelism: how each full Megatron tensor splits over TP ranks -------------------------------------


def _tp_kind(name: str) -> str:
    """'column' (split dim 0), 'row' (split dim 1), 'fc1' (split gate and up separately) or 'replicated'.
    Experts split like the dense MLP (over the expert-TP group, megatron's default: the TP group); the router is
    replicated."""
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return "column"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    return "replicated"


def shard_tp(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's part of a full Megatron tensor (embedding/output split by vocab: V must divide by size)."""
    if size == 1:
        return full
    kind = _tp_kind(name)
    if kind == "replicated":
        return full
    dim = 1 if kind == "row" else 0
    if full.shape[dim] % size:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not divide by TP size {size}")
    if kind == "fc1":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    return full.chunk(size, dim)[rank].contiguous()


def merge_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard_tp` over all ranks' shards (rank order)."""
    if len(shards) == 1:
        return shards[0]
    kind = _tp_kind(name)
    if kind == "replicated":
        return shards[0]
    if kind == "fc1":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if kind == "row" else 0)


def layer_offset_names(
    mg: dict[str, torch.Tensor], offset: int, *, to_global: bool
) -> dict[str, torch.Tensor]:
    """Renumber decoder layers between a pipeline stage's local numbering and the global one."""
    sign = 1 if to_global else -1
    out = {}
    for name, t in mg.items():
        m = _MG_LAYER.match(name)
        out[f"decoder.layers.{int(m.group(1)) + sign * offset}.{m.group(2)}" if m else name] = t
    return out


def expert_offset_names(
    mg: dict[str, torch.Tensor], offset: int, *, to_global: bool
) -> dict[str, torch.Tensor]:
    """Renumber experts between an EP rank's local numbering (0..E/EP-1) and the global one (``offset`` = EP rank
    x E/EP)."""
    sign = 1 if to_global else -1
    out = {}
    for name, t in mg.items():
        m = _MG_LAYER.match(name)
        x = _MG_EXPERT.match(m.group(2)) if m else None
        if x:
            name = (
                f"decoder.layers.{m.group(1)}.mlp.experts.local_experts."
                f"{int(x.group(1)) + sign * offset}.{x.group(2)}.weight"
            )
        out[name] = t
    return out


def is_expert_name(name: str) -> bool:
    """A Megatron name of an expert's weight (held by one EP rank only)."""
    m = _MG_LAYER.match(name)
    return bool(m and _MG_EXPERT.match(m.group(2)))


def hf_layer_index(name: str) -> int | None:
    """Layer index of a HF tensor name (None for embedding, final norm, lm_head)."""
    m = _HF_LAYER.match(name)
    return int(m.group(1)) if m else None


def write_hf_checkpoint(weights: dict[str, torch.Tensor], model_path: str, out_dir: str | Path) -> None:
    """``weights`` (HF names) as model.safetensors in ``out_dir``, with the config files of ``model_path``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    src = Path(model_path)
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
