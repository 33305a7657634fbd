"""The Megatron-core training backend: :class:`gyre_train.backends.base.TrainBackend` on a megatron GPTModel.

Per call one packed shard (T tokens, R rows) goes through ``get_forward_backward_func()`` as one micro-batch of
tokens [1, T]. Rows are kept apart by

- THD packing (``PackedSeqParams(qkv_format="thd")`` with int32 ``cu_seqlens``) with the Transformer Engine layer
  spec (GPU), where RoPE restarts at every row; or
- a block-diagonal causal attention mask [1, 1, T, T] with the local spec (CPU: megatron's local
  DotProductAttention rejects packed_seq_params). RoPE then runs over positions 0..T-1 of the packed sequence;
  attention scores depend on position differences only and the mask keeps them inside a row, so this equals
  per-row positions up to float rounding (the angles are larger).

l_t = log_softmax(logits / T)[labels_t] is computed in fp32 by megatron's vocab-parallel cross entropy (exact with
TP > 1), then ``loss_fn(l_T)`` from gyre_train.loss makes the pre-scaled scalar, the schedule backpropagates it
(``calculate_per_token_loss=True``: no 1/num_microbatches) and gradients sum into the fp32 ``.grad`` of each
parameter across calls. The optimizer (core cell only) is Adam over those parameters, with the global grad norm
reduced over the model-parallel group (TP-replicated parameters counted once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from gyre_train.backends.base import LossFn, PackedTensors
from gyre_train.megatron.model import (
    ParallelConfig,
    build_gpt_model,
    destroy_model_parallel,
    export_hf_weights,
    hf_config,
    init_model_parallel,
    load_hf_weights,
    read_hf_state_dict,
)
from gyre_train.types import IGNORE_LABEL, TokenStats

from megatron.core import parallel_state, tensor_parallel  # isort: skip  (after model.py applied compat)
from megatron.core.packed_seq_params import PackedSeqParams  # isort: skip
from megatron.core.pipeline_parallel import get_forward_backward_func  # isort: skip

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class MegatronBackendConfig:
    """Settings of the Megatron backend."""

    model_path: str
    """Local Hugging Face Qwen3 checkpoint directory (config.json + safetensors)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP/PP/CP/EP layout inside the cell and the layer spec."""
    params_dtype: Literal["float32"] = "float32"
    """Parameter dtype; gradients accumulate in the parameters' dtype, so fp32 (bf16 needs megatron's DDP main_grad)."""
    seed: int = 0
    """Seed of megatron's RNG tracker."""
    optimizer: bool = True
    """Build the Adam optimizer (only the core cell needs one)."""
    lr: float = 1e-6
    """Adam learning rate (constant)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Adam (L2) weight decay, as torch.optim.Adam; 0 by default."""


class MegatronBackend:
    """One rank of a cell's Megatron model replica (see module docstring)."""

    def __init__(self, cfg: MegatronBackendConfig) -> None:
        self.cfg = cfg
        hf_config(cfg.model_path)  # refuse a bad checkpoint before touching process groups
        self._owned = init_model_parallel(cfg.parallel, seed=cfg.seed)
        try:
            self.model, self.shape = build_gpt_model(cfg.model_path, cfg.parallel, _DTYPES[cfg.params_dtype])
            load_hf_weights(self.model, self.shape, read_hf_state_dict(cfg.model_path))
        except BaseException:
            destroy_model_parallel(*self._owned)  # leave no half-initialized global state behind
            raise
        self.thd = cfg.parallel.resolved_spec() == "te"
        self.device = next(self.model.parameters()).device
        self._params = [p for _, p in self.model.named_parameters()]
        self._partial_grads = self._partial_grad_groups()
        # Same optimizer as the torch backend (torch.optim.Adam), so both backends take identical steps.
        self.optimizer = (
            torch.optim.Adam(
                self._params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
            )
            if cfg.optimizer
            else None
        )

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index inside the cell: it runs ``MicroStep.shards[dp_rank]``."""
        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return parallel_state.get_data_parallel_world_size()

    def close(self) -> None:
        """Tear down the process groups this backend created (none if it joined existing ones)."""
        destroy_model_parallel(*self._owned)

    # --- one micro-batch through megatron's schedule -----------------------------------------------------------

    def _inputs(self, batch: PackedTensors) -> dict[str, Any]:
        t = batch.num_tokens
        ids_1T = batch.input_ids.to(self.device)[None]
        pos_1T = batch.position_ids.to(self.device)[None]
        if self.thd:
            cu_R1 = batch.cu_seqlens.to(device=self.device, dtype=torch.int32)
            max_len = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
            psp = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu_R1,
                cu_seqlens_kv=cu_R1,
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )
            return {
                "input_ids": ids_1T,
                "position_ids": pos_1T,
                "attention_mask": None,
                "packed_seq_params": psp,
            }
        # Block-diagonal causal mask, True = masked: key k is visible to query q iff same row and k <= q.
        row_T = torch.repeat_interleave(
            torch.arange(len(batch.cu_seqlens) - 1), batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
        )
        idx_T = torch.arange(t)
        visible_TT = (row_T[:, None] == row_T[None, :]) & (idx_T[None, :] <= idx_T[:, None])
        mask_11TT = (~visible_TT)[None, None].to(self.device)
        return {"input_ids": ids_1T, "position_ids": pos_1T, "attention_mask": mask_11TT}

    def _token_logprobs(
        self, logits_1TV: torch.Tensor, labels_T: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """l_T [T] fp32: log_softmax(logits / T)[labels] (vocab-parallel), 0 where labels == IGNORE_LABEL."""
        logits_T1V = logits_1TV.transpose(0, 1).float() / temperature
        labels_T = labels_T.to(logits_T1V.device)
        ignore_T = labels_T == IGNORE_LABEL
        nll_T1 = tensor_parallel.vocab_parallel_cross_entropy(logits_T1V, labels_T.clamp(min=0)[:, None])
        return torch.where(ignore_T, torch.zeros_like(nll_T1[:, 0]), -nll_T1[:, 0])

    def _run(self, batch: PackedTensors, temperature: float, loss_fn: LossFn | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        inputs = self._inputs(batch)

        def loss_func(output_1TV: torch.Tensor):
            l_T = self._token_logprobs(output_1TV, batch.labels, temperature)
            out["logprobs"] = l_T.detach()
            if loss_fn is None:
                return l_T.sum() * 0.0, torch.tensor(1, dtype=torch.int), {}
            # gyre_train.loss keeps its per-token coefficients on CPU; feed it CPU log-probs (the copy is
            # differentiable, so the gradient still reaches the model on its device).
            loss, stats = loss_fn(l_T.cpu())
            out["stats"] = stats
            return loss, torch.tensor(1, dtype=torch.int), {}

        def forward_step(data_iterator, model):
            next(data_iterator)
            return model(**inputs), loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[self.model],
            num_microbatches=1,
            seq_length=batch.num_tokens,
            micro_batch_size=1,
            forward_only=loss_fn is None,
        )
        return out

    # --- TrainBackend ------------------------------------------------------------------------------------------

    def logprobs(self, batch: PackedTensors, temperature: float) -> torch.Tensor:
        """Forward only: l_T [T] fp32 on CPU (on the last pipeline stage; empty tensor on the others)."""
        self.model.eval()
        with torch.no_grad():
            out = self._run(batch, temperature, None)
        return out["logprobs"].cpu() if "logprobs" in out else torch.empty(0)

    def forward_backward(self, batch: PackedTensors, temperature: float, loss_fn: LossFn) -> TokenStats:
        self.model.train()
        before = [
            [p.grad.clone() if p.grad is not None else None for p in ps] for ps, _ in self._partial_grads
        ]
        out = self._run(batch, temperature, loss_fn)
        for (params, group), prev in zip(self._partial_grads, before, strict=True):
            self._sum_increments(params, prev, group)
        return out.get("stats", TokenStats())

    def _partial_grad_groups(self) -> list[tuple[list[torch.nn.Parameter], Any]]:
        """Parameters whose gradient each rank of a group only sees part of, with that group (megatron's
        ``finalize_model_grads`` rules, which need its DDP wrapper, not used here):

        - TP: QK-layernorm weights (they act on this rank's heads only) and, with sequence parallelism, the norms
          marked ``sequence_parallel``;
        - PP with tied embeddings: the embedding (first stage) and its copy as output layer (last stage).
        """
        out = []
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            sp = self.model.config.sequence_parallel
            tp = [
                p
                for name, p in self.model.named_parameters()
                if "q_layernorm" in name
                or "k_layernorm" in name
                or (sp and getattr(p, "sequence_parallel", False))
            ]
            out.append((tp, parallel_state.get_tensor_model_parallel_group()))
        if (
            self.shape.tie_word_embeddings
            and parallel_state.get_pipeline_model_parallel_world_size() > 1
            and parallel_state.is_rank_in_embedding_group()
        ):
            out.append(
                ([self.model.shared_embedding_or_output_weight()], parallel_state.get_embedding_group())
            )
        return out

    @staticmethod
    def _sum_increments(params: list[torch.nn.Parameter], before: list, group: Any) -> None:
        """Sum this call's gradient increments of ``params`` over ``group`` (only the increment, so gradients
        accumulated by earlier calls are not counted twice)."""
        if not params:
            return
        deltas = [
            (p.grad - b if b is not None else p.grad) if p.grad is not None else torch.zeros_like(p)
            for p, b in zip(params, before, strict=True)
        ]
        flat = torch.cat([d.reshape(-1) for d in deltas])
        dist.all_reduce(flat, group=group)
        for p, b, d in zip(params, before, torch.split(flat, [x.numel() for x in deltas]), strict=True):
            p.grad = (b if b is not None else torch.zeros_like(p)) + d.view_as(p)

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def flat_grads(self) -> torch.Tensor:
        return torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                for p in self._params
            ]
        )

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        for p, g in zip(self._params, self._split(flat), strict=True):
            p.grad = g.to(device=p.device, dtype=p.dtype).view_as(p).clone()

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self._params])

    def load_flat_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, v in zip(self._params, self._split(flat), strict=True):
                p.copy_(v.view_as(p))

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        sizes = [p.numel() for p in self._params]
        if flat.numel() != sum(sizes):
            raise ValueError(f"flat tensor has {flat.numel()} elements, the model has {sum(sizes)}")
        return list(torch.split(flat.reshape(-1), sizes))

    def grad_norm(self) -> float:
        """Global L2 norm of the accumulated gradients over this cell's model-parallel group."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._params:
            # TP-replicated tensors (norms) are identical on every TP rank: count them on rank 0 only.
            # The last stage's copy of a tied embedding (``shared``) is counted on the first stage.
            if p.grad is None or getattr(p, "shared", False):
                continue
            if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                sq += p.grad.double().pow(2).sum()
        group = parallel_state.get_model_parallel_group()  # TP x PP ranks of this model replica
        if dist.get_world_size(group) > 1:
            dist.all_reduce(sq, group=group)
        return float(sq.sqrt())

    def optimizer_step(self, max_grad_norm: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("this backend has no optimizer (only the core updates weights)")
        for p in self._params:  # params that saw no target still take a (zero-gradient) Adam step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = self.grad_norm()
        coef = max_grad_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
        if coef < 1.0:
            for p in self._params:
                p.grad.mul_(coef)
        self.optimizer.step()
        self.zero_grad()
        return norm

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    # --- publication -------------------------------------------------------------------------------------------

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """Current weights under HF Qwen3 names (full tensors, CPU): what rollout engines load."""
        return export_hf_weights(self.model, self.shape)

    def export_hf_grads(self) -> dict[str, torch.Tensor]:
        """Accumulated gradients under HF Qwen3 names (for comparisons with the torch backend)."""
        return export_hf_weights(self.model, self.shape, grads=True)

    def save_hf_pretrained(self, out_dir: str | Path) -> None:
        """Write model.safetensors + config.json loadable by transformers / SGLang (copies the source config)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.export_hf_weights().items()}, str(out / "model.safetensors")
        )
        src = Path(self.cfg.model_path)
        for name in ("config.json", "generation_config.json"):
            if (src / name).exists():
                (out / name).write_bytes((src / name).read_bytes())
