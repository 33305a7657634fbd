"""Torch backend: a Hugging Face causal LM loaded from a local path, trained on packed rows without padding.

Packed rows go through the model as one sequence of T tokens with position ids restarting at 0 in each row and no
attention mask: transformers then builds a block-diagonal causal mask from the position ids (``masking_utils.
find_packed_sequence_indices``), so rows never attend across boundaries (a test checks packed == per-row).
Log-probs are taken in at least fp32 (fp64 models stay fp64) at the positions that predict a label. The model runs
in eval mode (no dropout) so the pre-pass and the train pass compute identical l_t. Gradients accumulate in
``param.grad`` across micro-steps (plain sum). The optimizer (Adam) exists only where ``optimizer`` is true (the core).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gyre_train.backends.base import LossFn, PackedTensors
from gyre_train.types import IGNORE_LABEL, TokenStats

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchBackendConfig:
    """Settings of the torch backend."""

    model_path: str
    """Local Hugging Face checkpoint directory (never downloaded)."""
    dtype: str = "float32"
    """Parameter dtype: float32, float64 (tests) or bfloat16."""
    device: str = "cpu"
    """Torch device."""
    optimizer: bool = True
    """Build the Adam optimizer (only the core needs one)."""
    lr: float = 1e-6
    """Adam learning rate (after the warm-up)."""
    lr_warmup_steps: int = 0
    """Linear warm-up: optimizer step k (1-based) uses ``lr * min(1, k / lr_warmup_steps)``; 0: constant ``lr``.
    Counted from the optimizer's own step count, so a restored optimizer state continues the schedule."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Weight decay (0 by default; Adam and AdamW coincide then)."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel (sdpa and eager both honour packed position ids)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")


class TorchBackend:
    """One process = one cell (data-parallel size 1); implements ``gyre_train.backends.base.TrainBackend``."""

    def __init__(self, cfg: TorchBackendConfig) -> None:
        # transformers' modeling takes seconds to import: paid by the process that loads a model, not by every
        # importer of this module (the launcher, the tests' collection).
        from gyre_train.hf_import import import_transformers

        import_transformers()  # without its scan of the installed files
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            cfg.model_path, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation
        ).to(self.device)
        self.model.eval()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = (
            torch.optim.Adam(
                self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
            )
            if cfg.optimizer
            else None
        )
        self.logprob_dtype = torch.promote_types(DTYPES[cfg.dtype], torch.float32)

    # --- per micro-step --------------------------------------------------------------------------------------

    def _logprobs(self, batch: PackedTensors, temperature: float) -> torch.Tensor:
        ids_T = batch.input_ids.to(self.device)
        pos_T = batch.position_ids.to(self.device)
        labels_T = batch.labels.to(self.device)
        keep_K = torch.nonzero(labels_T != IGNORE_LABEL).squeeze(-1)  # positions that predict a label
        out = self.model(
            input_ids=ids_T[None], position_ids=pos_T[None], use_cache=False, logits_to_keep=keep_K
        )
        temp = batch.temperature_T(temperature)  # per position when the shard carries recorded temperatures
        if isinstance(temp, torch.Tensor):
            temp = temp.to(self.device, self.logprob_dtype)[keep_K, None]
        logits_KV = out.logits[0].to(self.logprob_dtype) / temp
        lp_K = torch.log_softmax(logits_KV, dim=-1).gather(-1, labels_T[keep_K, None]).squeeze(-1)
        l_T = torch.zeros(ids_T.shape[0], dtype=self.logprob_dtype, device=self.device)
        return l_T.index_put((keep_K,), lp_K)

    def logprobs(self, batch: PackedTensors, temperature: float) -> torch.Tensor:
        with torch.no_grad():
            return self._logprobs(batch, temperature).cpu()

    def forward_backward(self, batch: PackedTensors, temperature: float, loss_fn: LossFn) -> TokenStats:
        l_T = self._logprobs(batch, temperature)
        loss, stats = loss_fn(l_T.cpu() if self.device.type != "cpu" else l_T)
        loss.backward()
        return stats

    # --- gradients, parameters, optimizer --------------------------------------------------------------------

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def flat_grads(self) -> torch.Tensor:
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
        ).detach()

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype).clone()
            offset += n
        if offset != flat.numel():
            raise ValueError(f"flat gradient has {flat.numel()} entries, the model has {offset}")

    def flat_params(self) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(self.params).detach().clone()

    def load_flat_params(self, flat: torch.Tensor) -> None:
        """The parameters become views of `flat` when its dtype and device are theirs (no copy: a satellite's
        snapshot load then lands straight in its parameters, `SnapshotChannel.load`); a converted copy otherwise."""
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat.to(self.device, self.params[0].dtype), self.params)

    def optimizer_step(self, max_grad_norm: float) -> float:
        if self.optimizer is None:
            raise RuntimeError("this backend has no optimizer (only the core updates weights)")
        for p in self.params:  # params that saw no target still take a (zero-gradient) Adam step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        self.optimizer.step()
        self.zero_grad()
        return float(norm)

    def current_lr(self) -> float:
        """The learning rate of the next optimizer step (the warm-up schedule over the steps taken so far)."""
        warmup = self.cfg.lr_warmup_steps
        if not warmup:
            return self.cfg.lr
        state = self.optimizer.state.get(self.params[0], {}) if self.optimizer is not None else {}
        taken = int(state["step"]) if "step" in state else 0
        return self.cfg.lr * min(1.0, (taken + 1) / warmup)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def regroup(self) -> None:
        """Nothing to do: this backend builds no process group (the cells' collectives run on gyre_train.multicell's
        groups, which the re-form itself rebuilds)."""

    # --- publication (the same two calls on every backend) ---------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names: what rollout engines load."""
        return self.model.state_dict()

    def save_hf_pretrained(self, out_dir: str) -> None:
        """A checkpoint transformers and SGLang load (``save_pretrained``)."""
        self.model.save_pretrained(out_dir)
