"""Role switching of one cell (docs/design/cells.md): ROLLOUT -> TO_TRAINING -> TRAINING -> TO_ROLLOUT -> ROLLOUT.

The engine process and the training process both stay alive; a switch only moves memory and weights:
- to training: the caller has already rerouted the cell's traffic; abort what is still running (the proxy retries
  it elsewhere), flush the prefix cache, release every engine memory region, then let the training side restore.
- to rollout: the training side offloads, the engine gets its weight memory back, loads the current weights
  (from a checkpoint directory or an async loader such as `gyre_cell.transfer.mooncake_engine_loader`), gets its
  KV cache back and continues generating (slime's order: weights first, so KV is not resident during the load).
Each phase is timed; the report is a wire type the controller can put in its trace.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from gyre_cell.errors import IllegalRoleTransition, RoleSwitchError
from gyre_sched.types import CellRole, next_role

from .client import RolloutEngine
from .spill import SpillFile
from .switch_report import PhaseTiming, SwitchReport

WeightLoader = Callable[[RolloutEngine], Awaitable[str]]
"""Loads the current weights into the engine and returns the weight version it now serves."""


class TrainingSide(Protocol):
    """The cell's training worker as seen by the role manager."""

    async def restore(self) -> None:
        """Bring training state (parameters, gradients, optimizer) back onto the devices."""

    async def offload(self) -> None:
        """Move training state off the devices so the engine can use the memory."""


class TorchTrainingState:
    """A `TrainingSide` for a torch model and optimizer: offload really frees the memory.

    On CUDA the tensors move to host memory; on CPU (nowhere cheaper to put them) they go to one unnamed spill file
    (`gyre_cell.spill`: nothing is left on disk if the cell is killed while offloaded) and every storage is swapped
    for an empty tensor, so the engine can take the RAM.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._spill: SpillFile | None = None
        self._home: dict[str, torch.device] = {}
        self._offloaded: dict[str, tuple[object, str]] = {}
        # Offload and restore run on worker threads (a role switch, the core's final save): a restore must never
        # read the file of an offload still writing it ("header too small"), so one runs at a time.
        self._moving = threading.Lock()

    def _slots(self) -> dict[str, tuple[object, str]]:
        """Every tensor of the state as (holder, attribute or key): params, grads, optimizer state."""
        out: dict[str, tuple[object, str]] = {}
        for name, p in self.model.named_parameters():
            out[f"param/{name}"] = (p, "data")
            if p.grad is not None:
                out[f"grad/{name}"] = (p, "grad")
        if self.optimizer is not None:
            for i, state in enumerate(self.optimizer.state.values()):
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        out[f"opt/{i}/{k}"] = (state, k)
        return out

    @staticmethod
    def _get(holder: object, key: str) -> torch.Tensor:
        return holder[key] if isinstance(holder, dict) else getattr(holder, key)

    @staticmethod
    def _set(holder: object, key: str, value: torch.Tensor) -> None:
        if isinstance(holder, dict):
            holder[key] = value
        else:
            setattr(holder, key, value)

    def nbytes(self) -> int:
        """Bytes of training state resident now."""
        return sum(self._get(h, k).nbytes for h, k in self._slots().values())

    def _offload(self) -> None:
        with self._moving:
            self._offload_locked()

    def _offload_locked(self) -> None:
        if self._home:
            return
        slots = self._slots()
        tensors = {n: self._get(h, k).detach() for n, (h, k) in slots.items()}
        self._home = {n: t.device for n, t in tensors.items()}
        self._offloaded = slots
        on_cpu = all(d.type == "cpu" for d in self._home.values())
        if on_cpu:
            self._spill = SpillFile(tensors)
        for n, (h, k) in slots.items():  # params come before their grads: a grad must match its param
            t = tensors[n]
            if on_cpu and k == "grad":
                h.grad = None  # type: ignore[attr-defined]
            else:
                self._set(h, k, torch.empty(0, dtype=t.dtype) if on_cpu else t.to("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _restore(self) -> None:
        with self._moving:
            self._restore_locked()

    def _restore_locked(self) -> None:
        if not self._home:
            return
        saved = self._spill.load() if self._spill is not None else None
        for n, (h, k) in self._offloaded.items():
            src = saved[n] if saved is not None else self._get(h, k)
            self._set(h, k, src.to(self._home[n]))
        if self._spill is not None:
            self._spill.close()
        self._spill, self._home, self._offloaded = None, {}, {}

    @property
    def offloaded(self) -> bool:
        """True while the training state is off the device."""
        return bool(self._home)

    def offload_blocking(self) -> None:
        """`offload` for callers already on a worker thread."""
        self._offload()

    def restore_blocking(self) -> None:
        """`restore` for callers already on a worker thread."""
        self._restore()

    async def offload(self) -> None:
        await asyncio.to_thread(self._offload)

    async def restore(self) -> None:
        await asyncio.to_thread(self._restore)


@dataclass(frozen=True, slots=True)
class DiskWeights:
    """Current weights as a Hugging Face checkpoint directory the engine can read."""

    path: str | Path
    """Checkpoint directory (visible to the engine process)."""
    version: str
    """Weight version the engine reports after loading."""


class CellRoleManagerConfig(BaseModel):
    """Identity and memory policy of one managed cell."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cell: str = "0"
    """Cell id in reports."""
    initial_role: Literal[CellRole.ROLLOUT, CellRole.TRAINING] = CellRole.ROLLOUT
    """Role of the cell when the manager is created."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How running requests stop (abort: the proxy retries them at their new route)."""
    resume_after_load: list[str] = ["kv_cache", "cuda_graph"]
    """Engine memory resumed once the weights are loaded."""


class CellRoleManager:
    """Performs one cell's role switches against its rollout engine and training side."""

    def __init__(
        self, engine: RolloutEngine, training: TrainingSide, config: CellRoleManagerConfig | None = None
    ) -> None:
        self.engine = engine
        self.training = training
        self.config = config or CellRoleManagerConfig()
        self.role: CellRole = CellRole(self.config.initial_role)
        self._busy = False

    def _begin(self, stable: CellRole) -> CellRole:
        """Enter the transitional role after `stable` (or retry a failed switch that stopped in it)."""
        transitional = next_role(stable)
        if self._busy:
            raise IllegalRoleTransition(f"cell {self.config.cell}: a switch is already running ({self.role})")
        if self.role not in (stable, transitional):
            raise IllegalRoleTransition(
                f"cell {self.config.cell}: cannot switch {stable} -> {next_role(transitional)} from role {self.role}"
            )
        self._busy = True
        self.role = transitional
        return stable

    async def _run(self, phases: list[tuple[str, Callable[[], Awaitable[object]]]]) -> list[PhaseTiming]:
        timings = []
        try:
            for name, fn in phases:
                t0 = time.perf_counter()
                try:
                    await fn()
                except (Exception, asyncio.CancelledError) as e:
                    raise RoleSwitchError(name, e) from e
                timings.append(PhaseTiming(name=name, seconds=time.perf_counter() - t0))
        finally:
            self._busy = False
        return timings

    async def to_training(self) -> SwitchReport:
        """ROLLOUT -> TO_TRAINING -> TRAINING. Call after the controller has rerouted the cell's traffic."""
        src = self._begin(CellRole.ROLLOUT)
        t0 = time.perf_counter()
        e = self.engine
        timings = await self._run(
            [
                ("pause_generation", lambda: e.pause(mode=self.config.pause_mode)),
                ("flush_cache", e.flush_cache),
                ("release_memory", e.release_memory),
                ("restore_training", self.training.restore),
            ]
        )
        self.role = CellRole.TRAINING
        return SwitchReport(
            cell=self.config.cell,
            from_role=src,
            to_role=self.role,
            phases=timings,
            total_s=time.perf_counter() - t0,
        )

    async def to_rollout(self, weights: DiskWeights | WeightLoader) -> SwitchReport:
        """TRAINING -> TO_ROLLOUT -> ROLLOUT, loading `weights` (the current published version)."""
        src = self._begin(CellRole.TRAINING)
        t0 = time.perf_counter()
        e = self.engine
        served: list[str] = []

        async def load() -> None:
            if isinstance(weights, DiskWeights):
                await e.update_weights_from_disk(str(weights.path), weight_version=weights.version)
                served.append(weights.version)
            else:
                served.append(str(await weights(e)))

        timings = await self._run(
            [
                ("offload_training", self.training.offload),
                ("resume_weights_memory", lambda: e.resume_memory(["weights"])),
                ("load_weights", load),
                ("resume_kv_memory", lambda: e.resume_memory(list(self.config.resume_after_load))),
                ("continue_generation", e.continue_generation),
            ]
        )
        self.role = CellRole.ROLLOUT
        return SwitchReport(
            cell=self.config.cell,
            from_role=src,
            to_role=self.role,
            phases=timings,
            total_s=time.perf_counter() - t0,
            weight_version=served[0],
        )
