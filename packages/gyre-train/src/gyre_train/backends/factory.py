"""Choosing a training backend by name: ``build_backend("torch" | "megatron", ...)``.

The torch backend loads any local Hugging Face causal LM in one process. The Megatron backend
(``gyre_train.megatron``, extra ``gyre-train[megatron]``) builds a megatron-core GPTModel from a local Qwen3 /
Qwen3-MoE checkpoint with TP/PP/CP/EP; it joins the ``torch.distributed`` process group that exists (for example the
cells' gloo world of a multi-cell run: build it after that rendezvous, every cell at the same point, because
megatron's group creation is collective) or creates a one-process one.

``check_backend`` validates a choice without importing megatron (configs call it to refuse a bad combination with a
one-line error naming the fields).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # base imports torch; configs import this module for check_backend and must not load it
    from gyre_train.backends.base import TrainBackend

__all__ = ["BACKENDS", "build_backend", "check_backend"]

BackendKind = Literal["torch", "megatron"]
BACKENDS: tuple[str, ...] = ("torch", "megatron")


def check_backend(
    kind: str,
    *,
    dtype: str = "float32",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    lr_warmup_steps: int = 0,
    one_process_cells: bool = False,
    prefix: str = "",
) -> None:
    """Raise ``ValueError`` (naming the fields, with ``prefix`` such as ``"train."``) if the combination cannot run.

    ``one_process_cells``: the cells are ``gyre run``'s cell workers: megatron then runs in fp32 with one process
    per TP rank and pipeline stage (the worker and its rank processes, ``gyre_train.megatron.cell``), CP and EP 1
    (its bf16 path reduces gradients over the data-parallel group, which would span the cells).
    """
    sizes = {
        "tensor_parallel": tensor_parallel,
        "pipeline_parallel": pipeline_parallel,
        "context_parallel": context_parallel,
        "expert_parallel": expert_parallel,
    }
    if kind not in BACKENDS:
        raise ValueError(f"{prefix}backend must be one of {list(BACKENDS)}, not {kind!r}")
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
        raise ValueError(f"{', '.join(prefix + k for k in bad)} must be >= 1 (got {bad})")
    multi = {k: v for k, v in sizes.items() if v > 1}
    if kind == "torch" and multi:
        raise ValueError(
            f"{prefix}backend = 'torch' runs one process per cell: {', '.join(prefix + k for k in multi)} "
            f"must be 1 (got {multi}); use {prefix}backend = 'megatron'"
        )
    if lr_warmup_steps < 0:
        raise ValueError(f"{prefix}lr_warmup_steps must be >= 0 (got {lr_warmup_steps})")
    if kind == "megatron":
        if lr_warmup_steps:
            raise ValueError(
                f"{prefix}lr_warmup_steps = {lr_warmup_steps}: the megatron backend has no lr schedule yet "
                f"(use 0, or {prefix}backend = 'torch')"
            )
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"{prefix}backend = 'megatron' trains in float32 or bfloat16, not {prefix}dtype = {dtype!r}"
            )
        inner = {k: v for k, v in multi.items() if k not in ("tensor_parallel", "pipeline_parallel")}
        if one_process_cells and inner:
            raise ValueError(
                f"{prefix}backend = 'megatron' in cell workers: {', '.join(prefix + k for k in inner)} must be 1 "
                f"(got {inner}); a cell's ranks there are its TP ranks and pipeline stages only (tensor_parallel, "
                "pipeline_parallel), other layouts run under torchrun (gyre_train.megatron.pipeline)"
            )
        if one_process_cells and dtype == "bfloat16":
            raise ValueError(
                f"{prefix}backend = 'megatron' in cell workers trains in float32: {prefix}dtype = "
                "'bfloat16' needs megatron's data-parallel groups inside a cell (torchrun)"
            )
        if context_parallel > 1 and dtype != "bfloat16":
            raise ValueError(f"{prefix}context_parallel > 1 needs {prefix}dtype = 'bfloat16' (megatron DDP)")


def build_backend(
    kind: str,
    *,
    model_path: str,
    dtype: str = "float32",
    lr: float = 1e-6,
    lr_warmup_steps: int = 0,
    optimizer: bool = True,
    device: str = "cpu",
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    expert_parallel: int = 1,
) -> TrainBackend:
    """A training backend: ``"torch"`` (``TorchBackend`` on ``device``) or ``"megatron"`` (``MegatronBackend``;
    its device follows CUDA availability). ``optimizer``: build the optimizer (only the core cell updates).
    ``lr_warmup_steps``: linear lr warm-up (the torch backend; ``check_backend`` refuses it for megatron)."""
    check_backend(
        kind,
        dtype=dtype,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
        expert_parallel=expert_parallel,
        lr_warmup_steps=lr_warmup_steps,
    )
    if kind == "torch":
        from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig

        return TorchBackend(
            TorchBackendConfig(
                model_path=model_path,
                dtype=dtype,
                device=device,
                lr=lr,
                optimizer=optimizer,
                lr_warmup_steps=lr_warmup_steps,
            )
        )
    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig, ParallelConfig

    parallel = ParallelConfig(
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        context_parallel=context_parallel,
        expert_parallel=expert_parallel,
    )
    return MegatronBackend(
        MegatronBackendConfig(
            model_path=model_path, parallel=parallel, params_dtype=dtype, lr=lr, optimizer=optimizer
        )
    )
