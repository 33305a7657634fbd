"""What the run does for a satellite cell that died or hung: the effects of the cell-health machine's decisions.

The decisions are the policy's (`gyre_sched.health`, driven by the controller's events like every other policy
decision, and by the simulator in `gyre_sched.faults`); this module only carries them out on real processes and
reports what happened. It keeps no health state: which cells are down is the policy's (`down()`); the one thing held
here is plumbing, the cells found dead whose loss the policy has not heard yet (so a second failed call to the same
cell neither asks its status again nor reports it twice) and the calls in flight to them, which give up.

- Finding a loss (`absorb`): a call to satellite i failed (its event stream, a role switch, a join, a weight load).
  The worker is asked for its status; if it answers, the failure was something else and the run stops as before. If
  not (dead, or hung: a host that lost power answers nothing, and the event stream's silence bound,
  `[launcher] cell_silence_s`, finds it), the policy gets `CellLost(i)`: its executions are rerouted or cancelled,
  the proxy stops routing to its engine, and gyre-train's coordinator requeues its claimed micro-steps and leaves it
  out of later collectives (the control connection closed). The core (cell 0) holds the optimizer: its loss still
  ends the run (`gyre run --resume` continues it).
- `RestartCell`: the launcher starts the worker again (`[launcher] cell_restarts` times per cell) with `restarted`
  set (rollout at once, no training side); reported `CellRestarted`, or `CellRestartFailed` (spent, or it failed).
- `LoadWeights`: the published weights go into the restarted engine by the normal publication path; its served
  version is checked and it is added to the proxy's routes; reported `WeightsLoaded` or `WeightsLoadFailed`. A
  publication under way makes the policy load again after it (the core refreshes its buffer in place).
- `ReformWorld`: every member re-forms the fixed-K gloo world as a new generation on a fresh port the core picks
  (`POST /cell/reform`), bounded by `[launcher] reform_timeout_s`; a member that dies or hangs in it is reported lost
  first, then `WorldFailed`; else `WorldFormed`. A megatron cell (one process, float32) re-creates its groups over
  the new world (`TrainBackend.regroup`); pipelined cells and megatron in bfloat16 cannot, so restored cells serve
  rollout only there (`rejoin_refused`, one line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from gyre.config import TrainConfig
from gyre_cell.errors import CellCommandError
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import PublishedWeights, ReformCommand
from gyre_sched import events as ev

log = logging.getLogger("gyre")

__all__ = ["CellEffects", "rejoin_refused"]

STATUS_TIMEOUT_S = 10.0
"""A worker that does not answer its status within this long after a failed call is taken as dead."""

Restart = Callable[[int], Awaitable[CellWorkerClient | None]]


def rejoin_refused(train: TrainConfig) -> str | None:
    """Why restored cells of this run cannot take a training rank again, or None."""
    # A megatron cell of one process in float32 re-creates its groups in the new world (MegatronBackend.regroup); a
    # pipelined cell's stages, or megatron's DDP buffers (bfloat16), keep the groups they were built with.
    if train.backend == "megatron" and (train.pipeline_parallel > 1 or train.dtype != "float32"):
        return f"the megatron backend (PP={train.pipeline_parallel}, {train.dtype}) builds its groups over the gloo world"
    return None


class CellEffects:
    """`cells`: the run's cell clients (the launcher replaces a restarted one in place); `report`: an event for the
    policy; `published()`: the weights the engines serve now; `down()`: the cells the policy holds down."""

    def __init__(
        self,
        cells: Sequence[CellWorkerClient],
        report: Callable[[ev.Event | BaseException], None],
        published: Callable[[], PublishedWeights],
        down: Callable[[], set[int]],
        logs: Path,
        reform_timeout_s: float,
    ) -> None:
        self.cells, self.report, self.published, self.down = cells, report, published, down
        self.logs, self.reform_timeout_s = logs, reform_timeout_s
        self.restart: Restart | None = None
        """The launcher's `restart_cell` (None: a lost cell stays lost)."""
        self._found: set[int] = set()  # found dead, the policy not told yet (`heard`)
        self._losing: dict[int, asyncio.Event] = {}  # set when the cell is found dead (`unless_lost`)

    def unreachable(self) -> set[int]:
        """Cells down, or found dead and about to be."""
        return self.down() | self._found

    # ---- finding a loss -----------------------------------------------------------------------------------------
    async def absorb(self, cell: int | None, exc: BaseException) -> bool:
        """True if `exc` came from satellite `cell` having died (then the run goes on without it)."""
        if cell is None or cell == 0 or isinstance(exc, asyncio.CancelledError):
            return False
        if cell in self.unreachable():
            return True
        if await self._answers(cell):
            return False
        if cell in self.unreachable():  # another failed call found it dead meanwhile
            return True
        self._found.add(cell)
        if (losing := self._losing.pop(cell, None)) is not None:
            losing.set()  # its calls in flight give up (`unless_lost`); a restored cell's get a fresh event
        log.warning(
            "cell %d lost (%s: %s): the run goes on with the other cells; see %s",
            cell,
            type(exc).__name__,
            exc,
            self.logs / f"cell-{cell}.log",
        )
        self.report(ev.CellLost(cell))
        return True

    def heard(self, cell: int) -> None:
        """The policy took `CellLost(cell)`: it is down in the policy's view from now on."""
        self._found.discard(cell)

    async def _answers(self, cell: int) -> bool:
        try:
            await asyncio.wait_for(self.cells[cell].status(), timeout=STATUS_TIMEOUT_S)
        except Exception:
            return False
        return True

    async def unless_lost[T](self, cell: int | None, call: Awaitable[T]) -> T:
        """`call` to satellite `cell`, given up once the cell is found dead meanwhile: a dead host's port, or one a
        stranger listens on, may never answer, and a publication must not wait on it for the client's timeout
        (stop 32's CI: a load to a killed cell whose port was taken held the publication for good). Raises
        `CellCommandError` then, which `check` absorbs as the loss it is."""
        if cell is None or cell == 0:
            return await call
        task = asyncio.ensure_future(call)
        if cell not in self.unreachable():
            losing = self._losing.setdefault(cell, asyncio.Event())
            waiter = asyncio.ensure_future(losing.wait())
            try:
                await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise CellCommandError(f"cell {cell} was lost while the call was under way")

    async def check(self, targets: Sequence, results: Sequence) -> list:
        """Results of one call per target (gather with return_exceptions): a dead satellite's failure is absorbed,
        any other failure is raised; returns the successful results."""
        ok = []
        for target, result in zip(targets, results, strict=True):
            if not isinstance(result, BaseException):
                ok.append(result)
                continue
            cell = next((i for i, c in enumerate(self.cells) if c is target), None)
            if not await self.absorb(cell, result):
                raise result
        return ok

    # ---- the policy's decisions ---------------------------------------------------------------------------------
    async def restart_cell(self, cell: int) -> None:
        if self.restart is None:
            self.report(ev.CellRestartFailed(cell, "this launcher cannot restart a cell"))
            return
        try:
            client = await self.restart(cell)
        except Exception as exc:  # the run goes on without it
            self.report(ev.CellRestartFailed(cell, f"restart failed ({type(exc).__name__}: {exc})"))
            return
        if client is None:  # the launcher said so in its own line
            self.report(ev.CellRestartFailed(cell, "its restarts are spent"))
            return
        self.report(ev.CellRestarted(cell))

    async def load_weights(
        self, cell: int, after_s: float, routes_put: Callable[[int], Awaitable[None]]
    ) -> None:
        """Load the weights published now into the restarted cell; its routes once it serves them."""
        if after_s > 0:  # a back-off the policy chose: the failed load's cause may not be heard of yet
            await asyncio.sleep(after_s)
        ref, client = self.published(), self.cells[cell]
        try:
            await client.load_weights(ref)
            served = (await client.status()).weight_version
        except Exception as exc:
            log.info(
                "cell %d: loading version %d failed (%s: %s)", cell, ref.version, type(exc).__name__, exc
            )
            self.report(ev.WeightsLoadFailed(cell, ref.version, f"{type(exc).__name__}: {exc}"))
            return
        if served != str(ref.version):
            self.report(ev.WeightsLoadFailed(cell, ref.version, f"the engine serves version {served}"))
            return
        await routes_put(cell)
        self.report(ev.WeightsLoaded(cell, ref.version))

    async def reform(self, command: ev.ReformWorld) -> None:
        """Re-form the gloo world; a member that dies or hangs in it is reported lost before `WorldFailed`."""
        members = list(command.members) if command.members is not None else list(range(len(self.cells)))
        # The core picks the port: it hosts the rendezvous, and the controller may run on another machine.
        port = await self.cells[0].rendezvous_port()
        wire = ReformCommand(
            generation=command.generation,
            master_port=port,
            rejoining=list(command.rejoining),
            rendezvous_timeout_s=self.reform_timeout_s,
            members=list(command.members) if command.members is not None else None,
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        # A hung cell (its HTTP call never answers) is bounded too: it gets the rendezvous time and a margin.
        bound = wire.rendezvous_timeout_s + STATUS_TIMEOUT_S
        results = await asyncio.gather(
            *(asyncio.wait_for(self.cells[i].reform(wire), bound) for i in members), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        for i, result in zip(members, results, strict=True):
            if not isinstance(result, BaseException) or await self.absorb(i, result):
                continue  # formed, or the cell is dead (lost now)
            if "not formed" not in str(result):  # anything but the bounded rendezvous stops the run
                raise result
        if failures:
            log.warning(
                "gloo world generation %d not formed (%s); live satellites serve rollout only until the "
                "next re-form",
                command.generation,
                "; ".join(map(str, failures)),
            )
            self.report(ev.WorldFailed(command.generation, str(failures[0])[:300]))
            return
        log.info(
            "gloo world generation %d formed with cell(s) %s rejoining in %.1f s",
            command.generation,
            list(command.rejoining),
            loop.time() - t0,
        )
        # the run trains on fewer cells from now on: an operator should see it
        if command.members is not None:
            gone = sorted(set(range(len(self.cells))) - set(members))
            log.warning(
                "gloo world generation %d: cell(s) %s left out (lost for good); %d cell(s) train",
                command.generation,
                gone,
                len(members),
            )
        self.report(ev.WorldFormed(command.generation))
