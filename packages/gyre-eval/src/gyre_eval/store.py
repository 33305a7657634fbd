"""The assessment store: one SQLite file (WAL) in the run directory, restart-safe, history never overwritten.

Invariants are enforced by the database itself, not only by this class, so no other writer can break them:
- one row per (execution, branch, artifact version, evaluator): a resubmission returns the same assessment;
- at most one designated task assessment per execution (partial unique index) supplies the reward;
- an execution belongs to one group at one dispatch index;
- a final assessment is immutable, attempts are append-only, nothing is ever deleted (triggers);
- the status/score combination is checked (an unresolved assessment has no score; a no_work one scores 0.0).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from gyre_eval.errors import ConflictError
from gyre_eval.types import Assessment, AssessmentStatus, AttemptRecord, Provenance, Submission

STORE_FILE = "assessments.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY,
    size INTEGER NOT NULL CHECK (size >= 1),
    dispatched INTEGER NOT NULL CHECK (dispatched >= size)
);
CREATE TABLE IF NOT EXISTS executions (
    execution_id TEXT PRIMARY KEY,
    group_id TEXT NOT NULL REFERENCES groups(group_id),
    dispatch_index INTEGER NOT NULL CHECK (dispatch_index >= 0),
    UNIQUE (group_id, dispatch_index)
);
CREATE TABLE IF NOT EXISTS assessments (
    id TEXT PRIMARY KEY,
    execution_id TEXT NOT NULL REFERENCES executions(execution_id),
    branch TEXT NOT NULL,
    artifact_version TEXT NOT NULL,
    evaluator TEXT NOT NULL,
    designated INTEGER NOT NULL CHECK (designated IN (0, 1)),
    submission TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    deadline REAL NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('valid', 'unresolved', 'no_work')),
    score REAL,
    final INTEGER NOT NULL CHECK (final IN (0, 1)),
    attempts INTEGER NOT NULL DEFAULT 0,
    provenance TEXT NOT NULL,
    resolved_at REAL,
    UNIQUE (execution_id, branch, artifact_version, evaluator),
    CHECK ((status = 'unresolved' AND score IS NULL)
        OR (status = 'valid' AND score IS NOT NULL AND final = 1)
        OR (status = 'no_work' AND score = 0.0 AND final = 1))
);
CREATE UNIQUE INDEX IF NOT EXISTS one_designated_per_execution ON assessments(execution_id) WHERE designated = 1;
CREATE INDEX IF NOT EXISTS assessments_unfinished ON assessments(final) WHERE final = 0;
CREATE TABLE IF NOT EXISTS attempts (
    assessment_id TEXT NOT NULL REFERENCES assessments(id),
    number INTEGER NOT NULL CHECK (number >= 1),
    started_at REAL NOT NULL,
    finished_at REAL NOT NULL,
    ok INTEGER NOT NULL CHECK (ok IN (0, 1)),
    score REAL,
    error TEXT,
    details TEXT NOT NULL,
    PRIMARY KEY (assessment_id, number)
);
CREATE TRIGGER IF NOT EXISTS attempts_append_only BEFORE UPDATE ON attempts
    BEGIN SELECT RAISE(ABORT, 'attempts are append-only'); END;
CREATE TRIGGER IF NOT EXISTS attempts_never_deleted BEFORE DELETE ON attempts
    BEGIN SELECT RAISE(ABORT, 'attempts are never deleted'); END;
CREATE TRIGGER IF NOT EXISTS assessments_never_deleted BEFORE DELETE ON assessments
    BEGIN SELECT RAISE(ABORT, 'assessments are never deleted'); END;
CREATE TRIGGER IF NOT EXISTS final_assessment_immutable BEFORE UPDATE ON assessments WHEN OLD.final = 1
    BEGIN SELECT RAISE(ABORT, 'a final assessment is immutable'); END;
CREATE TRIGGER IF NOT EXISTS assessment_identity_fixed BEFORE UPDATE ON assessments
    WHEN NEW.id IS NOT OLD.id OR NEW.execution_id IS NOT OLD.execution_id OR NEW.branch IS NOT OLD.branch
      OR NEW.artifact_version IS NOT OLD.artifact_version OR NEW.evaluator IS NOT OLD.evaluator
      OR NEW.designated IS NOT OLD.designated OR NEW.submission IS NOT OLD.submission
      OR NEW.deadline IS NOT OLD.deadline OR NEW.attempts < OLD.attempts
    BEGIN SELECT RAISE(ABORT, 'an assessment keeps its identity and history'); END;
DROP TRIGGER IF EXISTS groups_fixed;
CREATE TRIGGER IF NOT EXISTS groups_only_grow BEFORE UPDATE ON groups
    WHEN NEW.group_id IS NOT OLD.group_id OR NEW.size IS NOT OLD.size OR NEW.dispatched < OLD.dispatched
    BEGIN SELECT RAISE(ABORT, 'a group keeps its size; its dispatch count only grows'); END;
CREATE TRIGGER IF NOT EXISTS executions_fixed BEFORE UPDATE ON executions
    BEGIN SELECT RAISE(ABORT, 'an execution keeps its group and dispatch index'); END;
"""


def assessment_id(execution_id: str, branch: str, artifact_version: str, evaluator: str) -> str:
    """Deterministic id: the same execution, branch, artifact version and evaluator always name one assessment."""
    key = "\x1f".join((execution_id, branch, artifact_version, evaluator)).encode()
    return "a-" + hashlib.sha256(key).hexdigest()[:24]


class AssessmentStore:
    """SQLite-backed history of assessments and attempts. Safe to share between threads (one lock)."""

    def __init__(self, run_dir: Path | str) -> None:
        self.path = Path(run_dir) / STORE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: an acknowledged submission survives a power loss, not only a process kill.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- writes -------------------------------------------------------------------------------------------------

    def submit(
        self,
        sub: Submission,
        initial_status: AssessmentStatus,
        initial_score: float | None,
        final: bool,
        provenance: Provenance,
        now: float,
    ) -> tuple[Assessment, bool]:
        """Insert the assessment for ``sub``, or return the existing one (``created`` False) if it is identical."""
        aid = assessment_id(sub.execution_id, sub.branch, sub.artifact_version, sub.evaluator)
        payload = sub.model_dump_json()
        with self._tx() as db:
            existing = db.execute("SELECT * FROM assessments WHERE id = ?", (aid,)).fetchone()
            if existing is not None:
                if existing["submission"] != payload:
                    raise ConflictError(_diff_message(aid, existing["submission"], sub))
                return _row_to_assessment(existing), False
            group = db.execute(
                "SELECT size, dispatched FROM groups WHERE group_id = ?", (sub.group_id,)
            ).fetchone()
            if group is None:
                db.execute(
                    "INSERT INTO groups VALUES (?, ?, ?)", (sub.group_id, sub.group_size, sub.dispatched)
                )
            elif group["size"] != sub.group_size:
                raise ConflictError(
                    f"group {sub.group_id} has size {group['size']}; submission says {sub.group_size}"
                )
            # a resumed run dispatched more into a group it carried over
            elif sub.dispatched > group["dispatched"]:
                db.execute(
                    "UPDATE groups SET dispatched = ? WHERE group_id = ?", (sub.dispatched, sub.group_id)
                )
            execution = db.execute(
                "SELECT group_id, dispatch_index FROM executions WHERE execution_id = ?", (sub.execution_id,)
            ).fetchone()
            if execution is None:
                slot = db.execute(
                    "SELECT execution_id FROM executions WHERE group_id = ? AND dispatch_index = ?",
                    (sub.group_id, sub.dispatch_index),
                ).fetchone()
                if slot is not None:
                    raise ConflictError(
                        f"dispatch index {sub.dispatch_index} of group {sub.group_id} belongs to execution "
                        f"{slot['execution_id']}"
                    )
                db.execute(
                    "INSERT INTO executions VALUES (?, ?, ?)",
                    (sub.execution_id, sub.group_id, sub.dispatch_index),
                )
            elif (execution["group_id"], execution["dispatch_index"]) != (sub.group_id, sub.dispatch_index):
                raise ConflictError(
                    f"execution {sub.execution_id} is index {execution['dispatch_index']} of group "
                    f"{execution['group_id']}, not index {sub.dispatch_index} of {sub.group_id}"
                )
            if sub.designated:
                other = db.execute(
                    "SELECT id, artifact_version, branch FROM assessments WHERE execution_id = ? AND designated = 1",
                    (sub.execution_id,),
                ).fetchone()
                if other is not None:
                    raise ConflictError(
                        f"execution {sub.execution_id} already has its designated task assessment {other['id']} "
                        f"(branch {other['branch']}, version {other['artifact_version']}); submit further ones "
                        "with designated=false"
                    )
            db.execute(
                "INSERT INTO assessments (id, execution_id, branch, artifact_version, evaluator, designated, "
                "submission, submitted_at, deadline, status, score, final, attempts, provenance, resolved_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)",
                (
                    aid,
                    sub.execution_id,
                    sub.branch,
                    sub.artifact_version,
                    sub.evaluator,
                    int(sub.designated),
                    payload,
                    now,
                    sub.deadline,
                    initial_status,
                    initial_score,
                    int(final),
                    provenance.model_dump_json(),
                    now if final else None,
                ),
            )
            row = db.execute("SELECT * FROM assessments WHERE id = ?", (aid,)).fetchone()
        return _row_to_assessment(row), True

    def record_attempt(self, attempt: AttemptRecord, provenance: Provenance) -> Assessment:
        """Append one attempt and bump the assessment's attempt count (one transaction)."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO attempts VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    attempt.assessment_id,
                    attempt.number,
                    attempt.started_at,
                    attempt.finished_at,
                    int(attempt.ok),
                    attempt.score,
                    attempt.error,
                    orjson.dumps(attempt.details).decode(),
                ),
            )
            db.execute(
                "UPDATE assessments SET attempts = ?, provenance = ? WHERE id = ?",
                (attempt.number, provenance.model_dump_json(), attempt.assessment_id),
            )
            row = db.execute("SELECT * FROM assessments WHERE id = ?", (attempt.assessment_id,)).fetchone()
        return _row_to_assessment(row)

    def finalize(
        self, aid: str, status: AssessmentStatus, score: float | None, provenance: Provenance, now: float
    ) -> Assessment:
        """Settle an assessment once; the store refuses any later change."""
        with self._tx() as db:
            db.execute(
                "UPDATE assessments SET status = ?, score = ?, final = 1, provenance = ?, resolved_at = ? "
                "WHERE id = ?",
                (status, score, provenance.model_dump_json(), now, aid),
            )
            row = db.execute("SELECT * FROM assessments WHERE id = ?", (aid,)).fetchone()
        return _row_to_assessment(row)

    # -- reads --------------------------------------------------------------------------------------------------

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def get(self, aid: str) -> Assessment | None:
        rows = self._query("SELECT * FROM assessments WHERE id = ?", (aid,))
        return _row_to_assessment(rows[0]) if rows else None

    def submission(self, aid: str) -> Submission:
        rows = self._query("SELECT submission FROM assessments WHERE id = ?", (aid,))
        return Submission.model_validate_json(rows[0]["submission"])

    def list(
        self,
        execution_id: str | None = None,
        group_id: str | None = None,
        status: str | None = None,
        designated: bool | None = None,
        limit: int = 1000,
    ) -> list[Assessment]:
        where, args = [], []
        for column, value in (
            ("a.execution_id", execution_id),
            ("e.group_id", group_id),
            ("a.status", status),
        ):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if designated is not None:
            where.append("a.designated = ?")
            args.append(int(designated))
        clause = ("WHERE " + " AND ".join(where)) if where else ""
        rows = self._query(
            "SELECT a.* FROM assessments a JOIN executions e USING (execution_id) "
            f"{clause} ORDER BY a.submitted_at, a.id LIMIT ?",
            (*args, limit),
        )
        return [_row_to_assessment(r) for r in rows]

    def attempts(self, aid: str) -> list[AttemptRecord]:
        rows = self._query("SELECT * FROM attempts WHERE assessment_id = ? ORDER BY number", (aid,))
        return [
            AttemptRecord(
                assessment_id=r["assessment_id"],
                number=r["number"],
                started_at=r["started_at"],
                finished_at=r["finished_at"],
                ok=bool(r["ok"]),
                score=r["score"],
                error=r["error"],
                details=orjson.loads(r["details"]),
            )
            for r in rows
        ]

    def unfinished(self) -> list[str]:
        """Ids of assessments still being evaluated (resumed after a restart)."""
        return [
            r["id"] for r in self._query("SELECT id FROM assessments WHERE final = 0 ORDER BY submitted_at")
        ]

    def group(self, group_id: str) -> tuple[int, int] | None:
        rows = self._query("SELECT size, dispatched FROM groups WHERE group_id = ?", (group_id,))
        return (rows[0]["size"], rows[0]["dispatched"]) if rows else None

    def group_ids(self) -> list[str]:
        return [r["group_id"] for r in self._query("SELECT group_id FROM groups ORDER BY rowid")]


def _row_to_assessment(row: sqlite3.Row) -> Assessment:
    sub = orjson.loads(row["submission"])
    return Assessment(
        id=row["id"],
        execution_id=row["execution_id"],
        group_id=sub["group_id"],
        dispatch_index=sub["dispatch_index"],
        artifact_ref=sub["artifact_ref"],
        artifact_version=row["artifact_version"],
        branch=row["branch"],
        evaluator=row["evaluator"],
        designated=bool(row["designated"]),
        status=row["status"],
        score=row["score"],
        final=bool(row["final"]),
        attempts=row["attempts"],
        provenance=Provenance.model_validate_json(row["provenance"]),
        submitted_at=row["submitted_at"],
        deadline=row["deadline"],
        resolved_at=row["resolved_at"],
    )


def _diff_message(aid: str, stored: str, sub: Submission) -> str:
    old = orjson.loads(stored)
    new = orjson.loads(sub.model_dump_json())
    fields = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return (
        f"assessment {aid} (execution {sub.execution_id}, branch {sub.branch}, version {sub.artifact_version}, "
        f"evaluator {sub.evaluator}) was submitted with different {', '.join(fields)}"
    )
