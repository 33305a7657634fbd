"""Settings of the Megatron backend (:class:`MegatronBackendConfig`), apart from the backend that builds from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gyre_train.megatron.model import ParallelConfig

__all__ = ["MegatronBackendConfig"]


@dataclass(frozen=True, kw_only=True)
class MegatronBackendConfig:
    """Settings of the Megatron backend."""

    model_path: str
    """Local Hugging Face Qwen3 checkpoint directory (config.json + safetensors)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP/PP/CP/EP layout inside the cell and the layer spec."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype. float32: gradients in ``.grad``, ``torch.optim.Adam`` (exact comparisons). bfloat16: megatron
    DDP with fp32 main grads and megatron's optimizer with fp32 main parameters (module docstring)."""
    distributed_optimizer: bool = True
    """bfloat16 only: shard the optimizer state (fp32 main params, Adam moments) over the data-parallel ranks."""
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
