"""The GSPO objective's settings (``gyre_train.loss``), in a module without torch: run configs embed them
(gyre.config), and reading a config must not load torch. ``gyre_train.loss`` re-exports ``LossConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["LossConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LossConfig:
    """Settings of the GSPO objective (docs/design/training.md#objective defaults)."""

    eps_low: float = 0.005
    """Lower clip bound 1 - eps_low on s_i for A_i < 0."""
    eps_high: float = 0.005
    """Upper clip bound 1 + eps_high on s_i for A_i > 0."""
    weight_cap: float = 5.0
    """C: cap on the token importance weight rho_t."""
    cap_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: w = min(rho, C); mask: w = rho * [rho <= C]."""
    ratio_reference: Literal["behaviour", "proximal"] = "behaviour"
    """Reference of the ratios: the engine's behaviour log-probs (default) or the recomputed current weights."""

    def __post_init__(self) -> None:
        if self.eps_low < 0 or self.eps_high < 0:
            raise ValueError("eps_low and eps_high must be >= 0")
        if self.weight_cap <= 0:
            raise ValueError("weight_cap must be > 0")
        if self.cap_mode not in ("truncate", "mask"):
            raise ValueError(f"cap_mode must be 'truncate' or 'mask', got {self.cap_mode!r}")
        if self.ratio_reference not in ("behaviour", "proximal"):
            raise ValueError(
                f"ratio_reference must be 'behaviour' or 'proximal', got {self.ratio_reference!r}"
            )
