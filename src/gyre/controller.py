"""The controller of a real run: it owns the scheduler policy and turns its decisions into actions on real parts.

`gyre_sched`'s policy is a pure state machine (`decisions = policy.handle(event, now)`); this class is its caller in
a real run, as the simulator is in a simulated one. It reports what happened (executions launched and terminated,
assessments, groups assigned, steps, transitions, publications) and carries out what the policy decides:
launch a harness through the runner, cancel it, reroute an execution's model calls at the proxy, switch a cell's
engine out of or back into rollout, run an optimizer step, publish weights to the engines. Every event and decision
is appended to RUN/trace.jsonl with gyre_sched's trace writer, so the run can be replayed in the simulator.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable
from pathlib import Path

import orjson

from gyre.config import RunConfig
from gyre.tasks import Query
from gyre.training import LocalTraining
from gyre_cell.client import RolloutEngine
from gyre_cell.roles import CellRoleManager, DiskWeights, RoleSwitchError
from gyre_eval.service import AssessmentService
from gyre_eval.types import Submission
from gyre_sched import events as ev
from gyre_sched.policy import STANDALONE, PolicyCore
from gyre_sched.runner import ExecutionRunner
from gyre_sched.trace import TraceWriter
from gyre_sched.types import CellRole
from gyre_tito.types import Trajectory

log = logging.getLogger("gyre")

__all__ = ["Controller"]


class Controller:
    def __init__(self, cfg: RunConfig, run_dir: Path, policy: PolicyCore, trace: TraceWriter,
                 runner: ExecutionRunner, engines: list[RolloutEngine], cells: list[CellRoleManager],
                 training: LocalTraining, assessments: AssessmentService, queries: list[Query]) -> None:  # fmt: skip
        self.cfg, self.run_dir, self.policy, self.trace = cfg, run_dir, policy, trace
        self.runner, self.engines, self.training, self.assessments = runner, engines, training, assessments
        self.cells = cells
        self.queries = queries
        self.events: asyncio.Queue[ev.Event | BaseException] = asyncio.Queue()
        self.t0 = time.monotonic()
        self.groups: dict[str, tuple[Query, int]] = {}  # group -> (query, v_d)
        self.rewards: dict[str, dict[str, float]] = {}  # group -> execution -> reward
        self.published = (str(training.model_dir), 0)  # (checkpoint engines load, its policy version)
        self.tasks: set[asyncio.Task] = set()
        self.step_reports: list[dict] = []

    # ---- the loop ---------------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, steps: int, idle_timeout_s: float = 900.0) -> list[dict]:
        self._apply(0.0, self.policy.start(0.0))
        done, last_progress = 0, 0.0
        while done < steps:
            wake = self.policy.next_wakeup()
            timeout = idle_timeout_s if wake is None else max(0.0, wake - self.now())
            try:
                item = await asyncio.wait_for(self.events.get(), timeout=timeout)
            except TimeoutError as exc:
                if wake is None:
                    raise RuntimeError(
                        f"no progress for {idle_timeout_s:.0f} s; see {self.run_dir}/trace.jsonl"
                    ) from exc
                item = ev.Tick()
            if isinstance(item, BaseException):
                raise item
            t = self.now()
            self.trace.event(t, item, version=self.policy.version)
            self._apply(t, self.policy.handle(item, t))
            done += isinstance(item, ev.StepDone)  # counted once the policy (and the trace) recorded the step
            if t - last_progress >= 10.0:
                last_progress = t
                led = self.policy.ledger
                roles = "".join(r.value[0].upper() if "_" not in r.value else "~" for r in self.policy.roles)
                log.info("t=%.0fs steps %d/%d, executions running %d, queued %d, done %d; cells [%s]",
                         t, done, steps, led.running, led.queued, led.f, roles)  # fmt: skip
        return self.step_reports

    async def shutdown(self) -> None:
        self.runner.cancel_all()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[None]) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # surfaces in run(): a failed part must stop the run loudly
                self.events.put_nowait(exc)

        def finished(task: asyncio.Task) -> None:
            self.tasks.discard(task)
            if inspect.iscoroutine(coro):
                coro.close()  # a task cancelled before it started never ran its coroutine: close it quietly

        task = asyncio.create_task(guarded())
        self.tasks.add(task)
        task.add_done_callback(finished)

    def _apply(self, t: float, decisions: list[ev.Decision]) -> None:
        self.trace.decisions(t, decisions)
        reroutes = [d for d in decisions if isinstance(d, ev.Reroute)]
        moved = asyncio.gather(*(self.runner.reroute(d.execution_id, self._url(d.engine)) for d in reroutes))
        self._spawn(moved)  # transitions below wait for these routes before draining the source engine
        for d in decisions:
            match d:
                case ev.Dispatch(gid, _qid, _ids, v_d, _refill):
                    self.groups[gid] = (self.queries[len(self.groups) % len(self.queries)], v_d)
                case ev.Launch(spec):
                    self._spawn(
                        self._execute(spec.execution_id, spec.group_id, spec.dispatch_index, spec.engine)
                    )
                case ev.Cancel(eid, _reason):
                    self.runner.cancel(eid)
                case ev.BeginTransition(cell, _src, dst):
                    self._spawn(self._transition(cell, dst, moved))
                case ev.Publish(version):
                    self._spawn(self._publish(version))
                case ev.OpenBatch(version):
                    self._spawn(self._train(version))
                case ev.GroupDropped(gid):
                    self.training.drop_group(gid)
                case _:
                    pass

    def _url(self, engine: str) -> str:
        if engine == STANDALONE:
            raise RuntimeError("the local run has no standalone pool")
        return self.engines[int(engine.split(":")[1])].base_url

    # ---- executions -------------------------------------------------------------------------------------------
    async def _execute(self, eid: str, gid: str, index: int, engine: str) -> None:
        query, v_d = self.groups[gid]
        self.events.put_nowait(ev.Launched(eid))
        done = await self.runner.run(eid, gid, self._url(engine), query.prompt)
        self.events.put_nowait(ev.Terminated(eid, done.outcome))
        algo, agent = self.cfg.algorithm, self.cfg.agent
        trajectories = [
            Trajectory.model_validate(t) for t in await self.runner.export(eid, algo.j_max, algo.seed)
        ]
        submission = Submission(
            execution_id=eid, group_id=gid, group_size=algo.group_size, dispatch_index=index,
            artifact_ref=str(done.workspace), evaluator=f"task-{query.query_id}", launched_at=done.launched_at,
            budget_s=agent.overall_budget_s, outcome=done.outcome, task={"prompt": query.prompt},
        )  # fmt: skip
        if done.outcome == "cancelled":
            return  # a cancelled execution (surplus or dropped group) is not assessed
        assessment, _ = self.assessments.submit(submission)
        assessment = await self.assessments.wait(assessment.id)
        status = {"valid": "valid", "no_work": "no_work"}.get(assessment.status, "excluded")
        self.events.put_nowait(ev.Assessed(eid, status))  # before the buffer sees it: see _train
        if status == "excluded":
            return
        reward = float(assessment.score or 0.0)
        self.rewards.setdefault(gid, {})[eid] = reward
        self.training.add_execution(gid, v_d, eid, reward, trajectories if status == "valid" else [])

    # ---- cells ------------------------------------------------------------------------------------------------
    async def _transition(self, cell: int, dst: CellRole, reroutes: Awaitable) -> None:
        manager = self.cells[cell]
        if dst is CellRole.TO_TRAINING:
            await reroutes  # the cell's executions have their new routes: now its in-flight calls can move
            await self.runner.admin_call("POST", "/engines/drain", {"engine": manager.engine.base_url})
            report = await self._retry_switch(manager.to_training)
        else:
            path, version = self.published
            report = await manager.to_rollout(DiskWeights(path=path, version=str(version)))
            rollout = [e.base_url for i, e in enumerate(self.engines) if i == cell or self._serving(i)]
            await self.runner.admin_call("PUT", "/routes", {"engines": rollout})
        with (self.run_dir / "metrics" / "switches.jsonl").open("ab") as out:
            out.write(report.model_dump_json().encode() + b"\n")
        self.events.put_nowait(ev.TransitionDone(cell))

    @staticmethod
    async def _retry_switch(switch, attempts: int = 5):
        """A request that reached the engine just before it paused makes flush/release refuse: pause and retry."""
        for attempt in range(attempts):
            try:
                return await switch()
            except RoleSwitchError as exc:
                if attempt == attempts - 1:
                    raise
                log.warning("role switch retried after %s", exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def _serving(self, cell: int) -> bool:
        return self.policy.roles[cell] is CellRole.ROLLOUT

    async def _publish(self, version: int) -> None:
        path = await asyncio.to_thread(self.training.publish, version)
        self.published = (str(path), version)
        await asyncio.gather(
            *(
                e.update_weights_from_disk(str(path), weight_version=str(version))
                for i, e in enumerate(self.engines)
                if self._serving(i)
            )
        )  # cells away from rollout load the published weights when they return
        self.events.put_nowait(ev.PublishDone(version))

    # ---- training ---------------------------------------------------------------------------------------------
    async def _train(self, version: int) -> None:
        while (
            not self.training.batch_ready()
        ):  # non-streaming in the local run: the step starts with B groups
            await asyncio.sleep(0.1)
        cells = sum(r is CellRole.TRAINING for r in self.policy.roles)
        report = await asyncio.to_thread(self.training.step, cells)
        for gid in report.group_ids:
            self.events.put_nowait(ev.GroupAssigned(gid))
        for cell, count in sorted(report.microsteps_by_cell.items()):
            for k in range(count):  # claims are counted per cell by the trainer; groups listed round-robin
                self.events.put_nowait(ev.MicrostepClaimed(cell, report.group_ids[k % len(report.group_ids)]))
        rewards = [r for gid in report.group_ids for r in self.rewards.get(gid, {}).values()]
        row = orjson.loads(report.model_dump_json()) | {
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "training_cells": cells,
            "t": round(self.now(), 3),
        }
        self.step_reports.append(row)
        with (self.run_dir / "metrics" / "steps.jsonl").open("ab") as out:
            out.write(orjson.dumps(row) + b"\n")
        log.info("step %d: mean reward %.4f, loss %.5f, %d cells", report.policy_version,
                 row["mean_reward"] or 0.0, report.loss, cells)  # fmt: skip
        self.events.put_nowait(ev.StepDone(report.policy_version))
