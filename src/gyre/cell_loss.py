"""A satellite cell whose worker died mid-run: the controller goes on with the other cells.

What happens when a call to satellite cell i fails (its event stream, a role switch, a join, a weight load):
- the worker is asked for its status; if it answers, the failure was something else and the run stops as before;
- if it does not (dead, or hung: a host that lost power answers nothing, and the event stream's silence bound,
  `[launcher] cell_silence_s`, finds it), the cell is lost: the policy gets `CellLost(i)` (traced as `cell_lost`), which takes the cell out of
  every later role decision and reroutes its executions to free slots (or cancels them when there is none: never
  assessed, they are excluded, so a spare takes their place or their groups are dropped and refilled at once); the
  proxy stops routing to its engine at once, and a call that was streaming from it fails over to another engine
  inside the proxy;
- its claimed but unfinished micro-steps are requeued by gyre-train's coordinator (the control connection closed),
  which also leaves it out of every later batch's collectives: the reduce runs over the remaining members' group
  (a prefix group, or a fresh group of exactly those ranks), so the dead rank of the fixed-K gloo world is never
  contacted again. A satellite that dies or hangs inside the end-of-batch reduce or broadcast fails that collective
  (at once, or after `[train] collective_timeout_s`): the core runs the batch's satellite micro-steps itself and
  updates alone, and reports the satellites (`StepReport.collective_failed`, traced `collective_failed`); the live
  ones serve rollout from the next boundary until the world is re-formed (`collective_failed`, `rejoin_training`).

The core (cell 0) holds the optimizer: its loss still ends the run (`gyre run --resume` continues it).

A lost satellite is then restarted by the launcher (`[launcher] cell_restarts` times per cell; past that it stays
lost, one warning line): the new worker starts with `restarted` (rollout at once, no training side), the controller
waits until it is ready, loads the current published weights into its engine (the normal publication path) and checks
that it serves that version, adds it to the proxy's routes, and tells the policy `CellRestored(i)` (traced as
`cell_restored` when the policy takes it): the cell takes rollout work again. A publication that started meanwhile
makes it load again first (the policy hears of it only once it serves the published version).

Training rejoin: the fixed K-rank gloo world cannot take a new process as an old rank, so at the next burst boundary
(the policy publishes: no batch open, every satellite back in rollout) with no restart under way, the controller has
every cell re-form the world as a new generation on a fresh port (`POST /cell/reform`: the restarted cell builds its
training side in it, the core's coordinator lets it join batches again), then tells the policy
`CellRestored(i, trains=True)`: from then on the cell joins batches and claims micro-steps like any satellite. The
re-form is bounded (`[launcher] reform_timeout_s`): a cell that dies or hangs inside it is lost (and restarted), the
others give up at the rendezvous with no world, and every live satellite is rollout-only (`CellUntrained`) until
the next boundary with all K alive re-forms the world with all of them; the core trains alone meanwhile. A cell
lost for good (its restarts spent, or its restart failed) is left out of later worlds (`ReformCommand.members`: one
rank per remaining cell), so it blocks no later rejoin; a re-form waits only while a restart is under way.

Under Async the boundary is the policy's publication too (no batch is open then): the training satellites of the
split re-form from training (each worker stops its wait for the next batch around the rendezvous and starts it
again), and a restarted satellite of the split takes no rollout work while it waits, then switches back to
training (gyre_sched.policies.AsyncPolicy), so the split stays what the config says. A megatron cell (one process,
float32) re-creates megatron's groups over the new world in every cell (`TrainBackend.regroup`). Not done (the cell
stays rollout-only, one line says why): pipelined cells (PP > 1: their stages are one group) and megatron in
bfloat16 (its DDP buffers hold the world's groups).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from gyre_cell.worker_client import CellCommandError
from gyre_cell.worker_types import ReformCommand
from gyre_sched import events as ev
from gyre_sched.types import CellRole

if TYPE_CHECKING:
    from gyre.controller import Controller
    from gyre_cell.worker_client import CellWorkerClient

log = logging.getLogger("gyre")

__all__ = ["CellLosses"]

STATUS_TIMEOUT_S = 10.0
"""A worker that does not answer its status within this long after a failed call is taken as dead."""


class CellLosses:
    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self.lost: set[int] = set()
        self.restart: Callable[[int], Awaitable[CellWorkerClient | None]] | None = None
        """The launcher's `restart_cell` (None: a lost cell stays lost)."""
        self.untrained: set[int] = set()  # restored cells whose training side has not rejoined yet
        self.unformed: set[int] = set()  # live satellites of a failed collective, not untrained yet
        self.gone: set[int] = set()  # lost for good (restarts spent or failed): later worlds leave them out
        self.restarting: dict[int, asyncio.Event] = {}  # set once the restart ended (restored, or it failed)
        self.generation = 0  # of the gloo world (0: the one formed at start)
        self._refused_said = False
        self._losing: dict[int, asyncio.Event] = {}  # set when the cell is found lost (`unless_lost`)

    async def absorb(self, cell: int | None, exc: BaseException) -> bool:
        """True if `exc` came from satellite `cell` having died (then the run goes on without it)."""
        if cell is None or cell == 0 or isinstance(exc, asyncio.CancelledError):
            return False
        if cell in self.lost:
            return True
        if await self._answers(cell):
            return False
        if cell in self.lost:  # another failed call found it dead meanwhile
            return True
        self.lost.add(cell)
        self.untrained.discard(cell)
        if (losing := self._losing.pop(cell, None)) is not None:
            losing.set()  # its calls in flight give up (`unless_lost`); a restored cell's get a fresh event
        log.warning("cell %d lost (%s: %s): the run goes on with the other cells; see %s", cell,
                    type(exc).__name__, exc, self.c.run_dir / "logs" / f"cell-{cell}.log")  # fmt: skip
        self.c.events.put_nowait(ev.CellLost(cell))
        try:
            await self.c.routes.put()
        except Exception as routes_failed:  # the proxy refused: that stops the run, as any failed part does
            self.c.events.put_nowait(routes_failed)
        if self.restart is not None:
            self.restarting[cell] = asyncio.Event()
            self.c._spawn(self._restore(cell))
        else:
            self.gone.add(cell)
        return True

    async def unless_lost[T](self, cell: int | None, call: Awaitable[T]) -> T:
        """`call` to satellite `cell`, given up once the cell is found lost meanwhile: a dead host's port, or one a
        stranger listens on, may never answer, and a publication must not wait on it for the client's timeout
        (stop 32's CI: a load to a killed cell whose port was taken held the publication for good). Raises
        `CellCommandError` then, which `check` absorbs as the loss it is."""
        if cell is None or cell == 0:
            return await call
        task = asyncio.ensure_future(call)
        if cell not in self.lost:
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

    async def open_batch(self, version: int, final: bool) -> None:
        """The core opens the policy's batch; with the `debug.hold_core_for_join` test gate, once every restart
        under way ended (so a short run surely sees a restarted cell rejoin, or one left out, before its last
        burst)."""
        if self.c.cfg.debug.hold_core_for_join is not None:
            while pending := [e for e in self.restarting.values() if not e.is_set()]:
                await pending[0].wait()
        await self.c.cells[0].open_batch(version, final)

    async def _restore(self, cell: int) -> None:
        """Restart the dead worker, then load the current weights (the policy hears of it once they are served)."""
        try:
            if await self.restart(cell) is None:
                self._gone(cell)
                return  # its restarts are spent (the launcher said so)
            await self._load_current(cell)
        except Exception as exc:  # the run goes on without it
            log.warning("cell %d: restart failed (%s: %s): it stays lost", cell, type(exc).__name__, exc)
            self._gone(cell)

    def _gone(self, cell: int) -> None:
        self.gone.add(cell)
        self.restarting[cell].set()

    async def _load_current(self, cell: int, attempts: int = 3) -> None:
        """Load the published weights into the restored cell. The core refreshes its weight buffer in place while
        it publishes: a pull then finds a newer version than the one asked for and the load fails (a clean-clone
        CI run here: "pulled weight version 4, expected 2", and the cell stayed lost). So the load waits out a
        publication under way, and a failed load is tried again (at most `attempts` in all): the core's buffer can
        hold the next version before the controller hears of its publication (a clean-clone CI run: the cell pulled
        version 4 where it asked for 2 while the controller still published 2, and it stayed lost), so a retry
        first waits out the publication that moved on, or a short back-off when none is seen yet."""
        client = self.c.cells[cell]
        for attempt in range(attempts):
            while self.c.policy.publishing:  # the policy's publication ends with PublishDone
                await asyncio.sleep(0.1)
            ref = self.c.published
            try:
                await client.load_weights(ref)
                break
            except CellCommandError as exc:
                if attempt == attempts - 1:
                    raise
                moved = self.c.policy.publishing or self.c.published.version != ref.version
                log.info("cell %d: loading version %d failed (%s; a publication %s): it loads again",
                         cell, ref.version, exc, "moved on" if moved else "may be starting")  # fmt: skip
                if not moved:
                    await asyncio.sleep(1.0 * (attempt + 1))
        served = (await client.status()).weight_version
        if served != str(ref.version):
            raise RuntimeError(
                f"the restarted engine serves version {served}, not the published {ref.version}"
            )
        await self.c.routes.put(also=cell)
        self.c.events.put_nowait(ev.CellRestored(cell, version=ref.version))

    def restored(self, event: ev.CellRestored) -> bool:
        """Called by the controller before the policy takes `event`: True if the cell serves the published version
        now; else (a publication started or ended meanwhile) it loads again and False."""
        cell = event.cell
        if event.trains:  # its training side rejoined (rejoin_training): it serves already
            return True
        if self.c.policy.publishing or event.version != self.c.published.version:
            self.c._spawn(self._reload(cell))
            return False
        self.lost.discard(cell)  # a later death is handled again (within the restart budget)
        self.untrained.add(cell)
        self.restarting[cell].set()
        self.c._spawn(self.c._pump_cell_events(cell, self.c.cells[cell]), cell=cell)
        return True

    async def _reload(self, cell: int) -> None:
        while self.c.policy.publishing:  # the policy's publication ends with PublishDone
            await asyncio.sleep(0.1)
        try:
            await self._load_current(cell)
        except Exception as exc:
            log.warning("cell %d: restart failed (%s: %s): it stays lost", cell, type(exc).__name__, exc)
            self._gone(cell)

    async def check(self, targets: Sequence, results: Sequence) -> list:
        """Results of one call per target (gather with return_exceptions): a dead satellite's failure is absorbed,
        any other failure is raised; returns the successful results."""
        ok = []
        for target, result in zip(targets, results, strict=True):
            if not isinstance(result, BaseException):
                ok.append(result)
                continue
            cell = next((i for i, c in enumerate(self.c.cells) if c is target), None)
            if not await self.absorb(cell, result):
                raise result
        return ok

    async def _reform_failed(self, members: list[int], results: Sequence) -> None:
        """A cell died or hung inside the re-form: the others gave up at the bounded rendezvous and hold no world
        (the old one is destroyed). The dead one is lost (and restarted, within its budget); every live satellite
        becomes rollout-only (`CellUntrained`) until the next boundary with all K alive re-forms the world with
        all of them rejoining. The core trains alone meanwhile (a batch of one cell needs no collective)."""
        for i, result in zip(members, results, strict=True):
            if not isinstance(result, BaseException) or await self.absorb(i, result):
                continue  # formed, or the cell is dead (lost now)
            if "not formed" not in str(result):  # anything but the bounded rendezvous stops the run
                raise result
        untrained = [i for i in range(1, len(self.c.cells)) if i not in self.lost and i not in self.untrained]
        log.warning("gloo world generation %d not formed (%s); satellite(s) %s serve rollout only until the next "
                    "re-form", self.generation, "; ".join(str(r) for r in results if isinstance(r, BaseException)),
                    untrained)  # fmt: skip
        for cell in untrained:
            self.untrained.add(cell)
            self.c.events.put_nowait(ev.CellUntrained(cell))

    def collective_failed(self, version: int, cells: list[int]) -> None:
        """The core's end-of-batch reduce or broadcast of batch `version` failed with `cells` (one died or hangs in
        it): the core ran their micro-steps itself and updated alone, and its world with them is broken. They may
        still be in training (mid-burst: their joins wait); at the next boundary they become rollout-only and the
        world is re-formed, at once or after a restart under way (`rejoin_training`)."""
        self.c.trace.write(self.c.now(), "collective_failed", version=version, cells=cells)
        log.warning("batch %d: the end-of-batch collective with cell(s) %s failed; the core ran their micro-steps "
                    "and updated alone; they train again once the world is re-formed", version, cells)  # fmt: skip
        self.unformed.update(c for c in cells if c not in self.lost)

    def _untrain_unformed(self) -> None:
        """At a boundary: the satellites of a failed collective become rollout-only until the next re-form."""
        for cell in sorted(self.unformed):
            if cell in self.lost or cell in self.untrained:
                continue  # lost meanwhile: its restart rejoins it
            if self.c.policy.roles[cell] is not CellRole.ROLLOUT and self.c.policy.kind != "async":
                return  # still switching: the next boundary
            self.untrained.add(cell)
            self.c.events.put_nowait(ev.CellUntrained(cell))
        self.unformed.clear()

    async def _answers(self, cell: int) -> bool:
        try:
            await asyncio.wait_for(self.c.cells[cell].status(), timeout=STATUS_TIMEOUT_S)
        except Exception:
            return False
        return True

    def _rejoin_refused(self) -> str | None:
        t = self.c.cfg.train
        # A megatron cell of one process in float32 re-creates its groups in the new world (MegatronBackend.regroup);
        # a pipelined cell's stages, or megatron's DDP buffers (bfloat16), keep the groups they were built with.
        if t.backend == "megatron" and (t.pipeline_parallel > 1 or t.dtype != "float32"):
            return f"the megatron backend (PP={t.pipeline_parallel}, {t.dtype}) builds its groups over the gloo world"
        return None

    async def rejoin_training(self) -> None:
        """At a burst boundary (called while the policy publishes): restored cells take their training rank again."""
        self._untrain_unformed()
        if not self.untrained or self.lost - self.gone:  # nothing to do, or a restart is still under way
            return
        if (why := self._rejoin_refused()) is not None:
            if not self._refused_said:
                self._refused_said = True
                log.warning("restarted cell(s) %s serve rollout only: training rejoin is not done when %s",
                            sorted(self.untrained), why)  # fmt: skip
            return
        members = [i for i in range(len(self.c.cells)) if i not in self.gone]  # the gone are left out
        roles = self.c.policy.roles
        # No batch is open while the policy publishes: a satellite in training (Async's split) waits for the next
        # one and re-forms like the others (its worker stops and restarts its wait around the rendezvous).
        if any(roles[i] not in (CellRole.ROLLOUT, CellRole.TRAINING) for i in members[1:]):
            return  # a satellite still switches: not a boundary for every cell
        rejoining = sorted(self.untrained)
        self.generation += 1
        # The core picks the port: it hosts the rendezvous, and the controller may run on another machine.
        port = await self.c.cells[0].rendezvous_port()
        command = ReformCommand(
            generation=self.generation, master_port=port, rejoining=rejoining,
            rendezvous_timeout_s=self.c.cfg.launcher.reform_timeout_s,
            members=members if self.gone else None,
        )  # fmt: skip
        t0 = self.c.now()
        # A hung cell (its HTTP call never answers) is bounded too: it gets the rendezvous time and a margin.
        bound = command.rendezvous_timeout_s + STATUS_TIMEOUT_S
        results = await asyncio.gather(
            *(asyncio.wait_for(self.c.cells[i].reform(command), bound) for i in members),
            return_exceptions=True,
        )
        if any(isinstance(r, BaseException) for r in results):
            await self._reform_failed(members, results)
            return
        log.info("gloo world generation %d formed with cell(s) %s rejoining in %.1f s", self.generation,
                 rejoining, self.c.now() - t0)  # fmt: skip
        if self.gone:  # the run trains on fewer cells from now on: an operator should see it
            log.warning("gloo world generation %d: cell(s) %s left out (lost for good); %d cell(s) train",
                        self.generation, sorted(self.gone), len(members))  # fmt: skip
        self.untrained.clear()
        for cell in rejoining:
            self.c.events.put_nowait(ev.CellRestored(cell, trains=True, version=self.c.published.version))
