"""The SQLite store enforces its invariants itself: WAL, one designated per execution, append-only history."""

import sqlite3
import time

import pytest
from eval_helpers import submission

from gyre_eval.errors import ConflictError
from gyre_eval.store import AssessmentStore, assessment_id
from gyre_eval.types import AttemptRecord, Provenance

PROV = Provenance(evaluator="task", kind="exec")


def _store(tmp_path) -> AssessmentStore:
    return AssessmentStore(tmp_path)


def test_store_is_wal_in_the_run_directory_and_survives_reopening(tmp_path, workspace):
    store = _store(tmp_path)
    a, created = store.submit(submission(workspace), "unresolved", None, False, PROV, time.time())
    assert created and a.id == assessment_id("e0", "main", "final", "task")
    store.record_attempt(
        AttemptRecord(
            assessment_id=a.id, number=1, started_at=1, finished_at=2, ok=False, score=None, error="x"
        ),
        PROV.model_copy(update={"last_error": "x"}),
    )
    store.close()
    assert (tmp_path / "assessments.sqlite").is_file()
    raw = sqlite3.connect(tmp_path / "assessments.sqlite")
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    raw.close()
    again = AssessmentStore(tmp_path)
    found = again.get(a.id)
    assert found.attempts == 1 and found.provenance.last_error == "x" and not found.final
    assert again.unfinished() == [a.id]
    assert again.attempts(a.id)[0].error == "x"


def _raw(tmp_path) -> sqlite3.Connection:
    db = sqlite3.connect(tmp_path / "assessments.sqlite", isolation_level=None)
    db.execute("PRAGMA foreign_keys=ON")
    return db


def test_database_refuses_a_second_designated_assessment_even_from_another_writer(tmp_path, workspace):
    store = _store(tmp_path)
    a, _ = store.submit(submission(workspace), "valid", 1.0, True, PROV, time.time())
    db = _raw(tmp_path)
    row = db.execute("SELECT * FROM assessments WHERE id = ?", (a.id,)).fetchone()
    copy = list(row)
    copy[0], copy[3] = "a-forged", "v2"  # new id and artifact version, still designated
    with pytest.raises(sqlite3.IntegrityError, match=r"assessments\.execution_id"):
        db.execute(f"INSERT INTO assessments VALUES ({','.join('?' * len(copy))})", copy)


def test_history_is_never_overwritten_or_deleted(tmp_path, workspace):
    store = _store(tmp_path)
    a, _ = store.submit(submission(workspace), "unresolved", None, False, PROV, time.time())
    store.record_attempt(
        AttemptRecord(assessment_id=a.id, number=1, started_at=1, finished_at=2, ok=True, score=0.0),
        PROV,
    )
    final = store.finalize(a.id, "valid", 0.0, PROV, time.time())
    assert (final.status, final.score, final.final) == ("valid", 0.0, True)
    db = _raw(tmp_path)
    for sql, message in [
        ("UPDATE assessments SET score = 1.0", "a final assessment is immutable"),
        ("DELETE FROM assessments", "never deleted"),
        ("UPDATE attempts SET score = 1.0", "append-only"),
        ("DELETE FROM attempts", "never deleted"),
        ("UPDATE groups SET size = 5", "keeps its size"),
        ("UPDATE groups SET dispatched = 0", "only grows"),
        ("UPDATE executions SET dispatch_index = 3", "keeps its group"),
    ]:
        with pytest.raises(sqlite3.DatabaseError, match=message):
            db.execute(sql)
    with pytest.raises(sqlite3.DatabaseError, match="immutable"):
        store.finalize(a.id, "unresolved", None, PROV, time.time())
    assert store.get(a.id).score == 0.0


def test_status_and_score_must_agree_in_the_database(tmp_path, workspace):
    store = _store(tmp_path)
    a, _ = store.submit(submission(workspace), "unresolved", None, False, PROV, time.time())
    db = _raw(tmp_path)
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        db.execute("UPDATE assessments SET score = 0.0 WHERE id = ?", (a.id,))  # unresolved with a zero
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        db.execute("UPDATE assessments SET status = 'no_work', score = 0.5, final = 1 WHERE id = ?", (a.id,))


def test_execution_keeps_one_group_slot(tmp_path, workspace):
    store = _store(tmp_path)
    now = time.time()
    store.submit(submission(workspace, group_size=2, launched_at=now), "valid", 1.0, True, PROV, now)
    with pytest.raises(ConflictError, match="is index 0 of group g0"):
        store.submit(
            submission(workspace, group_size=2, dispatch_index=1, designated=False, artifact_version="v2"),
            "valid",
            1.0,
            True,
            PROV,
            now,
        )


def test_a_group_takes_more_executions_but_keeps_its_size(tmp_path, workspace):
    """A resumed run dispatches more executions into a group it carried over: the group's dispatch count grows
    with the first submission that names more; one made before (fewer) still fits; its size never changes."""
    store = _store(tmp_path)
    now = time.time()
    store.submit(
        submission(workspace, "g0.e0", group_size=2, group_dispatched=2), "unresolved", None, False, PROV, now
    )
    store.submit(
        submission(workspace, "g0.e3", group_size=2, group_dispatched=4, dispatch_index=3),
        "unresolved",
        None,
        False,
        PROV,
        now,
    )
    assert store.group("g0") == (2, 4)
    store.submit(
        submission(workspace, "g0.e1", group_size=2, group_dispatched=2, dispatch_index=1),
        "unresolved",
        None,
        False,
        PROV,
        now,
    )
    assert store.group("g0") == (2, 4)
    with pytest.raises(ConflictError, match="has size 2; submission says 3"):
        store.submit(
            submission(workspace, "g0.e2", group_size=3, group_dispatched=4, dispatch_index=2),
            "unresolved",
            None,
            False,
            PROV,
            now,
        )
