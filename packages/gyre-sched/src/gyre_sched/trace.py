"""trace.jsonl (docs/design/architecture.md#run-directory-and-trace): the public writer both the real controller and the simulator use, a reader, and the
recomputation of counters, staleness, roles, waterlevel and capacity from the trace alone."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from gyre_sched.config import PolicyParams
from gyre_sched.events import (
    AssessmentRecorded,
    BeginTransition,
    BurstPlanned,
    CellLost,
    CellRestored,
    CellUntrained,
    Decision,
    Dispatch,
    EndTransition,
    Event,
    GroupAssigned,
    GroupDropped,
    GroupReady,
    Launch,
    MicrostepClaimed,
    OpenBatch,
    Publish,
    PublishDone,
    Reroute,
    StepRecorded,
    Terminated,
    Withdraw,
)
from gyre_sched.types import TRACE_REQUIRED, CellRole, TraceLine


def policy_header(params: PolicyParams) -> dict[str, Any]:
    """Every policy parameter, for a trace header: what ``gyre-sched predict`` needs to rerun the same policy.
    ``TraceWriter(stream, {**policy_header(params), ...})`` (the real controller adds its own context)."""
    return {
        "K": params.K,
        "C_e": params.C_e,
        "C_s": params.C_s,
        "N": params.N,
        "B": params.B,
        "phi": params.phi,
        "mu": params.mu,
        "N_d": params.N_d,
        "policy": params.kind,
        "rho_min": params.rho_min,
        "tau_s": params.tau_s,
        "k_spare": params.k_spare,
        "streaming": params.streaming,
        "dispatch": params.dispatch,
        "q_c": params.q_c,
        "async_train_cells": params.async_train_cells,
        "harness_timeout_s": params.harness_timeout_s,
        "overall_budget_s": params.overall_budget_s,
        "spares": params.spares,
        "planner": params.planner,
        "target_staleness": params.target_staleness,
        "mu_max": params.mu_max,
        "launch_order": params.launch_order,
    }


class TraceWriter:
    """Appends trace lines to a binary stream: ``{"t": ..., "ev": ..., ...}``. The first line is the header."""

    def __init__(self, stream: IO[bytes], header: dict[str, Any]) -> None:
        missing = [k for k in TRACE_REQUIRED["header"] if k not in header]
        if missing:
            raise ValueError(f"trace header lacks {missing}")
        self._out = stream
        self.lines = 0
        self.write(0.0, "header", schema_version=1, **header)

    @classmethod
    def append_to(cls, stream: IO[bytes]) -> TraceWriter:
        """Continue an existing trace (a resumed run): no second header; the caller writes a ``resume`` line."""
        writer = cls.__new__(cls)
        writer._out, writer.lines = stream, 0
        return writer

    @classmethod
    def open(cls, path: str | Path, header: dict[str, Any]) -> TraceWriter:
        return cls(Path(path).open("wb"), header)

    def close(self) -> None:
        self._out.close()

    def write(self, t: float, ev: str, **fields: Any) -> None:
        self._out.write(orjson.dumps({"t": round(t, 6), "ev": ev, **fields}) + b"\n")
        self.lines += 1

    def event(self, t: float, event: Event, *, version: int | None = None) -> None:
        """Trace an event reported to the controller (only those that carry trace information)."""
        match event:
            case Terminated(eid, outcome):
                self.write(t, "terminate", execution=eid, outcome=outcome)
            case GroupAssigned(gid):
                self.write(t, "group_assign", group=gid, version=version)
            case MicrostepClaimed(cell, gid):
                self.write(t, "microstep_claim", cell=cell, group=gid)
            case PublishDone(v):
                self.write(t, "publish", version=v)
            case CellLost(cell):
                self.write(t, "cell_lost", cell=cell)
            case _:
                pass

    def decisions(self, t: float, decisions: Iterable[Decision]) -> None:
        for d in decisions:
            match d:
                case Dispatch(gid, qid, ids, v_d, refill, carried):
                    # a resumed run's further executions of the group
                    more = {"carried": True} if carried else {}
                    self.write(
                        t,
                        "dispatch",
                        group=gid,
                        query=qid,
                        executions=list(ids),
                        v_d=v_d,
                        refill=refill,
                        **more,
                    )
                case Launch(spec):
                    self.write(
                        t, "launch", execution=spec.execution_id, group=spec.group_id, engine=spec.engine
                    )
                case Withdraw(eid, reason):
                    self.write(t, "withdraw", execution=eid, reason=reason)
                case Reroute(eid, engine):
                    self.write(t, "route", execution=eid, engine=engine)
                case BeginTransition(cell, a, b):
                    self.write(t, "transition_begin", cell=cell, **{"from": a.value, "to": b.value})
                case EndTransition(cell, a, b):
                    self.write(t, "transition_end", cell=cell, **{"from": a.value, "to": b.value})
                case Publish(v):
                    self.write(t, "publish_begin", version=v)
                case OpenBatch(v):
                    self.write(t, "batch_open", version=v)
                case GroupReady(gid):
                    self.write(t, "group_ready", group=gid)
                case GroupDropped(gid):
                    self.write(t, "group_dropped", group=gid)
                case CellRestored(cell, trains, served):  # the cell-health machine's findings
                    self.write(t, "cell_restored", cell=cell, trains=trains, serves=served)
                case CellUntrained(cell):
                    self.write(t, "cell_untrained", cell=cell)
                case AssessmentRecorded(eid, status):
                    self.write(t, "assessed", execution=eid, status=status)
                case BurstPlanned(v, mu, n, k):
                    self.write(t, "burst_plan", version=v, mu=mu, dispatch=n, k_spare=k)
                case StepRecorded(v, groups, st):
                    self.write(t, "step_end", version=v, groups=list(groups), staleness=list(st))
                case _:  # Cancel: the runner's terminate(cancelled) line records it
                    pass


def iter_trace(path: str | Path, *, validate: bool = True) -> Iterator[dict[str, Any]]:
    """Yield trace lines as dicts; ``validate`` checks each against TraceLine (ValueError names the line)."""
    with Path(path).open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
                if validate:
                    TraceLine.model_validate(obj)
            except (orjson.JSONDecodeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: bad trace line: {e}") from e
            yield obj


@dataclass
class TraceSummary:
    """Everything recomputed from a trace alone."""

    header: dict[str, Any]
    d: int = 0
    p: int = 0
    f: int = 0
    x: int = 0
    steps: int = 0
    end_time_s: float = 0.0
    staleness: list[int] = field(default_factory=list)
    staleness_refill: list[bool] = field(default_factory=list)
    step_versions: list[int] = field(default_factory=list)  # version of the step that consumed each group
    roles: list[list[tuple[float, float, str]]] = field(default_factory=list)  # per cell: (start, end, role)
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, w, capacity, running)
    cut_off_at_end: list[str] = field(default_factory=list)  # executions the run's end cancelled (run_end)
    publishes: list[tuple[float, int]] = field(default_factory=list)

    def mean_staleness(self, *, warmup_bursts: int = 0, include_refills: bool = True) -> float:
        mu = int(self.header["mu"])
        vals = [
            s
            for s, v, r in zip(self.staleness, self.step_versions, self.staleness_refill, strict=True)
            if v > warmup_bursts * mu and (include_refills or not r)
        ]
        return sum(vals) / len(vals) if vals else float("nan")

    def role_share(self) -> dict[str, float]:
        total = {r.value: 0.0 for r in CellRole}
        for spans in self.roles:
            for a, b, role in spans:
                total[role] += b - a
        if not total[CellRole.LOST.value]:
            del total[CellRole.LOST.value]  # only runs that lost a cell report it
        span = sum(total.values())
        return {k: (v / span if span else 0.0) for k, v in total.items()}


def summarize_trace(lines: Iterable[dict[str, Any]]) -> TraceSummary:
    """Recompute counters, staleness, the role timeline and waterlevel/capacity from trace lines."""
    it = iter(lines)
    header = next(it)
    if header.get("ev") != "header":
        raise ValueError("trace must start with a header line")
    K, C_e, C_s = int(header["K"]), int(header["C_e"]), int(header["C_s"])
    s = TraceSummary(header=header)
    init = header.get("initial_roles") or [CellRole.ROLLOUT.value] * K
    role = list(init)
    since = [0.0] * K
    s.roles = [[] for _ in range(K)]
    refill: dict[str, bool] = {}
    t = 0.0

    def snap() -> None:
        k = sum(r != CellRole.ROLLOUT.value for r in role)
        s.timeline.append((t, s.d - s.x - s.f, (K - k) * C_e + C_s, s.p - s.f))

    for obj in it:
        t, ev = float(obj["t"]), obj["ev"]
        if ev == "dispatch":
            s.d += len(obj["executions"])
            refill[obj["group"]] = bool(obj.get("refill", False))
        elif ev == "launch":
            s.p += 1
        elif ev == "terminate":
            s.f += 1
        elif ev == "withdraw":
            s.x += 1
        elif ev in ("transition_begin", "transition_end"):
            c = int(obj["cell"])
            if role[c] != obj["from"]:
                raise ValueError(f"t={t}: cell {c} is {role[c]}, trace says {obj['from']}")
            s.roles[c].append((since[c], t, role[c]))
            role[c], since[c] = obj["to"], t
        elif ev == "step_end":
            s.steps += 1
            s.end_time_s = t
            s.staleness += [int(v) for v in obj["staleness"]]
            s.staleness_refill += [refill.get(g, False) for g in obj["groups"]]
            s.step_versions += [int(obj["version"])] * len(obj["groups"])
        elif ev == "publish":
            s.publishes.append((t, int(obj["version"])))
        elif ev == "cell_lost":
            c = int(obj["cell"])
            s.roles[c].append((since[c], t, role[c]))
            role[c], since[c] = CellRole.LOST.value, t
        elif ev == "cell_restored":  # a restarted worker: back in rollout (trainable-again changes no role)
            c = int(obj["cell"])
            if role[c] == CellRole.LOST.value:
                s.roles[c].append((since[c], t, role[c]))
                role[c], since[c] = CellRole.ROLLOUT.value, t
        elif ev == "run_end":  # what the end cut off; counters stay the policy's (a resume line settles it)
            s.cut_off_at_end = list(obj["cancelled"])
            continue
        elif ev == "resume":  # the interrupted part's outstanding executions end here; roles restart
            s.f += len(obj["cancelled"])
            s.x += len(obj["withdrawn"])
            for c in range(K):
                s.roles[c].append((since[c], t, role[c]))
                role[c], since[c] = obj["roles"][c], t
        else:
            continue
        if ev != "step_end" and ev != "publish":
            snap()
    for c in range(K):
        s.roles[c].append((since[c], max(t, since[c]), role[c]))
    return s


def read_trace(path: str | Path, *, validate: bool = True) -> TraceSummary:
    return summarize_trace(iter_trace(path, validate=validate))
