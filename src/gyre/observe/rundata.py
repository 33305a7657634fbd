"""A run directory read as it grows: the one data source of the live dashboard, the metrics sink and report.html.

`RunView(run_dir)` tails the append-only files of a run (docs/design/architecture.md#run-directory-and-trace) and keeps what it has read: trace.jsonl,
metrics/steps.jsonl, switches.jsonl, publish.jsonl and the proxy's per-execution call logs under records/. Each
`refresh()` reads only what was appended since the last one. A torn last line (an interrupted run, or a line being
written) is left for the next refresh, so a run that was killed mid-write still reads up to its last whole line.
Nothing here writes to the run directory, so it can read a live run, a finished one or an interrupted one.

Views (plain JSON-able dicts, the dashboard's API and the report's embedded data):
- `summary()`: counters, steps done / planned, policy, run length.
- `series()`: role timeline, waterlevel vs capacity, per-step training metrics, staleness histogram, rollout tokens/s
  and proxy latency over time, switch and publication times, sample answers per step.
- `executions()`: one row per dispatched execution: status, engine, calls, tokens, reward, assessment status.
- `execution(id)`: its trajectory tree (each call with role class, engine/weight version per output segment, output
  text with the selected trajectories' target spans marked), the selected trajectories, the assessment and its
  history.

Time: trace times are seconds since the run started (the controller's clock); the proxy records unix times, mapped
with metrics/clock.json (written by the run monitor) or, for runs without it, estimated from the proxy's registration
of each execution at its launch.
"""

from __future__ import annotations

import math
import os
import stat
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gyre_sched.trace import summarize_trace

__all__ = ["Call", "RunView", "percentile", "read_artifact", "time_unit"]


def read_artifact(path: Path, max_bytes: int) -> bytes | None:
    """At most ``max_bytes`` of a file an agent wrote, or None unless it is a regular file. The last component is not
    followed if it is a symlink (a link to a sibling's answer or a root-only file reads as nothing), a FIFO or device
    is never read (O_NONBLOCK: opening a FIFO cannot wait for a writer; it is then refused as not regular), a
    directory is None, and a huge file costs ``max_bytes``: nothing here can block the caller or grow with the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:  # missing, a symlink (ELOOP), a directory's parent gone, permission
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, max_bytes, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


SAMPLES_PER_STEP = 3
"""Sample answers kept per step: the best, the median and the worst reward of the step's executions."""


def time_unit(length_s: float) -> tuple[str, float]:
    """The unit a time axis of a run of this length is drawn in: (name, seconds per unit)."""
    if length_s < 180:
        return "s", 1.0
    if length_s < 3 * 3600:
        return "min", 60.0
    return "h", 3600.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class _Tail:
    """Complete lines appended to a file since the last read; a partial last line waits for its newline."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0

    def read(self) -> list[bytes]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.pos += end + 1
        return [line for line in data[: end + 1].split(b"\n") if line.strip()]


def _json_lines(lines: list[bytes], strip: int = 0) -> list[dict]:
    out = []
    for line in lines:
        try:
            # plain JSON lines, or an older "<prefix> <json>" form
            out.append(orjson.loads(line if line.startswith(b"{") else line[strip:]))
        except orjson.JSONDecodeError:
            continue  # a damaged line: what the run could not finish writing is not data
    return out


@dataclass(slots=True)
class Call:
    """One model call of one execution, as the proxy recorded it."""

    execution_id: str
    seq: int
    input_tokens: int
    output_tokens: int
    request_at: float
    """unix time"""
    end_at: float
    """unix time"""

    @property
    def latency_s(self) -> float:
        return self.end_at - self.request_at


@dataclass
class _Execution:
    id: str
    group: str
    query: str
    v_d: int
    dispatch_t: float
    status: str = "queued"
    engine: str | None = None
    launch_t: float | None = None
    end_t: float | None = None
    assessment: str | None = None
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    extra: dict = field(default_factory=dict)


class RunView:
    """Incremental, read-only view of one run directory (thread-safe: one lock around every read)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._lock = threading.RLock()
        self._trace = _Tail(self.run_dir / "trace.jsonl")
        self._steps = _Tail(self.run_dir / "metrics" / "steps.jsonl")
        self._switches = _Tail(self.run_dir / "metrics" / "switches.jsonl")
        self._publishes = _Tail(self.run_dir / "metrics" / "publish.jsonl")
        self._registrations = _Tail(self.run_dir / "records" / "executions.jsonl")
        self._records: dict[str, _Tail] = {}
        self.trace: list[dict] = []
        self.steps: list[dict] = []
        self.switches: list[dict] = []
        self.publishes: list[dict] = []
        self.calls: list[Call] = []
        self._executions: dict[str, _Execution] = {}
        self._registered: dict[str, float] = {}  # execution -> unix time the proxy registered it
        self._transition_ends: list[tuple[float, int, str, str]] = []
        self._summary = None
        self._summary_lines = -1
        self._tokenizer: Any = None
        self._tokenizer_error: str | None = None
        self._store: Any = None
        self._rewards: dict[str, dict] = {}
        self.config = self._read_json(self.run_dir / "config.json") or {}

    @staticmethod
    def _read_json(path: Path) -> dict | None:
        try:
            return orjson.loads(path.read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None

    # ---- reading ------------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        with self._lock:
            for obj in _json_lines(self._trace.read()):
                self._trace_line(obj)
            self.steps += _json_lines(self._steps.read())
            self.switches += _json_lines(self._switches.read())
            self.publishes += _json_lines(self._publishes.read())
            for obj in _json_lines(self._registrations.read()):
                if obj.get("ev") == "register":
                    self._registered.setdefault(obj["execution_id"], float(obj["t"]))
            self._read_records()
            self._read_rewards()

    def _trace_line(self, obj: dict) -> None:
        self.trace.append(obj)
        ev, t = obj.get("ev"), float(obj.get("t", 0.0))
        ex = self._executions
        match ev:
            case "dispatch":
                for eid in obj["executions"]:
                    ex[eid] = _Execution(eid, obj["group"], obj.get("query", ""), int(obj.get("v_d", 0)), t)
            case "launch" if obj["execution"] in ex:
                e = ex[obj["execution"]]
                e.status, e.engine, e.launch_t = "running", obj.get("engine"), t
            case "route" if obj["execution"] in ex:
                ex[obj["execution"]].engine = obj.get("engine")
            case "terminate" if obj["execution"] in ex:
                e = ex[obj["execution"]]
                e.status, e.end_t = obj.get("outcome", "terminated"), t
            case "withdraw" if obj["execution"] in ex:
                e = ex[obj["execution"]]
                e.status, e.end_t = "withdrawn", t
            case "assessed" if obj["execution"] in ex:
                ex[obj["execution"]].assessment = obj.get("status")
            case "transition_end":
                self._transition_ends.append((t, int(obj["cell"]), obj["from"], obj["to"]))
            case _:
                pass

    def _records_dir(self) -> Path:
        return self.run_dir / "records" / "records"

    def _read_records(self) -> None:
        try:
            entries = list(os.scandir(self._records_dir()))
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.endswith(".tito.jsonl") and entry.name not in self._records:
                self._records[entry.name] = _Tail(Path(entry.path))
        for tail in self._records.values():
            # CallRecord JSON lines (older logs: "<crc32 hex> <CallRecord JSON>", gyre_tito.records)
            for rec in _json_lines(tail.read(), strip=9):
                timings = rec.get("timings") or {}
                call = Call(
                    execution_id=rec["execution_id"],
                    seq=int(rec.get("seq", 0)),
                    input_tokens=len(rec.get("input_ids", ())),
                    output_tokens=len(rec.get("output_ids", ())),
                    request_at=float(timings.get("request_at", 0.0)),
                    end_at=float(timings.get("end_at", 0.0)),
                )
                self.calls.append(call)
                e = self._executions.get(call.execution_id)
                if e is not None:
                    e.calls += 1
                    e.input_tokens += call.input_tokens
                    e.output_tokens += call.output_tokens

    def _read_rewards(self) -> None:
        path = self.run_dir / "assessments.sqlite"
        if not path.exists():
            return
        if self._store is None:
            from gyre_eval.store import AssessmentStore

            self._store = AssessmentStore(self.run_dir)
        for a in self._store.list(designated=True, limit=1 << 30):
            self._rewards[a.execution_id] = {
                "score": a.score,
                "status": a.status,
                "final": a.final,
                "attempts": a.attempts,
            }

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None

    # ---- clocks -------------------------------------------------------------------------------------------------
    def unix_t0(self) -> float | None:
        """Unix time of the run's t = 0 (None when neither clock.json nor a launch registration is there yet)."""
        clock = self._read_json(self.run_dir / "metrics" / "clock.json")
        if clock and "unix_t0" in clock:
            return float(clock["unix_t0"])
        offsets = [
            self._registered[e.id] - e.launch_t
            for e in self._executions.values()
            if e.launch_t is not None and e.id in self._registered
        ]
        return min(offsets) if offsets else None

    # ---- views --------------------------------------------------------------------------------------------------
    def _trace_summary(self):
        if self._summary_lines != len(self.trace) and self.trace and self.trace[0].get("ev") == "header":
            self._summary = summarize_trace(iter(self.trace))
            self._summary_lines = len(self.trace)
        return self._summary

    def length_s(self) -> float:
        return float(self.trace[-1]["t"]) if self.trace else 0.0

    def summary(self) -> dict:
        with self._lock:
            s = self._trace_summary()
            header = self.trace[0] if self.trace else {}
            planned = (self.config.get("train") or {}).get("steps")
            statuses = Counter(e.status for e in self._executions.values())
            return {
                "run_dir": str(self.run_dir),
                "name": self.run_dir.name,
                "policy": header.get("policy"),
                "header": {k: v for k, v in header.items() if k not in ("t", "ev")},
                "steps_done": len(self.steps),
                "steps_planned": planned,
                "length_s": self.length_s(),
                "counters": {"d": s.d, "p": s.p, "f": s.f, "x": s.x} if s else {},
                "running": statuses.get("running", 0),
                "queued": statuses.get("queued", 0),
                "role_share": s.role_share() if s else {},
                "last_reward": self.steps[-1].get("mean_reward") if self.steps else None,
                "finished": (self.run_dir / "metrics" / "scheduler.json").exists(),
            }

    def series(self, max_points: int = 2000) -> dict:
        with self._lock:
            s = self._trace_summary()
            length = self.length_s()
            unit, scale = time_unit(length)
            timeline = s.timeline if s else []
            if len(timeline) > max_points:  # keep the last point of each slice: the level it settled at
                stride = math.ceil(len(timeline) / max_points)
                timeline = timeline[stride - 1 :: stride] + ([timeline[-1]] if len(timeline) % stride else [])
            return {
                "length_s": length,
                "time_unit": unit,
                "time_scale": scale,
                "roles": [[list(span) for span in spans] for spans in (s.roles if s else [])],
                "waterlevel": [list(p) for p in timeline],
                "steps": [self._step_row(row) for row in self.steps],
                "staleness_hist": sorted(Counter(s.staleness).items()) if s else [],
                "throughput": self._throughput(length),
                "switches": self._switch_rows(),
                "publishes": [dict(p) for p in self.publishes],
                "samples": self._samples(),
            }

    @staticmethod
    def _step_row(row: dict) -> dict:
        m = row.get("metrics") or {}
        st = row.get("staleness") or []
        return {
            "step": row.get("policy_version"),
            "t": row.get("t"),
            "mean_reward": row.get("mean_reward"),
            "reward_std": row.get("reward_std"),
            "loss": row.get("loss"),
            "surrogate": row.get("surrogate"),
            "grad_norm": row.get("grad_norm"),
            "target_tokens": row.get("num_target_tokens"),
            "training_cells": row.get("training_cells"),
            "microsteps_by_cell": row.get("microsteps_by_cell") or {},
            "staleness": st,
            "group_ids": row.get("group_ids") or [],  # the page's per-step response length and turns
            "staleness_mean": sum(st) / len(st) if st else None,
            "seconds": row.get("seconds"),
            "metrics": m,
        }

    def _throughput(self, length: float, bins: int = 60) -> list[dict]:
        """Rollout tokens/s and proxy call latency (p50, p99) per time bin of the run."""
        t0 = self.unix_t0()
        if t0 is None or not self.calls or length <= 0:
            return []
        width = max(1.0, length / bins)
        buckets: dict[int, list[Call]] = {}
        for c in self.calls:
            buckets.setdefault(int(max(0.0, c.end_at - t0) // width), []).append(c)
        out = []
        for b in range(max(int(length // width), *buckets) + 1):  # the whole run: 0 tokens/s while none end
            calls = buckets.get(b, [])
            lat = [c.latency_s for c in calls]
            out.append(
                {
                    "t": round((b + 1) * width, 3),
                    "tokens_per_s": sum(c.output_tokens for c in calls) / width,
                    "latency_p50_s": percentile(lat, 50) if lat else None,
                    "latency_p99_s": percentile(lat, 99) if lat else None,
                    "calls": len(calls),
                }
            )
        return out

    def _switch_rows(self) -> list[dict]:
        ends = list(self._transition_ends)
        rows = []
        # matched in order with the trace's transition_end of the same cell and direction
        for sw in self.switches:
            cell, a, b = int(sw.get("cell", -1)), sw.get("from_role"), sw.get("to_role")
            t = None
            for i, (te, c, _fa, fb) in enumerate(ends):
                if c == cell and fb == b:  # rollout -> training ends as to_training -> training
                    t = te
                    del ends[i]
                    break
            rows.append({"cell": cell, "from": a, "to": b, "total_s": sw.get("total_s"), "t": t})
        return rows

    def _members(self, groups: list[str]) -> list[_Execution]:
        return [e for e in self._executions.values() if e.group in set(groups)]

    def answer(self, execution_id: str, limit: int = 400) -> str | None:
        """The first ``limit`` characters of the execution's answer.txt, or None. An agent wrote it: untrusted."""
        if "/" in execution_id or execution_id in ("", ".", ".."):
            return None
        data = read_artifact(self.run_dir / "workspaces" / execution_id / "answer.txt", limit * 4)
        return None if data is None else data.decode("utf-8", errors="replace")[:limit]

    def _samples(self) -> list[dict]:
        out = []
        for row in self.steps:
            scored = [
                (self._rewards[e.id]["score"], e.id)
                for e in self._members(row.get("group_ids") or [])
                if e.id in self._rewards and self._rewards[e.id]["score"] is not None
            ]
            scored.sort(key=lambda x: (-x[0], x[1]))
            picks = []
            if scored:
                idx = sorted({0, len(scored) // 2, len(scored) - 1})[:SAMPLES_PER_STEP]
                picks = [scored[i] for i in idx]
            out.append(
                {
                    "step": row.get("policy_version"),
                    "answers": [
                        {"execution": eid, "reward": r, "answer": self.answer(eid)} for r, eid in picks
                    ],
                }
            )
        return out

    def executions(self) -> list[dict]:
        with self._lock:
            return [self._row(e) for e in self._executions.values()]

    def _row(self, e: _Execution) -> dict:
        reward = self._rewards.get(e.id, {})
        return {
            "execution": e.id,
            "group": e.group,
            "query": e.query,
            "v_d": e.v_d,
            "status": e.status,
            "engine": e.engine,
            "dispatch_t": e.dispatch_t,
            "launch_t": e.launch_t,
            "end_t": e.end_t,
            "calls": e.calls,
            "input_tokens": e.input_tokens,
            "output_tokens": e.output_tokens,
            "reward": reward.get("score"),
            "assessment": e.assessment or reward.get("status"),
            "attempts": reward.get("attempts"),
        }

    def execution_ids(self) -> list[str]:
        with self._lock:
            return list(self._executions)

    # ---- one execution ------------------------------------------------------------------------------------------
    def _decode(self, ids) -> str | None:
        if self._tokenizer is None and self._tokenizer_error is None:
            model = (self.config.get("model") or {}).get("path") or str(self.run_dir / "model")
            try:  # the fast tokenizer file alone: no transformers import (seconds) to show text
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
            except Exception as exc:  # the tree still shows token counts and spans without text
                self._tokenizer_error = f"{type(exc).__name__}: {exc}"
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def execution(self, execution_id: str, *, refresh: bool = True) -> dict | None:
        """Everything about one execution (None if the run never dispatched it). ``refresh=False`` reads it as of
        the last `refresh` (a report reads hundreds of executions of a finished run: one refresh, not one each,
        since a refresh re-reads every assessment)."""
        from gyre_tito.export import read_trajectories
        from gyre_tito.records import log_path, read_log
        from gyre_tito.tree import ExecutionTree

        with self._lock:
            if refresh:
                self.refresh()
            e = self._executions.get(execution_id)
            if e is None:
                return None
            row = self._row(e)
            path = log_path(self._records_dir(), execution_id)
            records = read_log(path).records if path.exists() else []
            tree = ExecutionTree.from_records(execution_id, records)
            traj_file = self.run_dir / "trajectories" / f"{execution_id}.parquet"
            trajectories = read_trajectories(traj_file) if traj_file.exists() else []
            targets = _target_spans(tree, trajectories)
            nodes = [self._node(tree, n, targets.get(n.call_id, [])) for n in tree.nodes]
            return {
                "execution": row,
                "nodes": nodes,
                "trajectories": [_trajectory_row(t) for t in trajectories],
                "assessments": self._assessments(execution_id),
                "answer": self.answer(execution_id, limit=2000),
                "tokenizer_error": self._tokenizer_error,
            }

    def _node(self, tree, node, targets: list[tuple[int, int, int]]) -> dict:
        out_ids = node.output_ids
        pieces, pos = [], 0
        for start, end, traj in sorted(targets):
            if start > pos:
                pieces.append({"start": pos, "end": start, "target": False, "trajectory": None})
            pieces.append({"start": start, "end": end, "target": True, "trajectory": traj})
            pos = end
        if pos < len(out_ids):
            pieces.append({"start": pos, "end": len(out_ids), "target": False, "trajectory": None})
        for p in pieces:
            p["tokens"] = p["end"] - p["start"]
            p["text"] = self._decode(out_ids[p["start"] : p["end"]])
        tail = node.input_ids[-64:]
        depth = len(tree.path(node.call_id)) - 1
        parent = tree.nodes[node.parent].call_id if node.parent >= 0 else None
        return {
            "call_id": node.call_id,
            "seq": node.seq,
            "parent": parent,
            "depth": depth,
            "role_class": node.role_class,
            "call_kind": node.call_kind,
            "agent_id": node.agent_id,
            "finish_reason": node.finish_reason,
            "input_tokens": node.n_input,
            "output_tokens": node.n_output,
            "input_provenance": [list(run) for run in node.input_provenance],
            "input_tail": self._decode(tail),
            "input_tail_tokens": len(tail),
            "segments": [s.model_dump(exclude={"schema_version"}) for s in node.output_segments],
            "latency_s": node.timings.end_at - node.timings.request_at,
            "pieces": pieces,
            "target_tokens": sum(p["tokens"] for p in pieces if p["target"]),
        }

    def _assessments(self, execution_id: str) -> list[dict]:
        if self._store is None:
            return []
        out = []
        for a in self._store.list(execution_id=execution_id, limit=1 << 30):
            row = a.model_dump(mode="json", exclude={"schema_version"})
            row["history"] = [
                h.model_dump(mode="json", exclude={"schema_version", "assessment_id"})
                for h in self._store.attempts(a.id)
            ]
            out.append(row)
        return out


def _runs(mask: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """[start, end) runs of 1s in mask[lo:hi], relative to lo."""
    runs, start = [], None
    for i in range(lo, hi):
        if mask[i] and start is None:
            start = i
        elif not mask[i] and start is not None:
            runs.append((start - lo, i - lo))
            start = None
    if start is not None:
        runs.append((start - lo, hi - lo))
    return runs


def _target_spans(tree, trajectories) -> dict[str, list[tuple[int, int, int]]]:
    """Per call: (start, end, trajectory index) of target tokens, in the call's output coordinates."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for traj in trajectories:
        if traj.placeholder or traj.leaf_call_id is None or traj.leaf_call_id not in tree:
            continue
        mask = traj.target_mask
        for node in tree.path(traj.leaf_call_id):
            lo, hi = node.offset + node.n_input, min(node.end, len(mask))
            for a, b in _runs(mask, lo, hi):
                out.setdefault(node.call_id, []).append((a, b, traj.index))
    return out


def _trajectory_row(t) -> dict:
    return {
        "index": t.index,
        "leaf_call_id": t.leaf_call_id,
        "role_class": t.role_class,
        "agent_id": t.agent_id,
        "tokens": len(t.token_ids),
        "targets": t.num_targets,
        "placeholder": t.placeholder,
        "weight_versions": [w.model_dump(exclude={"schema_version"}) for w in t.weight_versions],
    }
