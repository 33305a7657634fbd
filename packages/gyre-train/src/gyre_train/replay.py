"""Exactness check of a real (multi-cell) step: dump a batch as it was trained, recompute it on one cell.

The core dumps batch k when asked (``CoreRunner.step(..., dump_dir=...)`` or ``Trainer.step(..., dump_dir=...)``,
which call :func:`dump_batch` from ``Trainer.finish``). :func:`replay_batch` then loads ``params_before`` into a fresh
one-process torch backend and recomputes the whole batch as a single-cell reference: every micro-step is pre-passed
(``s_i`` recomputed from scratch, the dumped sums are dropped) and trained on that one cell. Because the objective is
a plain sum over any split (docs/design/training.md#objective), the replayed loss and gradient equal what the cells computed together, up
to float rounding (1e-6 and better in float64).

Layout of a dump directory::

    params_before.pt    flat parameters the batch was trained at (torch.save; frozen during accumulation)
    summed_grads.pt     the gradient summed over every participating cell, before clipping
    microsteps.jsonl    every train item of the batch as trained (MicroStep JSON with its final ExecutionInfo)
    report.json         the StepReport of the step
    meta.json           {"batch", "num_microsteps", "files"}, written last: a directory without it is incomplete
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import torch

from gyre_train.loss import LossConfig
from gyre_train.types import MicroStep, StepReport

_FILES = ["params_before.pt", "summed_grads.pt", "microsteps.jsonl", "report.json"]


@dataclass(frozen=True, slots=True)
class BatchDump:
    """What :func:`dump_batch` wrote."""

    params_before: torch.Tensor
    microsteps: list[MicroStep]
    summed_grads: torch.Tensor
    report: StepReport


def dump_batch(
    directory: str | Path,
    *,
    params_before: torch.Tensor,
    microsteps: Sequence[MicroStep],
    summed_grads: torch.Tensor,
    report: StepReport,
) -> Path:
    """Write one batch for :func:`replay_batch` (layout in the module docstring); returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if not microsteps:
        raise ValueError("a batch dump needs the batch's train items")
    batches = {m.batch for m in microsteps}
    if len(batches) != 1:
        raise ValueError(f"micro-steps of several batches: {sorted(batches)}")
    (out / "meta.json").unlink(missing_ok=True)
    torch.save(params_before.detach().cpu(), out / "params_before.pt")
    torch.save(summed_grads.detach().cpu(), out / "summed_grads.pt")
    with open(out / "microsteps.jsonl", "wb") as f:
        for m in sorted(microsteps, key=lambda m: m.index):
            f.write(m.model_dump_json().encode() + b"\n")
    (out / "report.json").write_bytes(report.model_dump_json().encode())
    tmp = out / "meta.json.tmp"
    tmp.write_bytes(
        orjson.dumps({"batch": batches.pop(), "num_microsteps": len(microsteps), "files": _FILES})
    )
    os.replace(tmp, out / "meta.json")
    return out


def load_dump(directory: str | Path) -> BatchDump:
    """Read a complete dump (FileNotFoundError if ``meta.json`` is missing)."""
    d = Path(directory)
    if not (d / "meta.json").exists():
        raise FileNotFoundError(f"{d} is not a complete batch dump (no meta.json)")
    microsteps = [
        MicroStep.model_validate(orjson.loads(line))
        for line in (d / "microsteps.jsonl").read_bytes().splitlines()
        if line.strip()
    ]
    return BatchDump(
        params_before=torch.load(d / "params_before.pt"),
        microsteps=microsteps,
        summed_grads=torch.load(d / "summed_grads.pt"),
        report=StepReport.model_validate(orjson.loads((d / "report.json").read_bytes())),
    )


def replay_batch(
    directory: str | Path,
    model_path: str,
    *,
    dtype: str = "float64",
    loss: LossConfig | None = None,
    temperature: float | None = None,
    backend: str = "torch",
) -> tuple[float, torch.Tensor]:
    """Recompute a dumped batch on one in-process cell from ``params_before``: (loss, flat gradient).

    ``model_path`` gives the architecture (its weights are replaced by ``params_before``); ``dtype`` the parameter
    dtype of the replay; ``loss`` the objective settings of the run (default ``LossConfig()``); ``temperature``
    overrides the micro-steps' rollout temperature (None: the one they carry); ``backend`` the backend the run
    trained with (its flat layout is the dump's: ``"megatron"`` replays on a one-process megatron backend, whose
    process groups are torn down after). Every micro-step's ``s_i`` sums are recomputed by a fresh pre-pass (the
    single-pass path is not used), then every micro-step is trained once.
    """
    from gyre_train.backends.factory import build_backend

    one = build_backend(backend, model_path=model_path, dtype=dtype, optimizer=False)
    try:
        return _replay_on(one, directory, model_path, loss or LossConfig(), temperature)
    finally:
        if backend == "megatron":
            one.close()


def _replay_on(
    backend, directory: str | Path, model_path: str, loss: LossConfig, temperature: float | None
) -> tuple[float, torch.Tensor]:
    from gyre_train.cell import CellWorker
    from gyre_train.queue import MicroStepQueue
    from gyre_train.types import PrepassResult

    dump = load_dump(directory)
    reference = backend.flat_params()
    if dump.params_before.numel() != reference.numel():
        raise ValueError(
            f"{directory}: params_before has {dump.params_before.numel()} values, {model_path} has "
            f"{reference.numel()}"
        )
    backend.load_flat_params(dump.params_before.to(reference.dtype))
    backend.zero_grad()
    worker = CellWorker(0, backend, loss)
    queue = MicroStepQueue(prepass=loss.ratio_reference == "behaviour", single_pass=False)
    queue.open(dump.microsteps[0].batch)
    for m in dump.microsteps:
        update: dict = {"executions": [e.model_copy(update={"log_ratio_sum": None}) for e in m.executions]}
        if temperature is not None:
            update["temperature"] = temperature
        queue.put(m.model_copy(update=update))
    queue.close()
    while (item := queue.claim(0)) is not None:
        result = worker.run(item)
        if isinstance(result, PrepassResult):
            queue.report_prepass(result)
        else:
            queue.report_train(result)
    if not queue.finished:
        raise RuntimeError(f"{directory}: the replay did not finish (an execution's targets are missing)")
    return float(queue.token_stats.loss), backend.flat_grads()
