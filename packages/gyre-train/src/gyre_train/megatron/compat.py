"""CPU compatibility layer for megatron-core 0.19 (the only place Gyre works around CUDA assumptions).

megatron-core builds and runs a GPTModel on CPU except for four CUDA assumptions (platform.md, "megatron-core on
CPU"): the rotary embedding moves ``inv_freq`` to ``torch.cuda.current_device()``, the RNG tracker saves and
restores CUDA RNG state, the no-pipelining schedule allocates its token counter with ``device="cuda"``, and with
SGLang installed ``attention.py`` imports ``flash_mla``, whose CUDA library raises ``OSError`` (not ImportError)
on a CPU machine.

``apply()`` fixes them without touching ``torch`` itself: each affected megatron module gets its module-level
``torch`` name rebound to a proxy that forwards everything to the real ``torch`` except ``torch.cuda``'s device
and RNG functions and the ``device="cuda"`` argument of tensor factories. Code outside those modules (the torch
backend, tests, other packages in the same process) sees the unmodified ``torch``. ``apply()`` is idempotent and
does nothing on a machine with CUDA; ``revert()`` undoes it (for tests). One more assumption sits in a Tensor method
(``weight.data.cuda()`` when GPTModel ties embeddings across pipeline stages); ``building_model()`` covers it for
the duration of model construction only.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "PATCHED_MODULES",
    "apply",
    "building_model",
    "cuda_tensor_types",
    "is_applied",
    "needed",
    "revert",
]

# The megatron modules whose module-level ``torch`` is replaced (found by running forward/backward on CPU).
PATCHED_MODULES = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.tensor_parallel.random",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.utils",
    # bf16 training: DDP's fp32 main-grad buffers and the distributed optimizer (buffers on current_device(),
    # current_stream() before the grad reduce-scatter, the clip's `device='cuda'` overflow buffer).
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    # MoE: the alltoall dispatcher's device-to-host stream, the router's buffers on current_device(), the
    # expert-parallel gathers and all-to-alls (tensor_parallel.mappings allocates on current_device()).
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.moe_layer",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "arange", "tensor")
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spec ("cuda", "cuda:0", 0, torch.device("cuda")) to CPU; keep others."""
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron sees it on CPU: the current device is the CPU, RNG state is the CPU RNG."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU work is synchronous (the pipeline's p2p code synchronizes the CUDA stream)."""

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CpuStream()

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _CpuStream:  # the name of torch.cuda.Stream
        return _CpuStream()

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def empty_cache() -> None:
        """No CUDA caching allocator on CPU."""

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return False

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> _CpuEvent:  # the name of torch.cuda.Event
        return _CpuEvent()


class _CpuStream:
    """A stream on CPU: work is synchronous, so waiting is a no-op."""

    def wait_stream(self, other: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def synchronize(self) -> None: ...

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()


class _CpuEvent:
    """An event on CPU: everything before it has already happened."""

    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


class _CpuTorch(types.ModuleType):
    """``torch`` with ``cuda`` replaced and tensor factories taking ``device="cuda"`` to CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        self.originals: dict[tuple[str, str], Any] = {}  # (module, name) -> the function apply() replaced
        for name in _FACTORIES:
            setattr(self, name, self._factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _factory(fn: Any) -> Any:
        def on_cpu(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return on_cpu


def needed() -> bool:
    """True on a machine without CUDA (the only place the layer is applied)."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    mod = sys.modules.get(PATCHED_MODULES[0])
    return mod is not None and isinstance(getattr(mod, "torch", None), _CpuTorch)


def _hide_flash_mla() -> None:
    # ``None`` in sys.modules makes ``import flash_mla`` raise ImportError, which megatron handles as "absent".
    if "flash_mla" not in sys.modules and importlib.util.find_spec("flash_mla") is not None:
        sys.modules["flash_mla"] = None  # type: ignore[assignment]


def apply(force: bool = False) -> bool:
    """Patch megatron-core for CPU. Returns True if the layer is active. Call before building a model.

    ``force`` applies it even where CUDA exists (tests of CPU behaviour on a GPU machine).
    """
    if not (needed() or force):
        return False
    if is_applied():
        return True
    _hide_flash_mla()
    cpu_torch = _CpuTorch()
    for name in PATCHED_MODULES:
        mod = importlib.import_module(name)
        mod.torch = cpu_torch  # type: ignore[attr-defined]
    # The originals are kept on the proxy (not in a module global) so revert() can restore them.
    replaced = {
        # The tracker's save/restore helpers call CUDA generator internals directly; route them to the CPU RNG.
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): _get_cpu_rng_state,
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): _set_cpu_rng_state,
        # The MoE all-to-all takes its split sizes as numpy arrays made by a device-to-host copy that only
        # happens for CUDA tensors; on CPU they would stay tensors, which all_to_all_single refuses.
        (_DISPATCHER, "maybe_move_tensor_to_cpu"): _splits_to_host,
    }
    for (mod_name, name), fn in replaced.items():
        mod = sys.modules[mod_name]
        cpu_torch.originals[(mod_name, name)] = getattr(mod, name)
        setattr(mod, name, fn)
    return True


def _splits_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for CPU tensors: the host copy is the tensor itself (numpy if
    asked)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().numpy()
    return tensor


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def building_model() -> Iterator[None]:
    """Wrap GPTModel construction: with PP > 1 and tied embeddings its constructor moves the last stage's copy of
    the embedding with the Tensor method ``.cuda()`` (not reachable through a module's ``torch``), so while the
    layer is applied ``Tensor.cuda`` returns the tensor itself for the duration of the block only."""
    if not is_applied():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


@contextlib.contextmanager
def cuda_tensor_types() -> Iterator[None]:
    """Wrap the construction and the steps of megatron's optimizers: they check parameter types with the Tensor
    method ``type()`` against ``'torch.cuda.BFloat16Tensor'`` / ``'torch.cuda.FloatTensor'`` (not reachable
    through a module's ``torch``). While the layer is applied, a CPU tensor's no-argument ``type()`` answers with
    the CUDA name for the duration of the block only; ``type(dtype)`` conversions are untouched."""
    if not is_applied():
        yield
        return
    original = torch.Tensor.type

    def cuda_named_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or self.device.type != "cpu":
            return original(self, *args, **kwargs)
        return original(self).replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def revert() -> None:
    """Undo ``apply()`` (the flash_mla marker stays: megatron's attention module already imported without it)."""
    if not is_applied():
        return
    random_mod = sys.modules["megatron.core.tensor_parallel.random"]
    for (mod_name, name), fn in random_mod.torch.originals.items():
        setattr(sys.modules[mod_name], name, fn)
    for name in PATCHED_MODULES:
        sys.modules[name].torch = torch  # type: ignore[attr-defined]
