"""`gyre run --resume RUN`: continue a run whose controller was stopped or killed, from its last step checkpoint.

What is restored, and from where:
- the resolved config: RUN/config.json, as the interrupted run wrote it (only `train.steps` may be raised, with
  `--steps`; RUN/config.json then says so);
- the trainer: the newest complete RUN/checkpoints/trainer/step-V (weights, optimizer state, version V; written by
  the core after each step and before the step is reported, see gyre_cell.step_checkpoint). Every cell and engine
  starts from its HF policy, so rollouts resume at version V too;
- the scheduler: a fresh policy at version V (published), numbering its groups after the last one the trace
  dispatched, so no group, execution, record or assessment id is reused. The interrupted part's finished work is
  kept: every group that no step up to V trained and that has a usable execution (a designated valid or no_work
  assessment in gyre-eval's store and, if valid, the trajectories the proxy exported to RUN/trajectories) is
  carried over, so hours of rollout are not thrown away with the controller. Its other executions are excluded:
  those that were running are cancelled (their harnesses died with the controller), queued ones withdrawn, and a
  finished one whose assessment was still running (gyre-eval finishes it after its restart, too late to count). A
  carried group whose first N non-excluded executions are usable is held READY at its own dispatch version and
  sent to the core first; one that still lacks members stays OPEN, and the resumed run dispatches the executions
  it lacks into it (numbered after the old ones, launched first, at version V; the group keeps its old v_d, so
  its staleness is that of its oldest members; each member's behaviour log-probs are its own). A group with no
  usable execution is dropped. The trace's `resume` line lists all of it (`cancelled`, `withdrawn`,
  `dropped_groups`, `carried_groups`, and `carried_members`: each carried group's old executions with the status the
  resumed run gives them), a carried open group's new executions get a `dispatch` line with
  `carried: true`, and recomputation counts it. Nothing is trained twice: a carried group was trained by no step
  <= V, and the trainer's buffer holds only what the resumed run sends it;
- the proxy's call records and gyre-eval's assessments: their stores under RUN are reopened as they are (append
  only: the interrupted part's files are not touched);
- trace.jsonl, metrics/*.jsonl: appended to. The resumed controller's clock continues from the trace's last time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from gyre.config import ConfigError, RunConfig, load_config
from gyre_cell.worker_types import CellWorkerConfig
from gyre_eval.store import AssessmentStore
from gyre_sched.ledger import CarriedGroup
from gyre_sched.policy import PolicyCore
from gyre_sched.runner import exported_trajectories
from gyre_sched.trace import TraceWriter, summarize_trace

__all__ = ["ResumeError", "ResumePoint", "find_resume_point"]

USABLE = ("valid", "no_work")


class ResumeError(ValueError):
    """The run directory cannot be resumed; the message says why."""


@dataclass
class ResumePoint:
    run_dir: Path
    cfg: RunConfig
    checkpoint: Path  # RUN/checkpoints/trainer/step-V
    version: int
    next_group: int
    cancelled: list[str] = field(default_factory=list)  # launched, not terminated when the controller stopped
    withdrawn: list[str] = field(default_factory=list)  # dispatched, never launched
    # dispatched, not consumed by a step <= V, not carried
    dropped_groups: list[str] = field(default_factory=list)
    # not consumed by a step <= V, with a usable execution: ready or completed, then trained
    carried: list[CarriedGroup] = field(default_factory=list)
    # usable executions' designated scores
    carried_scores: dict[str, float | None] = field(default_factory=dict)
    carried_paths: dict[str, str | None] = field(default_factory=dict)  # their trajectories (None: no_work)
    t_end: float = 0.0  # the trace's last time
    # StepReports <= V the killed controller never traced
    untraced_steps: list[dict] = field(default_factory=list)
    before: dict = field(default_factory=dict)  # d, p, f, x of the interrupted part (settled), from the trace

    # ---- what the pipeline calls ---------------------------------------------------------------------------
    @property
    def model_dir(self) -> Path:
        """The policy of version V: every cell and engine of the resumed run loads it."""
        return self.checkpoint / "hf"

    def cell_configs(self, configs: list[CellWorkerConfig]) -> list[CellWorkerConfig]:
        """The core restores its optimizer state from the checkpoint; every engine serves version V."""
        out = []
        for wc in configs:
            engine = wc.engine.model_copy(update={"weight_version": str(self.version)})
            update: dict = {"engine": engine}
            if wc.sglang is not None:
                update["sglang"] = wc.sglang.model_copy(update={"weight_version": str(self.version)})
            if wc.vllm is not None:
                update["vllm"] = wc.vllm.model_copy(update={"weight_version": str(self.version)})
            if wc.training is not None and wc.cell == 0:
                update["training"] = wc.training.model_copy(update={"resume_from": str(self.checkpoint)})
            out.append(wc.model_copy(update=update))
        return out

    def policy(self, policy: PolicyCore) -> PolicyCore:
        policy.resume_at(self.version, self.next_group, self.carried)
        return policy

    def carry_into(self, controller) -> None:
        """The carried groups' usable rewards and trajectories to the controller, which sends each group to the core
        when it is ready (the ready ones at the start)."""
        controller.take_over(self.carried, self.carried_scores, self.carried_paths)

    def trace(self, roles: list[str]) -> TraceWriter:
        """trace.jsonl continued (unbuffered, as a new run's), with the `resume` line settling the old part."""
        path = self.run_dir / "trace.jsonl"
        data = path.read_bytes()
        keep = data[: data.rfind(b"\n") + 1]  # a line torn by the kill is cut off before appending
        if len(keep) != len(data):
            with path.open("r+b") as f:
                f.truncate(len(keep))
        writer = TraceWriter.append_to(path.open("ab", buffering=0))
        for report in self.untraced_steps:  # done and checkpointed, killed before the policy heard of it
            writer.write(
                self.t_end,
                "step_end",
                version=report["policy_version"],
                groups=report["group_ids"],
                staleness=report["staleness"],
                recorded_on_resume=True,
            )
        writer.write(
            self.t_end,
            "resume",
            version=self.version,
            checkpoint=str(self.checkpoint),
            cancelled=self.cancelled,
            withdrawn=self.withdrawn,
            dropped_groups=self.dropped_groups,
            carried_groups=[g.group for g in self.carried],
            next_group=self.next_group,
            carried_members={g.group: [list(m) for m in g.members] for g in self.carried},
            roles=roles,
        )
        return writer

    def continue_clock(self, controller) -> None:
        """The controller's clock goes on from the trace's last time; its step count from V."""
        controller.t0 -= self.t_end
        controller.steps_done = self.version

    def scheduler_state(self, state: dict) -> dict:
        """The whole run's counters: the interrupted part's (settled) plus the resumed policy's own."""
        return (
            state
            | {k: self.before[k] + state[k] for k in ("d", "p", "f", "x")}
            | {"resumed_at": self.version}
        )


def _read_trace(path: Path) -> list[dict]:
    lines = []
    for raw in path.read_bytes().split(b"\n"):
        try:
            lines.append(orjson.loads(raw))
        except orjson.JSONDecodeError:
            continue  # empty, or the line the kill tore
    return lines


def find_resume_point(run_dir: Path, steps: int | None = None) -> ResumePoint:
    """Everything a resumed run needs from RUN; ResumeError (one line) when it cannot be resumed."""
    run_dir = run_dir.resolve()
    if not (run_dir / "config.json").exists() or not (run_dir / "trace.jsonl").exists():
        raise ResumeError(f"{run_dir} holds no run to resume (config.json and trace.jsonl are needed)")
    overrides = {"run_dir": str(run_dir)} | ({"train.steps": steps} if steps is not None else {})
    try:
        cfg = load_config(run_dir / "config.json", overrides)
    except ConfigError as exc:
        raise ResumeError(f"{run_dir}/config.json: {exc}") from None
    # imported here: it imports torch, which a plain run's controller starts without
    from gyre_cell.step_checkpoint import latest_step_checkpoint

    checkpoint = latest_step_checkpoint(run_dir / "checkpoints" / "trainer")
    if checkpoint is None:
        raise ResumeError(
            f"{run_dir} has no step checkpoint (checkpoints/trainer/step-V with hf/); nothing to resume from "
            "(train.checkpoint_keep = 0, or no step finished)"
        )
    version = int(checkpoint.name.split("-")[1])
    if version >= cfg.train.steps:
        raise ResumeError(
            f"{run_dir} already finished its {cfg.train.steps} steps (checkpoint at step {version})"
        )
    lines = _read_trace(run_dir / "trace.jsonl")
    if not lines or lines[0].get("ev") != "header":
        raise ResumeError(f"{run_dir}/trace.jsonl does not start with a header")
    if steps is not None:  # the run's resolved config says how far it goes now (a later resume reads it)
        partial = run_dir / "config.json.partial"
        partial.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
        partial.replace(run_dir / "config.json")
    point = ResumePoint(run_dir, cfg, checkpoint, version, next_group=0, t_end=float(lines[-1]["t"]))
    groups: dict[str, list[str]] = {}
    dispatches: dict[str, dict] = {}
    launched, ended, withdrawn, consumed, traced = set(), set(), set(), set(), set()
    statuses: dict[str, str] = {}
    for obj in lines:
        match obj["ev"]:
            case "dispatch":  # a group carried open by an earlier resume has a second dispatch line
                groups.setdefault(obj["group"], []).extend(obj["executions"])
                dispatches.setdefault(obj["group"], obj)
                point.next_group = max(point.next_group, int(obj["group"].lstrip("g")) + 1)
            case "assessed":
                statuses[obj["execution"]] = obj["status"]
            case "launch":
                launched.add(obj["execution"])
            case "terminate":
                ended.add(obj["execution"])
            case "withdraw":
                withdrawn.add(obj["execution"])
            case "step_end" if int(obj["version"]) <= version:
                consumed.update(obj["groups"])
                traced.add(int(obj["version"]))
            case "resume":  # an earlier resume settled these already
                ended.update(obj["cancelled"])
                withdrawn.update(obj["withdrawn"])
                consumed.update(obj.get("dropped_groups", []))
                for members in obj.get("carried_members", {}).values():  # its excluded ones stay excluded
                    statuses.update((e, "excluded") for e, status in members if status == "excluded")
    reports = _step_reports(point)
    for v, report in sorted(reports.items()):
        consumed.update(report["group_ids"])
        if v not in traced:
            point.untraced_steps.append(report)
    store = AssessmentStore(run_dir) if set(groups) - consumed else None
    try:
        for gid, execs in groups.items():
            cancelled = [e for e in execs if e in launched and e not in ended]
            pulled = [e for e in execs if e not in launched and e not in withdrawn]
            point.cancelled += cancelled
            point.withdrawn += pulled
            if gid in consumed:
                continue
            # Settled by this resume: never a member, whatever the store holds.
            for eid in (*cancelled, *pulled):
                statuses[eid] = "excluded"
            carried = _carry(point, store, dispatches[gid], execs, statuses)
            if carried is None:
                point.dropped_groups.append(gid)
            else:
                point.carried.append(carried)
    finally:
        if store is not None:
            store.close()
    roles = lines[0].get("initial_roles") or ["rollout"] * int(lines[0]["K"])  # any: only counters are read
    settle = {
        "t": point.t_end,
        "ev": "resume",
        "cancelled": point.cancelled,
        "withdrawn": point.withdrawn,
        "roles": roles,
    }
    settled = summarize_trace([*lines, settle])
    point.before = {"d": settled.d, "p": settled.p, "f": settled.f, "x": settled.x}
    return point


def _carry(
    point: ResumePoint, store: AssessmentStore, dispatch: dict, execs: list[str], statuses: dict[str, str]
) -> CarriedGroup | None:
    """An untrained group as the resumed run takes it over (``Ledger.carry`` makes it ready or open), or None when
    none of its executions is usable. Usable: a designated valid or no_work assessment in gyre-eval's store (one
    that landed after the trace's last line counts too) and, for a valid one, the exported trajectories. Every
    other execution (excluded, cancelled or withdrawn by the kill, a part missing) is excluded."""
    members: list[tuple[str, str]] = []
    for eid in execs:
        status = "excluded"
        if statuses.get(eid, "valid") != "excluded":
            designated = [a for a in store.list(execution_id=eid, designated=True) if a.status in USABLE]
            path = exported_trajectories(point.run_dir, eid)
            if designated and (designated[-1].status == "no_work" or path.is_file()):
                status = designated[-1].status
                point.carried_scores[eid] = designated[-1].score
                point.carried_paths[eid] = str(path) if status == "valid" else None
        members.append((eid, status))
    if all(status == "excluded" for _, status in members):
        return None
    return CarriedGroup(dispatch["group"], dispatch["query"], int(dispatch["v_d"]), tuple(members))


def _step_reports(point: ResumePoint) -> dict[int, dict]:
    """StepReports of versions <= V: steps.jsonl, plus the checkpoint's own when the controller never recorded it
    (appended to steps.jsonl now, so the step versions there stay contiguous)."""
    steps = point.run_dir / "metrics" / "steps.jsonl"
    rows, offset = [], 0
    for line in steps.read_bytes().splitlines(keepends=True) if steps.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:  # the line the kill tore: cut off before appending
            with steps.open("r+b") as f:
                f.truncate(offset)
            break
        offset += len(line)
    reports = {r["policy_version"]: r for r in rows if r["policy_version"] <= point.version}
    if point.version not in reports:
        report = json.loads((point.checkpoint / "report.json").read_text()) | {"recorded_on_resume": True}
        with steps.open("a") as out:
            out.write(json.dumps(report) + "\n")
        reports[point.version] = report
    return reports
