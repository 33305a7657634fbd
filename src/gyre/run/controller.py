"""The controller of a real run: it owns the scheduler policy and turns its decisions into actions on real processes.

`gyre_sched`'s policy is a pure state machine (`decisions = policy.handle(event, now)`); this class is its caller in a
real run, as the simulator is in a simulated one. It reports what happened and carries out what the policy decides:
launch a harness through the runner, cancel it, reroute an execution's model calls at the proxy, switch a cell worker
between rollout and training, open a batch on the core, publish weights from the core to every rollout engine.

What training does comes back from the cells as it happens: the core's event stream reports each group the stream
packing buffer takes into the open batch (`GroupAssigned`), every micro-step a cell claims (`MicrostepClaimed`) and
each finished optimizer step (`StepDone`). Each event and decision is appended to RUN/trace.jsonl when it is handled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from gyre.config import RunConfig
from gyre.run.cell_effects import CellEffects, Restart, rejoin_refused
from gyre.run.engine_routes import EngineRoutes
from gyre.tasks import Query
from gyre_cell.errors import CellCommandError
from gyre_cell.worker_client import CellWorkerClient
from gyre_cell.worker_types import PublishedWeights
from gyre_eval.client import EvalClient
from gyre_eval.groups import group_advantages
from gyre_eval.types import Submission
from gyre_sched import events as ev
from gyre_sched.ledger import CarriedGroup, ExecState
from gyre_sched.policy import STANDALONE, PolicyCore
from gyre_sched.runner import ExecutionRunner
from gyre_sched.trace import TraceWriter
from gyre_sched.types import CellRole
from gyre_train.types import ReadyGroupMessage

log = logging.getLogger("gyre")

__all__ = ["Controller", "RunFailed"]


ASSESSMENT_WAIT_S = 3600.0
"""Longest wait for one assessment (gyre-eval retries a check within the execution's own budget)."""


class RunFailed(RuntimeError):
    """A part of the run failed; the message names it."""


class Controller:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        policy: PolicyCore,
        trace: TraceWriter,
        runner: ExecutionRunner,
        cells: list[CellWorkerClient],
        standalone: list[CellWorkerClient],
        assessments: EvalClient,
        queries: list[Query],
        published: PublishedWeights,
    ) -> None:
        self.cfg, self.run_dir, self.policy, self.trace = cfg, run_dir, policy, trace
        self.runner, self.cells, self.standalone, self.assessments = runner, cells, standalone, assessments
        self.queries = queries
        self.published = published
        self.events: asyncio.Queue[ev.Event | BaseException] = asyncio.Queue()
        self.t0 = time.monotonic()
        self.groups: dict[str, tuple[Query, int]] = {}  # group -> (query, v_d)
        self.rewards: dict[str, float] = {}  # execution -> reward (valid or no_work)
        self.trajectories: dict[str, str | None] = {}  # execution -> Parquet file (None: no_work placeholder)
        self.carried: list[
            str
        ] = []  # a resumed run's groups taken over (take_over): the ready ones sent at start
        self.tasks: set[asyncio.Task] = set()
        self.step_reports: list[dict] = []
        self._standalone_rr = 0
        self.steps_done = 0
        self.target_steps = 0
        self.on_step: Callable[[dict], None] | None = None  # the run monitor: metrics, dashboard, progress
        policy.health.rejoin_refused = rejoin_refused(cfg.train)
        self.effects = CellEffects(
            cells,
            self.events.put_nowait,
            lambda: self.published,
            lambda: policy.lost,
            run_dir / "logs",
            cfg.launcher.reform_timeout_s,
        )
        self.routes = EngineRoutes(
            runner.admin_call, cells, standalone, lambda: self.policy.roles, self.effects.unreachable
        )
        self._handled = asyncio.Event()  # set (and replaced) after each event the policy took

    def enable_restarts(self, restart: Restart) -> None:
        """A lost satellite is restarted by `restart` (the launcher's), and the policy plans for it."""
        self.effects.restart = restart
        self.policy.health.restarts = True

    # ---- the loop ---------------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, steps: int, start: list[ev.Decision], idle_timeout_s: float = 900.0) -> list[dict]:
        """Run until `steps` optimizer steps are done; `start` = the decisions of `policy.start(0.0)`."""
        self.target_steps = steps
        for i, cell in enumerate(self.cells):
            self._spawn(self._pump_cell_events(i, cell), cell=i)
        await self._initial_roles()
        self._apply(self.policy.now, start)  # 0, or where a resumed run's trace left off (Async: its joins)
        if ready := [gid for gid in self.carried if gid in self.policy.ledger.ready]:
            self._spawn(self._send_groups(ready))
        last_progress = 0.0
        while self.steps_done < steps:
            item = await self._next_event(idle_timeout_s)
            t = self.now()
            self._handle(t, item)
            if t - last_progress >= 10.0:
                last_progress = t
                self._progress_line(t, self.steps_done, steps)
        return self.step_reports

    async def _next_event(self, idle_timeout_s: float) -> ev.Event:
        wake = self.policy.next_wakeup()
        timeout = idle_timeout_s if wake is None else max(0.0, wake - self.now())
        try:
            item = await asyncio.wait_for(self.events.get(), timeout=timeout)
        except TimeoutError as exc:
            if wake is None:
                raise RunFailed(
                    f"no progress for {idle_timeout_s:.0f} s; see {self.run_dir}/trace.jsonl"
                ) from exc
            return ev.Tick()
        if isinstance(item, BaseException):
            raise item
        return item

    def _handle(self, t: float, item: ev.Event) -> None:
        if not isinstance(item, ev.MicrostepClaimed):  # claims are traced with their micro-step by the pump
            self.trace.event(t, item, version=self.policy.version)
        self.steps_done += isinstance(item, ev.StepDone)
        decisions = self.policy.handle(item, t)
        if isinstance(item, ev.CellLost):
            self.effects.heard(item.cell)
            self._spawn(self.routes.put())  # the proxy stops routing to its engine; a refusal stops the run
        self._apply(t, decisions)
        handled, self._handled = self._handled, asyncio.Event()
        handled.set()

    def scheduler_state(self) -> dict:
        """The policy's own counters and staleness (the trace must recompute the same)."""
        led = self.policy.ledger
        return {
            "d": led.d,
            "p": led.p,
            "f": led.f,
            "x": led.x,
            "version": self.policy.version,
            "staleness": list(self.policy.staleness),
            "dropped": led.dropped,
            "cancelled_surplus": led.cancelled_surplus,
            "withdrawn_surplus": led.withdrawn_surplus,
            "claims_while_running": self.policy.claims_while_running,
        }

    async def _initial_roles(self) -> None:
        """Cells the policy starts in training (Async's fixed split) switch before anything is launched."""
        training = [i for i, r in enumerate(self.policy.roles) if r is CellRole.TRAINING]
        results = await asyncio.gather(*(self.cells[i].to_training() for i in training))
        with (self.run_dir / "metrics" / "switches.jsonl").open("ab") as out:
            for result in results:
                out.write(result.report.model_dump_json().encode() + b"\n")
        await self.routes.put()

    def _progress_line(self, t: float, done: int, steps: int) -> None:
        led = self.policy.ledger
        roles = "".join(r.value[0].upper() if "_" not in r.value else "~" for r in self.policy.roles)
        log.info(
            "t=%.0fs steps %d/%d, executions running %d, queued %d, done %d; cells [%s]",
            t,
            done,
            steps,
            led.running,
            led.queued,
            led.f,
            roles,
        )

    async def finish(self) -> PublishedWeights:
        """After the last step: let a publication in flight end, publish the final version, save it."""
        while self.policy.publishing:
            t = self.now()
            self._handle(t, await self._next_event(900.0))
        version = self.policy.version
        if self.published.version < version:
            await self._publish_to_engines(version)
        await self._write_kv_reroutes()
        return await self.cells[0].save(version)

    async def _write_kv_reroutes(self) -> None:
        """RUN/metrics/kv_reroutes.jsonl: one row per request or context the proxy moved at a drain, with what the
        moved execution's next call was served from (issue 17); written once, at the end of the run."""
        moved = await self.runner.admin_call("GET", "/kv/reroutes")
        with (self.run_dir / "metrics" / "kv_reroutes.jsonl").open("wb") as out:
            out.writelines(orjson.dumps(r) + b"\n" for r in moved.get("reroutes", []))

    async def shutdown(self) -> None:
        """End the run's work. The trace says what the end cut off, when it did (`run_end`): the executions still
        running (cancelled here) and those still queued (never launched). The policy's counters stay as they were
        at its last event (metrics/scheduler.json); a later `gyre run --resume` settles these in its own line."""
        execs = self.policy.ledger.execs
        self.trace.write(
            self.now(),
            "run_end",
            version=self.policy.version,
            steps=self.steps_done,
            cancelled=[e for e, x in execs.items() if x.state is ExecState.RUNNING],
            withdrawn=[e for e, x in execs.items() if x.state is ExecState.QUEUED],
        )
        self.runner.cancel_all()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[None], cell: int | None = None) -> asyncio.Task:
        """`cell`: the work talks to that cell; if it failed because the (satellite) cell died, the run goes on."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # surfaces in run(): a failed part must stop the run loudly
                if not await self.effects.absorb(cell, exc):
                    self.events.put_nowait(exc)

        def finished(task: asyncio.Task) -> None:
            self.tasks.discard(task)
            if inspect.iscoroutine(coro):
                coro.close()  # a task cancelled before it started never ran its coroutine: close it quietly

        task = asyncio.create_task(guarded())
        self.tasks.add(task)
        task.add_done_callback(finished)
        return task

    def _apply(self, t: float, decisions: list[ev.Decision]) -> None:
        self.trace.decisions(t, decisions)
        reroutes = [d for d in decisions if isinstance(d, ev.Reroute)]
        moved = asyncio.gather(*(self.runner.reroute(d.execution_id, self._url(d.engine)) for d in reroutes))
        self._spawn(moved)  # transitions below wait for these routes before draining the source engine
        for d in decisions:
            match d:
                case ev.Dispatch(gid, qid, _ids, v_d, _refill):
                    # The ledger names the dataset item (q<n>; group numbering, which a resumed run continues),
                    # so a resumed run goes on through the data where the interrupted one was, not from its start.
                    self.groups[gid] = (self.queries[int(qid.lstrip("q")) % len(self.queries)], v_d)
                case ev.Launch(spec):
                    self._spawn(
                        self._execute(spec.execution_id, spec.group_id, spec.dispatch_index, spec.engine)
                    )
                case ev.Cancel(eid, _reason):
                    self.runner.cancel(eid)
                case ev.BeginTransition(cell, _src, dst):
                    if dst is CellRole.TO_TRAINING:
                        self.routes.switching_to_training(cell)  # its engine stays listed until its drain
                    self._spawn(self._transition(cell, dst, moved), cell=cell)
                case ev.Publish(version):
                    self._spawn(self._publish(version))
                # none after the run's last step
                case ev.OpenBatch(version) if self.steps_done < self.target_steps:
                    final = self.policy.step_in_burst == self.policy.params.mu - 1
                    self._spawn(self._open_batch(version, final))
                case ev.GroupReady(gid):
                    self._spawn(self._send_group(gid))
                case ev.Join(cell):
                    self._spawn(self.cells[cell].join(), cell=cell)
                case _:
                    self._apply_health(d)

    def _apply_health(self, d: ev.Decision) -> None:
        """The cell-health machine's decisions (gyre_sched.health), carried out by `gyre.run.cell_effects`."""
        match d:
            case ev.RestartCell(cell):
                self._spawn(self.effects.restart_cell(cell))
            case ev.LoadWeights(cell, _version, after_s):
                self._spawn(self.effects.load_weights(cell, after_s, lambda i: self.routes.put(also=i)))
            case ev.CellRestored(cell, False, _):  # serves again: its event stream is read again
                self._spawn(self._pump_cell_events(cell, self.cells[cell]), cell=cell)
            case ev.CellGone(cell, reason):
                log.warning("cell %d: %s: it stays lost; later worlds leave it out", cell, reason)
            case ev.ReformWorld():
                self._spawn(self.effects.reform(d))
            case ev.RejoinRefused(cells, why):
                log.warning(
                    "restarted cell(s) %s serve rollout only: training rejoin is not done when %s",
                    list(cells),
                    why,
                )
            case ev.CompletePublish(version):
                self.events.put_nowait(ev.PublishDone(version))
            case _:
                pass

    async def _open_batch(self, version: int, final: bool) -> None:
        """The core opens the policy's batch; with the `debug.hold_core_for_join` test gate, once no restart is under
        way (so a short run surely sees a restarted cell rejoin, or one left out, before its last burst)."""
        if self.cfg.debug.hold_core_for_join is not None:
            while self.policy.health.restarting():
                await self._handled.wait()
        await self.cells[0].open_batch(version, final)

    def _url(self, engine: str) -> str:
        if engine == STANDALONE:
            if not self.standalone:
                raise RunFailed(
                    "the policy routed to a standalone pool, but the run has no standalone engines"
                )
            self._standalone_rr += 1
            return self.standalone[self._standalone_rr % len(self.standalone)].engine_url
        return self.cells[int(engine.split(":")[1])].engine_url

    # ---- executions -------------------------------------------------------------------------------------------
    async def _execute(self, eid: str, gid: str, index: int, engine: str) -> None:
        query, _v_d = self.groups[gid]
        self.events.put_nowait(ev.Launched(eid))
        launch = query.launch_options() if hasattr(query, "launch_options") else {}  # a task file's task
        done = await self.runner.run(eid, gid, self._url(engine), query.prompt, **launch)
        self.events.put_nowait(ev.Terminated(eid, done.outcome))
        if done.outcome in ("cancelled", "stalled"):
            # cancelled (surplus or dropped group): not assessed; stalled: excluded at its termination by the
            # scheduler's exclusion model, like an exhausted overall budget, so no assessment is asked for
            return
        path = await self.runner.export(eid, self.cfg.train.j_max, self.cfg.train.seed)
        agent = self.cfg.agent
        # The paper's zero-reward placeholder, not a valid zero of an untouched workspace.
        if done.no_work is not None:
            log.warning("execution %s: %s; see %s", eid, done.no_work, self.run_dir / "logs" / "agents")
        submission = Submission(
            execution_id=eid,
            group_id=gid,
            group_size=self.policy.params.N,
            dispatch_index=index,
            group_dispatched=self.policy.ledger.groups[
                gid
            ].n_d,  # a burst's own spares, a carried group's more
            artifact_ref=None if done.no_work else str(done.workspace),
            no_work_reason=done.no_work,
            evaluator=f"task-{query.query_id}",
            launched_at=done.launched_at,
            budget_s=launch.get("overall_budget_s") or agent.overall_budget_s,
            outcome=done.outcome,
            task={"prompt": query.prompt},
        )
        assessment = await self.assessments.submit(submission)  # gyre-eval, with the run's token
        assessment = await self.assessments.wait_final(assessment.id, timeout=ASSESSMENT_WAIT_S)
        status = {"valid": "valid", "no_work": "no_work"}.get(assessment.status, "excluded")
        if status != "excluded":  # recorded before the policy hears of it: a GroupReady may follow at once
            self._record(eid, assessment.score, str(path) if status == "valid" else None)
        self.events.put_nowait(ev.Assessed(eid, status))

    def _record(self, eid: str, score: float | None, trajectories: str | None) -> None:
        """A counted execution's reward (no_work scores 0) and its trajectories (None: a no_work placeholder)."""
        self.rewards[eid] = float(score or 0.0)
        self.trajectories[eid] = trajectories

    def take_over(
        self,
        carried: list[CarriedGroup],
        scores: dict[str, float | None],
        trajectories: dict[str, str | None],
    ) -> None:
        """A resumed run's carried groups (gyre.run.resume), in the policy already (ready, or open with more executions
        dispatched); their usable members' designated scores and exported trajectories as the interrupted run
        recorded them. `run` sends the ready ones to the core; an open one goes when it is ready, as any group."""
        for group in carried:
            self.groups[group.group] = (
                self.queries[int(group.query.lstrip("q")) % len(self.queries)],
                group.v_d,
            )
            for eid, status in group.members:
                if status != "excluded":
                    self._record(eid, scores[eid], trajectories[eid])
        self.carried = [group.group for group in carried]

    async def _send_groups(self, gids: list[str]) -> None:
        for gid in gids:  # in order: the core's buffer takes them oldest first
            await self._send_group(gid)

    async def _send_group(self, gid: str) -> None:
        """The ledger's N counted members (dispatch-index order), advantages computed here once, to the core."""
        members = self.policy.ledger.members(gid)
        rewards = [self.rewards[eid] for eid in members]
        advantages = group_advantages(rewards, self.cfg.train.advantage)
        executions = [
            {
                "execution_id": eid,
                "reward": r,
                "advantage": a,
                "trajectories_path": self.trajectories[eid],
                "placeholder": self.trajectories[eid] is None,
            }
            for eid, r, a in zip(members, rewards, advantages, strict=True)
        ]
        _, v_d = self.groups[gid]
        message = ReadyGroupMessage(group_id=gid, policy_version=v_d, executions=executions)
        await self.cells[0].add_group(message)

    # ---- cells --------------------------------------------------------------------------------------------------
    async def _pump_cell_events(self, index: int, cell: CellWorkerClient) -> None:
        """Forward what a cell reports, in its order, as policy events (traced with the cell's own details)."""
        after = 0
        while True:
            try:
                batch = await cell.events(after, silence_s=self.cfg.launcher.cell_silence_s)
            except Exception as exc:  # the process died or hangs: name it and its log, one line
                log_file = self.run_dir / "logs" / f"cell-{index}.log"
                raise RunFailed(
                    f"cell {index} stopped answering ({type(exc).__name__}); see {log_file}"
                ) from None
            after = batch.next
            for e in batch.events:
                f = e.fields
                match e.kind:
                    case "group_assigned":
                        self.events.put_nowait(ev.GroupAssigned(f["group_id"]))
                    case "microstep_claim":
                        groups = f["groups"]
                        self.trace.write(
                            self.now(),
                            "microstep_claim",
                            cell=f["cell"],
                            group=groups[0],
                            groups=groups,
                            batch=f["batch"],
                            index=f["index"],
                            kind=f["kind"],
                        )
                        self.events.put_nowait(ev.MicrostepClaimed(f["cell"], groups[0]))
                    case "step_end":
                        if failed := f["report"].get("collective_failed"):
                            self._collective_failed(f["report"]["step"], failed)
                        self._record_step(f["report"])
                        self.events.put_nowait(ev.StepDone(f["report"]["policy_version"]))
                    case "satellite_done":
                        if f["result"] == "burst_end":  # the policy decides whether it joins the next batch
                            self.events.put_nowait(ev.SatelliteBurstEnded(index))
                    case "error":
                        raise RunFailed(
                            f"cell {index}: {f['where']}: {f['message']}; see {self.run_dir}/logs"
                        )

    def _collective_failed(self, version: int, cells: list[int]) -> None:
        """The core's end-of-batch reduce or broadcast of batch `version` failed with `cells` (one died or hangs in
        it): the core ran their micro-steps itself and updated alone. They train again once the world is re-formed
        (the policy decides when)."""
        self.trace.write(self.now(), "collective_failed", version=version, cells=cells)
        log.warning(
            "batch %d: the end-of-batch collective with cell(s) %s failed; the core ran their micro-steps "
            "and updated alone; they train again once the world is re-formed",
            version,
            cells,
        )
        self.events.put_nowait(ev.CollectiveFailed(version, tuple(cells)))

    async def _transition(self, cell: int, dst: CellRole, reroutes: Awaitable) -> None:
        client = self.cells[cell]
        kv = None
        if dst is CellRole.TO_TRAINING:
            try:
                # the cell's executions have their new routes: now its in-flight calls can move
                await reroutes
                kv = await self.routes.drain(cell)
            finally:
                self.routes.switch_ended(cell)
            result = await self._retry_switch(client.to_training)
        else:
            result = await client.to_rollout(self.published)
            await self.routes.put(also=cell)
        row = result.report.model_dump(mode="json")
        if dst is CellRole.TO_TRAINING and kv is not None:
            row["kv_migration"] = kv  # the proxy's KV-migration totals right after this drain (issue 17)
        with (self.run_dir / "metrics" / "switches.jsonl").open("ab") as out:
            out.write(orjson.dumps(row) + b"\n")
        self.events.put_nowait(ev.TransitionDone(cell))

    @staticmethod
    async def _retry_switch(switch, attempts: int = 5):
        """A request that reached the engine just before it paused makes flush/release refuse: retry."""
        for attempt in range(attempts):
            try:
                return await switch()
            except CellCommandError as exc:
                if attempt == attempts - 1 or "409" not in str(exc):
                    raise
                log.warning("role switch retried after %s", exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def _serving(self, cell: int) -> bool:
        return self.policy.roles[cell] is CellRole.ROLLOUT

    async def _publish(self, version: int) -> None:
        await self._publish_to_engines(version)
        # the boundary: the policy may re-form the world first
        self.events.put_nowait(ev.EnginesLoaded(version))

    async def _publish_to_engines(self, version: int) -> None:
        """Core -> every rollout engine (cells in rollout and the standalone pool); cells in training load later."""
        t0 = time.perf_counter()
        ref = await self.cells[0].publish(version)
        targets = [c for i, c in enumerate(self.cells) if self._serving(i)] + self.standalone
        index = {id(c): i for i, c in enumerate(self.cells)}  # a standalone engine: no cell, never lost
        loads = await asyncio.gather(
            *(self.effects.unless_lost(index.get(id(c)), c.load_weights(ref)) for c in targets),
            return_exceptions=True,
        )
        loads = await self.effects.check(targets, loads)  # a satellite that died meanwhile: left out
        self.published = ref
        row = {
            "version": version,
            "transport": self.cfg.weights.transport,
            "core_s": round(ref.seconds, 4),
            "load_s": [round(x.seconds, 4) for x in loads],
            "engines": len(loads),
            "total_s": round(time.perf_counter() - t0, 4),
            "t": round(self.now(), 3),
        }
        with (self.run_dir / "metrics" / "publish.jsonl").open("ab") as out:
            out.write(orjson.dumps(row) + b"\n")

    # ---- training ---------------------------------------------------------------------------------------------
    def _record_step(self, report: dict) -> None:
        groups = report["group_ids"]
        rewards = [self.rewards[e] for g in groups for e in self.policy.ledger.members(g)]
        training = sum(r is CellRole.TRAINING for r in self.policy.roles)
        row = report | {
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "reward_std": statistics.pstdev(rewards) if rewards else None,
            "training_cells": training,
            "t": round(self.now(), 3),
        }
        self.step_reports.append(row)
        with (self.run_dir / "metrics" / "steps.jsonl").open("ab") as out:
            out.write(orjson.dumps(row) + b"\n")
        log.info(
            "step %d: mean reward %.4f, loss %.5f, micro-steps by cell %s",
            report["policy_version"],
            row["mean_reward"] or 0.0,
            report["loss"],
            report["microsteps_by_cell"],
        )
        if self.on_step is not None:
            self.on_step(row)
