"""Building a megatron-core GPTModel that computes exactly what a Hugging Face Qwen3 checkpoint computes.

Also: process-group setup (gloo on CPU, NCCL on GPU) and loading/exporting weights by HF name. Everything here
takes the parallel layout from megatron's ``parallel_state`` (TP/PP/CP/EP as initialized by
:func:`init_model_parallel`).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gyre_train.megatron import compat
from gyre_train.megatron.weights import (
    Qwen3Shape,
    expert_offset_names,
    hf_to_megatron,
    is_expert_name,
    layer_offset_names,
    megatron_to_hf,
    merge_tp,
    shard_tp,
)
from gyre_train.ports import free_port

try:
    compat.apply()  # must precede megatron's attention import on CPU (flash_mla, see compat)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the Megatron backend needs megatron-core: install `gyre-train[megatron]` "
        "(uv sync --extra megatron / pip install 'gyre-train[megatron]')"
    ) from e


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Parallel layout inside one cell (all 1 on CPU)."""

    tensor_parallel: int = 1
    """TP size (splits heads, FFN and vocab; vocab_size must divide by it)."""
    pipeline_parallel: int = 1
    """PP size (layers split over stages; log-probs appear on the last stage)."""
    context_parallel: int = 1
    """CP size (needs the Transformer Engine layer spec)."""
    expert_parallel: int = 1
    """EP size: a Qwen3-MoE model's experts split over EP ranks (carved out of the data-parallel ranks)."""
    layer_spec: Literal["auto", "local", "te"] = "auto"
    """'local' (pure megatron-core, block-diagonal mask packing), 'te' (Transformer Engine, THD packing), 'auto'."""

    def resolved_spec(self) -> str:
        if self.layer_spec != "auto":
            return self.layer_spec
        has_te = importlib.util.find_spec("transformer_engine") is not None
        return "te" if has_te and torch.cuda.is_available() else "local"


def init_model_parallel(par: ParallelConfig, seed: int = 0) -> tuple[bool, bool]:
    """Initialize torch.distributed and megatron's model-parallel groups where not yet done.

    Returns (created the default process group, created megatron's groups): the caller owns the teardown of what
    it created (:func:`destroy_model_parallel`). Without RANK/WORLD_SIZE in the environment a one-process group on
    a free loopback port is created (gloo on CPU, NCCL on GPU).
    """
    created_pg = created_mp = False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            init_method = "env://"
        else:
            if world != 1:
                raise RuntimeError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT")
            init_method = f"tcp://127.0.0.1:{free_port()}"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
        created_pg = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=par.tensor_parallel,
            pipeline_model_parallel_size=par.pipeline_parallel,
            context_parallel_size=par.context_parallel,
            expert_model_parallel_size=par.expert_parallel,
        )
        created_mp = True
    elif parallel_state.get_tensor_model_parallel_world_size() != par.tensor_parallel:
        raise RuntimeError("megatron's groups already exist with a different tensor-parallel size")
    model_parallel_cuda_manual_seed(seed)
    return created_pg, created_mp


def destroy_model_parallel(process_group: bool, model_parallel: bool) -> None:
    """Undo what :func:`init_model_parallel` created (its two return values)."""
    if model_parallel:
        parallel_state.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


def hf_config(model_path: str | Path):
    """The checkpoint's transformers config, validated: a local Qwen3 or Qwen3-MoE without attention bias."""
    from transformers import AutoConfig

    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_path}: no config.json (a local Hugging Face checkpoint directory is needed)"
        )
    cfg = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    if cfg.model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(
            f"{model_path}: model_type {cfg.model_type!r} is not supported (only 'qwen3' and 'qwen3_moe')"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"{model_path}: hidden_act {cfg.hidden_act!r} is not supported (only silu)")
    if getattr(cfg, "attention_bias", False):
        raise ValueError(f"{model_path}: attention_bias=True is not supported")
    _rope_theta(cfg)  # refuses RoPE scaling
    return cfg


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(cfg, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
        raise ValueError(f"rope type {rope_type!r} / scaling {scaling!r} is not supported (plain RoPE only)")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def build_gpt_model(
    model_path: str | Path, par: ParallelConfig, params_dtype: torch.dtype = torch.float32
) -> tuple[GPTModel, Qwen3Shape]:
    """A GPTModel configured like the HF Qwen3 at ``model_path`` (weights not loaded; see :func:`load_hf_weights`)."""
    hf = hf_config(model_path)
    shape = Qwen3Shape.from_hf_config(hf)
    if hf.vocab_size % par.tensor_parallel:
        raise ValueError(
            f"vocab_size {hf.vocab_size} does not divide by tensor_parallel {par.tensor_parallel}"
        )
    spec_kind = par.resolved_spec()
    on_gpu = torch.cuda.is_available()
    moe: dict = {}
    if shape.num_experts:
        if shape.num_experts % par.expert_parallel:
            raise ValueError(
                f"num_experts {shape.num_experts} does not divide by expert_parallel {par.expert_parallel}"
            )
        # HF Qwen3-MoE routing: softmax over all experts, top-k, renormalized iff norm_topk_prob. megatron's
        # default (top-k of the logits, then softmax over those k) is the renormalized form; pre_softmax the
        # other. No load-balancing loss: the GSPO objective is the whole loss.
        moe = dict(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_router_topk=hf.num_experts_per_tok,
            moe_router_pre_softmax=not hf.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32",
            moe_grouped_gemm=False,
            moe_layer_freq=[int(i in shape.moe_layers) for i in range(shape.num_layers)],
        )
    elif par.expert_parallel > 1:
        raise ValueError("expert_parallel > 1 needs a model with experts (Qwen3-MoE)")
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=par.tensor_parallel,
        pipeline_model_parallel_size=par.pipeline_parallel,
        context_parallel_size=par.context_parallel,
        expert_model_parallel_size=par.expert_parallel,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # every weight comes from the checkpoint
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # Micro-steps have varying token counts, and their losses are pre-scaled per token (docs/design/training.md#objective): the
        # schedule must not divide by num_microbatches or token counts.
        variable_seq_lengths=True,
        calculate_per_token_loss=True,
        moe_token_dispatcher_type="alltoall",  # the default (allgather) rejects variable_seq_lengths
        **moe,
    )
    if shape.num_experts:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=spec_kind == "te", normalization="RMSNorm"
        )
    elif spec_kind == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    with compat.building_model():
        model = GPTModel(
            config,
            spec,
            vocab_size=hf.vocab_size,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=_rope_theta(hf),
        )
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    return model, shape


def read_hf_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a local HF checkpoint (single or sharded safetensors)."""
    from safetensors.torch import load_file

    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(path / f)))
    return out


def _layer_offset(model: GPTModel) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config)


def _expert_offset(shape: Qwen3Shape) -> int:
    """Global index of this EP rank's first local expert."""
    if not shape.num_experts:
        return 0
    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (shape.num_experts // ep)


def _global_name(local_name: str, param: torch.Tensor, layer_offset: int, expert_offset: int) -> str:
    named = layer_offset_names({local_name: param}, layer_offset, to_global=True)
    return expert_offset_names(named, expert_offset, to_global=True).popitem()[0]


def _tp(name: str) -> tuple[int, int, object]:
    """(rank, size, group) of the tensor-parallel group that shards ``name`` (the expert-TP group for experts)."""
    if is_expert_name(name):
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_group(),
        )
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def load_hf_weights(
    model: GPTModel, shape: Qwen3Shape, hf_state: dict[str, torch.Tensor], *, grads: bool = False
) -> None:
    """Copy a full HF Qwen3 state dict into this rank's (TP-sharded, PP-local) GPTModel parameters (``grads``: set
    their ``.grad`` to it instead: a pipelined cell's stages take their part of a full gradient this way)."""
    te = any(n.endswith("layer_norm_weight") for n, _ in model.named_parameters())
    full = hf_to_megatron(hf_state, shape, te_norm_names=te)
    if shape.tie_word_embeddings:  # the last PP stage keeps its own copy of the tied matrix
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    offset, e_offset = _layer_offset(model), _expert_offset(shape)
    for local_name, param in model.named_parameters():
        name = _global_name(local_name, param, offset, e_offset)
        if name not in full:
            raise KeyError(f"no checkpoint tensor for Megatron parameter {name!r}")
        tp_rank, tp_size, _ = _tp(name)
        part = shard_tp(name, full[name], tp_rank, tp_size)
        if part.shape != param.shape:
            raise ValueError(f"{name}: checkpoint part {tuple(part.shape)} vs parameter {tuple(param.shape)}")
        if grads:
            param.grad = part.to(device=param.device, dtype=param.dtype).clone()
            continue
        with torch.no_grad():
            param.copy_(part.to(param.dtype))


def export_hf_weights(
    model: GPTModel, shape: Qwen3Shape, *, grads: bool | str = False
) -> dict[str, torch.Tensor]:
    """This PP stage's weights (or, with ``grads``, accumulated gradients: ``.grad``, or the attribute named by a
    string such as ``"main_grad"``) as full (TP-gathered) tensors under HF Qwen3 names, on CPU.

    Every TP rank returns the same dict, and every EP rank (experts are gathered over the EP group). With PP > 1 each
    stage returns its own layers (plus the embedding on the first stage, final norm and untied lm_head on the last);
    the caller merges stages.
    """
    offset, e_offset = _layer_offset(model), _expert_offset(shape)
    ep_size = parallel_state.get_expert_model_parallel_world_size() if shape.num_experts else 1
    full: dict[str, torch.Tensor] = {}
    for local_name, param in model.named_parameters():
        name = _global_name(local_name, param, offset, e_offset)
        _, tp_size, tp_group = _tp(name)
        if name == "output_layer.weight" and shape.tie_word_embeddings:
            continue
        if grads:
            g = getattr(param, grads if isinstance(grads, str) else "grad", None)
            t = g if g is not None else torch.zeros_like(param)
        else:
            t = param.detach()
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp_size)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = merge_tp(name, parts)
        if ep_size > 1 and is_expert_name(name):
            # EP rank r holds experts r*E/EP + j: gather local expert j from every EP rank (same shapes).
            parts = [torch.empty_like(t) for _ in range(ep_size)]
            dist.all_gather(parts, t.contiguous(), group=parallel_state.get_expert_model_parallel_group())
            local = expert_offset_names({name: t}, e_offset, to_global=False).popitem()[0]
            for r, part in enumerate(parts):
                glob = expert_offset_names({local: part}, r * (shape.num_experts // ep_size), to_global=True)
                full.update({k: v.cpu().clone() for k, v in glob.items()})
            continue
        full[name] = t.cpu().clone()
    return megatron_to_hf(full, shape)
