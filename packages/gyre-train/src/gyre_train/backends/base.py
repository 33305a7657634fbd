"""The training backend protocol: what a cell's trainer needs from a model implementation (torch, Megatron-core).

A backend is **one rank's** view of one cell's model replica (for the torch backend: the whole model on one process).
The cell trainer (``gyre_train.cell``) drives it; the backend never sees batches, groups or the queue.

Per micro-step the trainer calls, for the shard of this rank (:class:`PackedTensors`, built from
``gyre_train.types.Shard``):

1. ``logprobs(batch, temperature)`` -- forward only, no grad: ``l_t = log_softmax(logits / T)[labels_t]`` as a [T]
   tensor in at least fp32 (fp64 if the model is fp64); entries at positions with ``labels == -100`` are 0. Used by
   the pre-pass that makes the execution ratios s_i exact (docs/design/training.md#objective).
2. ``forward_backward(batch, temperature, loss_fn)`` -- the same l_t with grad, then ``loss, stats = loss_fn(l_T)``
   (built by ``gyre_train.loss.make_loss_fn``) and ``loss.backward()``. The loss is already pre-scaled by the
   per-token coefficients, so gradients ACCUMULATE across calls as a plain sum into fp32 buffers (no division by
   the number of micro-steps, no data-parallel averaging). Returns the loss function's TokenStats.

Rows in a packed shard must not attend across their boundaries (position ids restart at 0 at each ``cu_seqlens``
entry); a backend may use varlen attention, a block-diagonal mask or a per-row loop, but must not pad.

Across cells (``gyre_train.multicell``) gradients and parameters move as flat tensors in one fixed order:
``flat_grads`` / ``set_flat_grads`` / ``flat_params`` / ``load_flat_params``. The core additionally owns the optimizer:
``optimizer_step(max_grad_norm)`` clips the global norm of the (already summed) gradients once and makes one Adam
update, returning the pre-clip norm. ``state_dict`` / ``load_state_dict`` cover model and optimizer for checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from gyre_train.types import IGNORE_LABEL, Shard, TokenStats


@dataclass(frozen=True, slots=True)
class PackedTensors:
    """One packed shard as torch tensors (T tokens, R rows)."""

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at 0 in each row
    cu_seqlens: torch.Tensor  # [R+1] int32
    labels: torch.Tensor  # [T] int64, IGNORE_LABEL where nothing is predicted
    temperatures: torch.Tensor | None = None  # [T] float64: sampling temperature per label (or None)

    @classmethod
    def from_shard(cls, shard: Shard) -> PackedTensors:
        temps = shard.temperatures
        return cls(
            input_ids=torch.tensor(shard.input_ids, dtype=torch.long),
            position_ids=torch.tensor(shard.position_ids(), dtype=torch.long),
            cu_seqlens=torch.tensor(shard.cu_seqlens, dtype=torch.int32),
            labels=torch.tensor(shard.labels, dtype=torch.long),
            temperatures=torch.tensor(temps, dtype=torch.float64) if temps is not None else None,
        )

    def temperature_T(self, temperature: float) -> torch.Tensor | float:
        """What position p's logits are divided by: its recorded temperature, else the micro-step's scalar."""
        return self.temperatures if self.temperatures is not None else temperature

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def label_mask(self) -> torch.Tensor:  # [T] bool
        return self.labels != IGNORE_LABEL


class LossFn(Protocol):
    def __call__(self, logprobs_T: torch.Tensor) -> tuple[torch.Tensor, TokenStats]: ...


@runtime_checkable
class TrainBackend(Protocol):
    """One rank of a cell's model replica (see the module docstring for the contract)."""

    def logprobs(self, batch: PackedTensors, temperature: float) -> torch.Tensor:
        """Forward only: l_T [T] (fp32 or fp64, no grad), 0 where labels == IGNORE_LABEL."""
        ...

    def forward_backward(self, batch: PackedTensors, temperature: float, loss_fn: LossFn) -> TokenStats:
        """Forward with grad, loss_fn(l_T), backward; gradients accumulate as a plain sum."""
        ...

    def zero_grad(self) -> None: ...

    def flat_grads(self) -> torch.Tensor:
        """All accumulated gradients as one flat tensor (params' order; zeros for params without grad)."""
        ...

    def set_flat_grads(self, flat: torch.Tensor) -> None: ...

    def flat_params(self) -> torch.Tensor: ...

    def load_flat_params(self, flat: torch.Tensor) -> None: ...

    def optimizer_step(self, max_grad_norm: float) -> float:
        """Clip the global grad norm once, one optimizer update, zero grads; returns the pre-clip norm."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model + optimizer state for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def regroup(self) -> None:
        """The default process group was replaced by a new generation of the world
        (gyre_train.multicell.reform_cell_world): re-create the process groups this backend built over the old one.
        Collective: every rank of the new world calls it at the same point (a restarted rank builds its backend
        there instead, which creates the same groups in the same order)."""
        ...
