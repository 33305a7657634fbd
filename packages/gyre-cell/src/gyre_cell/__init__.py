"""gyre_cell: rollout engines (a torch engine speaking SGLang's protocol, an SGLang adapter) behind one
`RolloutEngine` client interface, plus the tiny offline model used by tests and demos."""

from .client import EngineError, RolloutEngine, TorchEngineClient
from .types import FinishReason, GenerationResult, WeightVersionSpan

__all__ = [
    "EngineError",
    "FinishReason",
    "GenerationResult",
    "RolloutEngine",
    "TorchEngineClient",
    "WeightVersionSpan",
]
