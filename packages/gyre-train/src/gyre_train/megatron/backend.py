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

Mixed precision (``params_dtype="bfloat16"``): the model is wrapped in megatron's ``DistributedDataParallel`` with
fp32 main-grad buffers (``grad_reduce_in_fp32``; every backward adds the bf16 ``.grad`` into the fp32
``.main_grad``), and the optimizer is megatron's (``get_megatron_optimizer``: fp32 main parameters, Adam, and with
``distributed_optimizer`` the optimizer state sharded over the cell's data-parallel ranks). Because the model
config has ``calculate_per_token_loss=True`` the data-parallel reduction is a plain SUM (DDP's gradient scaling
factor is 1): the per-token coefficients stay exact (docs/design/training.md#objective). Partial gradients (QK-layernorm under TP, tied
embeddings under PP) and the data-parallel reduce-scatter are finalized once, by ``finalize_model_grads`` in the
core's ``optimizer_step``; ``flat_grads`` / ``set_flat_grads`` move this rank's raw fp32 main grads (sums are linear,
so satellites' raw gradients added before the finalization give the same total).
Checkpoints (``state_dict``) are per rank: on the bf16 path the bf16 model and this rank's optimizer shard (fp32
main parameters and Adam moments), restored on the same layout.

Streaming several micro-steps through one 1F1B pipeline (PP > 1) is :mod:`gyre_train.megatron.pipeline`; this
module's ``forward_backward`` runs one micro-step per schedule call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gyre_train.backends.base import LossFn, PackedTensors
from gyre_train.megatron import compat
from gyre_train.megatron.config import MegatronBackendConfig
from gyre_train.megatron.model import (
    build_gpt_model,
    destroy_model_parallel,
    export_hf_weights,
    hf_config,
    init_model_parallel,
    load_hf_weights,
    read_hf_state_dict,
)
from gyre_train.megatron.thd import cp_assemble, cp_partition
from gyre_train.megatron.weights import write_hf_checkpoint
from gyre_train.types import IGNORE_LABEL, TokenStats

from megatron.core import parallel_state, tensor_parallel  # isort: skip  (after model.py applied compat)
from megatron.core.packed_seq_params import PackedSeqParams  # isort: skip
from megatron.core.pipeline_parallel import get_forward_backward_func  # isort: skip

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class _Prepared:
    """One shard made ready for the model: its keyword arguments, the labels of the tokens this rank holds, the
    shard's token count, and with CP every rank's positions (``cp_partition``)."""

    kwargs: dict[str, Any]
    labels: torch.Tensor
    num_tokens: int
    cp_parts: list[torch.Tensor] | None = None
    temperatures: torch.Tensor | None = None
    """[T_local, 1, 1]: the recorded sampling temperature of each label this rank holds (None: the scalar)."""


class MegatronBackend:
    """One rank of a cell's Megatron model replica (see module docstring)."""

    def __init__(self, cfg: MegatronBackendConfig) -> None:
        self.cfg = cfg
        hf_config(cfg.model_path)  # refuse a bad checkpoint before touching process groups
        if cfg.parallel.context_parallel > 1 and (
            cfg.parallel.resolved_spec() != "te" or cfg.params_dtype == "float32"
        ):
            raise ValueError(
                "context_parallel > 1 needs the Transformer Engine layer spec (THD attention across CP ranks) "
                "and params_dtype='bfloat16' (megatron DDP sums the CP ranks' gradients)"
            )
        self._owned = init_model_parallel(cfg.parallel, seed=cfg.seed)
        try:
            self.model, self.shape = build_gpt_model(cfg.model_path, cfg.parallel, _DTYPES[cfg.params_dtype])
            load_hf_weights(self.model, self.shape, read_hf_state_dict(cfg.model_path))
        except BaseException:
            destroy_model_parallel(*self._owned)  # leave no half-initialized global state behind
            raise
        self.thd = cfg.parallel.resolved_spec() == "te"
        self.cp = cfg.parallel.context_parallel
        self.device = next(self.model.parameters()).device
        self._params = [p for _, p in self.model.named_parameters()]
        self.mixed = cfg.params_dtype != "float32"
        self.ddp: Any = None
        """megatron's DistributedDataParallel around ``model`` (bf16 path; None for fp32)."""
        self.optimizer: Any = None
        if self.mixed:
            self.ddp = self._wrap_ddp()
            if cfg.optimizer:
                self.optimizer = self._megatron_optimizer()
            self._partial_grads: list = []  # finalize_model_grads does it at the optimizer step
        else:
            self._partial_grads = self._partial_grad_groups()
            # Same optimizer as the torch backend (torch.optim.Adam), so both backends take identical steps.
            if cfg.optimizer:
                self.optimizer = torch.optim.Adam(
                    self._params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
                )

    @property
    def chunk(self) -> torch.nn.Module:
        """The module the schedules run: the DDP wrapper on the bf16 path, else the GPTModel."""
        return self.ddp if self.ddp is not None else self.model

    def _wrap_ddp(self) -> Any:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,  # fp32 main grads: micro-step gradients sum in fp32
            overlap_grad_reduce=False,  # one reduction per batch, at the core's optimizer step
            use_distributed_optimizer=self.cfg.distributed_optimizer,
            average_in_collective=False,  # plain SUM over data-parallel ranks (docs/design/training.md#multi-cell-training)
        )
        # DDP re-homes parameter data into its contiguous buffers (copying the loaded values).
        return DistributedDataParallel(self.model.config, ddp_cfg, self.model)

    def _megatron_optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.cfg
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0],
            adam_beta2=cfg.betas[1],
            adam_eps=cfg.eps,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=cfg.distributed_optimizer,
            clip_grad=1.0,  # replaced by optimizer_step's max_grad_norm
        )
        with compat.cuda_tensor_types():
            return get_megatron_optimizer(opt_cfg, [self.ddp])

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

    def regroup(self) -> None:
        """Re-create megatron's groups over a new world generation (see ``TrainBackend.regroup``): a cell worker
        whose gloo world of cells was re-formed after a cell's restart. Only for a replica of one rank in float32:
        its modules and optimizer hold no group (what a `gyre run` cell of one process is); a wider replica's
        layers and megatron's DDP buffers keep the groups they were built with, so it is refused."""
        p = self.cfg.parallel
        wide = (p.tensor_parallel, p.pipeline_parallel, p.context_parallel, p.expert_parallel) != (1, 1, 1, 1)
        if wide or self.mixed:
            raise ValueError(
                f"a megatron replica of TP={p.tensor_parallel} PP={p.pipeline_parallel} CP={p.context_parallel} "
                f"EP={p.expert_parallel} in {self.cfg.params_dtype} cannot move to a new world: its layers and "
                "buffers hold their groups (only TP=PP=CP=EP=1 in float32 can)"
            )
        parallel_state.destroy_model_parallel()  # the old generation's groups (their world is destroyed)
        created_pg, _ = self._owned
        _, created_mp = init_model_parallel(p, seed=self.cfg.seed)
        self._owned = (created_pg, created_mp)
        self._partial_grads = self._partial_grad_groups()  # none at TP = PP = 1; rebuilt for the rule's sake

    # --- one micro-batch through megatron's schedule -----------------------------------------------------------

    def _inputs(self, batch: PackedTensors) -> _Prepared:
        """The model's keyword arguments for one shard, and what ``shard_logprobs`` needs to read its output."""
        prep = self._model_inputs(batch)
        if batch.temperatures is not None:  # recorded per call: this rank's labels' share (CP zigzag order)
            t_T = batch.temperatures
            if prep.cp_parts is not None:
                own = prep.cp_parts[parallel_state.get_context_parallel_rank()]
                t_T = torch.where(own >= 0, t_T[own.clamp(min=0)], torch.ones_like(own, dtype=t_T.dtype))
            prep.temperatures = t_T.to(self.device, torch.float32)[:, None, None]
        return prep

    def _model_inputs(self, batch: PackedTensors) -> _Prepared:
        t = batch.num_tokens
        ids_1T = batch.input_ids.to(self.device)[None]
        pos_1T = batch.position_ids.to(self.device)[None]
        if self.thd:
            if self.cp > 1:
                return self._cp_inputs(batch)
            cu_R1 = batch.cu_seqlens.to(device=self.device, dtype=torch.int32)
            max_len = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
            psp = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu_R1,
                cu_seqlens_kv=cu_R1,
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )
            kwargs = {
                "input_ids": ids_1T,
                "position_ids": pos_1T,
                "attention_mask": None,
                "packed_seq_params": psp,
            }
            return _Prepared(kwargs, batch.labels, t)
        # Block-diagonal causal mask, True = masked: key k is visible to query q iff same row and k <= q.
        row_T = torch.repeat_interleave(
            torch.arange(len(batch.cu_seqlens) - 1), batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
        )
        idx_T = torch.arange(t)
        visible_TT = (row_T[:, None] == row_T[None, :]) & (idx_T[None, :] <= idx_T[:, None])
        mask_11TT = (~visible_TT)[None, None].to(self.device)
        kwargs = {"input_ids": ids_1T, "position_ids": pos_1T, "attention_mask": mask_11TT}
        return _Prepared(kwargs, batch.labels, t)

    def _cp_inputs(self, batch: PackedTensors) -> _Prepared:
        """THD with context parallelism: this CP rank's zigzag share of every row (``gyre_train.megatron.thd``),
        rows padded to a multiple of 2 x CP, attention over the padded boundaries."""
        cu = batch.cu_seqlens.tolist()
        parts = [torch.tensor(cp_partition(cu, self.cp, c)[0], dtype=torch.long) for c in range(self.cp)]
        cu_padded = torch.tensor(cp_partition(cu, self.cp, 0)[1], dtype=torch.int32, device=self.device)
        own = parts[parallel_state.get_context_parallel_rank()]
        valid = own >= 0
        ids = torch.where(valid, batch.input_ids[own.clamp(min=0)], torch.zeros_like(own))
        labels = torch.where(valid, batch.labels[own.clamp(min=0)], torch.full_like(own, IGNORE_LABEL))
        max_len = int((cu_padded[1:] - cu_padded[:-1]).max())
        psp = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_padded,
            cu_seqlens_kv=cu_padded,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )
        kwargs = {
            "input_ids": ids.to(self.device)[None],
            "position_ids": None,  # RoPE positions come from the padded boundaries
            "attention_mask": None,
            "packed_seq_params": psp,
        }
        return _Prepared(kwargs, labels, batch.num_tokens, cp_parts=parts)

    def _token_logprobs(
        self, logits_1TV: torch.Tensor, labels_T: torch.Tensor, temperature: float | torch.Tensor
    ) -> torch.Tensor:
        """l_T [T] fp32: log_softmax(logits / T)[labels] (vocab-parallel), 0 where labels == IGNORE_LABEL."""
        logits_T1V = logits_1TV.transpose(0, 1).float() / temperature
        labels_T = labels_T.to(logits_T1V.device)
        ignore_T = labels_T == IGNORE_LABEL
        nll_T1 = tensor_parallel.vocab_parallel_cross_entropy(logits_T1V, labels_T.clamp(min=0)[:, None])
        return torch.where(ignore_T, torch.zeros_like(nll_T1[:, 0]), -nll_T1[:, 0])

    def shard_logprobs(self, output_1TV: torch.Tensor, prep: _Prepared, temperature: float) -> torch.Tensor:
        """The shard's l_T [T] from the last stage's output. With CP every rank returns all T values (the other
        ranks' are gathered, detached): the GSPO loss and its statistics need every token of an execution, and the
        gradient flows through this rank's own tokens only, so the CP ranks' gradients sum to the whole one."""
        temp = prep.temperatures if prep.temperatures is not None else temperature
        l_local = self._token_logprobs(output_1TV, prep.labels, temp)
        if prep.cp_parts is None:
            return l_local
        got = [torch.empty_like(l_local) for _ in prep.cp_parts]
        dist.all_gather(got, l_local.detach().contiguous(), group=parallel_state.get_context_parallel_group())
        rank = parallel_state.get_context_parallel_rank()
        return cp_assemble(l_local, got, prep.cp_parts, rank, prep.num_tokens)

    def _run(self, batch: PackedTensors, temperature: float, loss_fn: LossFn | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        prep = self._inputs(batch)

        def loss_func(output_1TV: torch.Tensor):
            l_T = self.shard_logprobs(output_1TV, prep, temperature)
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
            return model(**prep.kwargs), loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[self.chunk],
            num_microbatches=1,
            seq_length=batch.num_tokens,
            micro_batch_size=1,
            forward_only=loss_fn is None,
        )
        return out

    # --- TrainBackend ------------------------------------------------------------------------------------------

    def logprobs(self, batch: PackedTensors, temperature: float) -> torch.Tensor:
        """Forward only: l_T [T] fp32 on CPU (on the last pipeline stage; empty tensor on the others)."""
        self.chunk.eval()
        with torch.no_grad():
            out = self._run(batch, temperature, None)
        return out["logprobs"].cpu() if "logprobs" in out else torch.empty(0)

    def forward_backward(self, batch: PackedTensors, temperature: float, loss_fn: LossFn) -> TokenStats:
        self.chunk.train()
        before = self.partial_grads_before()
        out = self._run(batch, temperature, loss_fn)
        self.sum_partial_grads(before)
        return out.get("stats", TokenStats())

    def partial_grads_before(self) -> list:
        """fp32 path: the current gradients of the parameters whose gradient is partial per rank (see
        ``_partial_grad_groups``), to be summed by :meth:`sum_partial_grads` after more backward passes."""
        return [[p.grad.clone() if p.grad is not None else None for p in ps] for ps, _ in self._partial_grads]

    def sum_partial_grads(self, before: list) -> None:
        """Sum the increments since ``before`` of the partial gradients over their groups (a collective over the
        TP group / the embedding group: every rank of those groups calls it at the same point)."""
        for (params, group), prev in zip(self._partial_grads, before, strict=True):
            self._sum_increments(params, prev, group)

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

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The accumulated gradient of ``p``: ``.main_grad`` (fp32 buffer) on the bf16 path, else ``.grad``."""
        return p.main_grad if self.mixed else p.grad

    def zero_grad(self) -> None:
        if self.mixed:
            self.ddp.zero_grad_buffer()
            return
        for p in self._params:
            p.grad = None

    def flat_grads(self) -> torch.Tensor:
        """This rank's accumulated gradients (fp32; on the bf16 path the raw main grads, before the
        data-parallel reduction of ``optimizer_step``)."""
        return torch.cat(
            [
                (g if (g := self._grad(p)) is not None else torch.zeros_like(p)).reshape(-1).float()
                for p in self._params
            ]
        )

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        for p, g in zip(self._params, self._split(flat), strict=True):
            if self.mixed:
                p.main_grad.copy_(g.view_as(p))
            else:
                p.grad = g.to(device=p.device, dtype=p.dtype).view_as(p).clone()

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self._params])

    def load_flat_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for p, v in zip(self._params, self._split(flat), strict=True):
                p.copy_(v.view_as(p))
        if self.mixed and self.optimizer is not None:
            self.optimizer.reload_model_params()  # the fp32 main parameters follow the loaded ones

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        sizes = [p.numel() for p in self._params]
        if flat.numel() != sum(sizes):
            raise ValueError(f"flat tensor has {flat.numel()} elements, the model has {sum(sizes)}")
        return list(torch.split(flat.reshape(-1), sizes))

    def grad_norm(self) -> float:
        """Global L2 norm of the accumulated gradients over this cell's model replica: dense tensors over the
        model-parallel group (TP x PP), experts (held by one EP rank each) over the expert-TP x EP x PP group."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._params:
            g = self._grad(p)
            # The last stage's copy of a tied embedding (``shared``) is counted on the first stage.
            if g is None or getattr(p, "shared", False):
                continue
            if not getattr(p, "allreduce", True):  # an expert's weight: this EP rank's own
                experts += g.double().pow(2).sum()
            elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                # TP-replicated tensors (norms, router) are identical on every TP rank: counted on rank 0 only.
                dense += g.double().pow(2).sum()
        group = parallel_state.get_model_parallel_group()  # TP x PP ranks of this model replica
        if dist.get_world_size(group) > 1:
            dist.all_reduce(dense, group=group)
        if self.shape.num_experts:
            egroup = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
            if dist.get_world_size(egroup) > 1:
                dist.all_reduce(experts, group=egroup)
        return float((dense + experts).sqrt())

    def finalize_grads(self) -> None:
        """bf16 path: megatron's ``finalize_model_grads`` -- the data-parallel SUM (reduce-scatter with the
        distributed optimizer: afterwards each rank's main grads are complete only on its own shard), QK-layernorm
        grads over TP, tied embeddings over PP. ``optimizer_step`` calls it; exposed for comparisons."""
        if not self.mixed:
            raise RuntimeError(
                "finalize_grads is the bf16 path's; fp32 gradients are summed as they accumulate"
            )
        from megatron.core.distributed import finalize_model_grads

        # None: never divide by token counts (docs/design/training.md#objective)
        finalize_model_grads([self.ddp], num_tokens=None)

    def current_lr(self) -> float:
        """The learning rate of the next optimizer step: constant (its scheduler runs at min_lr = lr; a megatron run
        refuses a warm-up), read by the trainer for the step's report as the torch backend's schedule is."""
        return self.cfg.lr

    def optimizer_step(self, max_grad_norm: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("this backend has no optimizer (only the core updates weights)")
        if self.mixed:
            return self._megatron_step(max_grad_norm)
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

    def _megatron_step(self, max_grad_norm: float) -> float:
        """Finalize (DP sum, partial grads), clip the global norm once, Adam on the fp32 main parameters (this
        rank's shard with the distributed optimizer, then the bf16 parameters are all-gathered), zero grads."""
        self.finalize_grads()
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            opt.config.clip_grad = max_grad_norm
        with compat.cuda_tensor_types():
            ok, norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("megatron's optimizer skipped the update (non-finite gradients)")
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return float(norm)

    def optimizer_state_numel(self) -> int:
        """Elements of optimizer state this rank holds: the main parameters the optimizer updates (fp32 shards on
        the bf16 path) and every per-parameter state tensor (Adam's two moments)."""
        total = 0
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", opt)
            for group in inner.param_groups:
                total += sum(p.numel() for p in group["params"])
            for state in inner.state.values():
                total += sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return total

    def state_dict(self) -> dict[str, Any]:
        """This rank's checkpoint. fp32: model + torch Adam. bf16: the bf16 model and this rank's optimizer shard
        (its fp32 main parameters and Adam state: with the distributed optimizer each data-parallel rank saves only
        its own part), restorable on the same layout (:meth:`load_state_dict` checks it)."""
        if self.mixed:
            shards = self._optimizer_shards()
            return {"model": self.model.state_dict(), "layout": self._layout(), "shards": shards}
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.mixed != ("shards" in state):
            raise ValueError(
                f"a {'bf16' if 'shards' in state else 'fp32'} checkpoint cannot load into a "
                f"{self.cfg.params_dtype} backend"
            )
        if self.mixed:
            if state["layout"] != self._layout():
                raise ValueError(f"checkpoint of layout {state['layout']}, this rank has {self._layout()}")
            self.model.load_state_dict(state["model"])
            self._load_optimizer_shards(state["shards"])
            return
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def _layout(self) -> dict[str, int | bool]:
        """What a bf16 checkpoint's optimizer shard depends on: the parallel sizes, this rank's place, sharding."""
        ps = parallel_state
        return {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp": self.dp_size,
            "dp_rank": self.dp_rank,
            "distributed_optimizer": self.cfg.distributed_optimizer,
            "optimizer": self.optimizer is not None,
        }

    def _inner_optimizers(self) -> list:
        """The torch optimizers inside megatron's (one per chained optimizer): their parameters are this rank's
        fp32 main parameters (a shard of them with the distributed optimizer), their state the Adam moments."""
        if self.optimizer is None:
            return []
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def _optimizer_shards(self) -> list[dict[str, Any]]:
        return [
            {
                "state": inner.state_dict(),
                "main": [[p.detach().cpu().clone() for p in g["params"]] for g in inner.param_groups],
            }
            for inner in self._inner_optimizers()
        ]

    def _load_optimizer_shards(self, shards: list[dict[str, Any]]) -> None:
        inners = self._inner_optimizers()
        if len(shards) != len(inners):
            raise ValueError(f"checkpoint has {len(shards)} optimizer shards, this rank {len(inners)}")
        for inner, shard in zip(inners, shards, strict=True):
            with torch.no_grad():
                for group, saved in zip(inner.param_groups, shard["main"], strict=True):
                    for p, v in zip(group["params"], saved, strict=True):
                        p.copy_(v.to(p.device))
            inner.load_state_dict(shard["state"])

    # --- publication -------------------------------------------------------------------------------------------

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """Current weights under HF Qwen3 names (full tensors, CPU): what rollout engines load."""
        return export_hf_weights(self.model, self.shape)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF names (the publication interface shared with the torch backend). With PP > 1 this
        stage's tensors only."""
        return self.export_hf_weights()

    def export_hf_grads(self) -> dict[str, torch.Tensor]:
        """Accumulated gradients under HF Qwen3 names (for comparisons with the torch backend; on the bf16 path
        the fp32 main grads, raw unless :meth:`finalize_grads` ran)."""
        return export_hf_weights(self.model, self.shape, grads="main_grad" if self.mixed else True)

    def save_hf_pretrained(self, out_dir: str | Path) -> None:
        """Write model.safetensors + config.json loadable by transformers / SGLang (copies the source config)."""
        write_hf_checkpoint(self.export_hf_weights(), self.cfg.model_path, out_dir)
