"""The torch rollout engine: paged KV cache, continuous batching, SGLang's HTTP protocol subset."""

from .config import EngineConfig
from .core import TorchEngine
from .request import EngineInputError, EngineStateError, SamplingSpec

__all__ = ["EngineConfig", "EngineInputError", "EngineStateError", "SamplingSpec", "TorchEngine"]
