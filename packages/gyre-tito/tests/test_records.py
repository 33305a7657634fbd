"""Record logs: durable appends, torn last record dropped with a warning, reload rebuilds the identical tree."""

from __future__ import annotations

import logging
import zlib

import pytest

from gyre_tito.errors import RecordLogCorrupt
from gyre_tito.records import ExecutionRecords, RecordLog, RecordStore, encode_line, log_path, read_log
from gyre_tito.testing.synthetic import SessionDriver, make_record
from gyre_tito.types import CallRecord


def _fill(records: ExecutionRecords) -> None:
    d = SessionDriver(records)
    d.call([1, 2, 3], [4, 5])
    d.call([*d.context("c0").tolist(), 6], [7])
    d.call([1, 2, 9], [8], role_class="sub/task", agent_id="sub-1")
    d.call([*d.context("c1").tolist(), 6, 6], [9, 9, 9], role_class="main/summary")


def _snapshot(records: ExecutionRecords):
    tree = records.tree
    return [(r, tree.path_tokens(r.call_id).tolist()) for r in tree.records()], tree.leaves()


def test_reload_rebuilds_identical_tree(tmp_path):
    rec = ExecutionRecords(tmp_path, "exec/1")
    _fill(rec)
    before = _snapshot(rec)
    rec.close()
    again = ExecutionRecords(tmp_path, "exec/1")
    assert _snapshot(again) == before
    assert again.match([*again.tree.path_tokens("c3").tolist(), 0]) == ("c3", 12)
    assert RecordStore(tmp_path).execution_ids() == ["exec/1"]


def test_append_assigns_seq_and_refuses_unknown_parent(tmp_path):
    rec = ExecutionRecords(tmp_path, "ex")
    stored = rec.append(make_record(call_id="a", seq=42, input_ids=[1], output_ids=[2]))
    assert stored.seq == 0
    with pytest.raises(ValueError, match="unknown parent"):
        rec.append(make_record(call_id="b", parent_id="zz", input_ids=[1]))
    rec.close()
    assert [r.call_id for r in read_log(log_path(tmp_path, "ex")).records] == ["a"]  # nothing half-written


@pytest.mark.parametrize("cut", [1, 9, 30, -1])
def test_torn_last_record_is_dropped_with_warning(tmp_path, caplog, cut):
    rec = ExecutionRecords(tmp_path, "ex")
    _fill(rec)
    rec.close()
    path = log_path(tmp_path, "ex")
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last_start + cut] if cut > 0 else data[:-1])  # a partial last line
    with caplog.at_level(logging.WARNING):
        again = ExecutionRecords(tmp_path, "ex")
    assert "torn" in caplog.text
    assert [r.call_id for r in again.tree.records()] == ["c0", "c1", "c2"]
    assert again.log.dropped_bytes > 0
    assert path.stat().st_size == last_start  # cut off, so the next append starts clean
    d = SessionDriver(again)
    d.call([*again.tree.path_tokens("c1").tolist(), 6, 6], [9])
    again.close()
    assert [r.call_id for r in read_log(path).records] == ["c0", "c1", "c2", "c3"]


def test_damaged_last_line_with_newline_is_torn_but_damage_in_the_middle_raises(tmp_path, caplog):
    rec = ExecutionRecords(tmp_path, "ex")
    _fill(rec)
    rec.close()
    path = log_path(tmp_path, "ex")
    lines = path.read_bytes().splitlines(keepends=True)
    flipped = lines[-1].replace(b'"seq":3', b'"seq":4')  # checksum no longer matches
    path.write_bytes(b"".join(lines[:-1]) + flipped)
    with caplog.at_level(logging.WARNING):
        assert len(RecordLog(path).records) == 3
    assert "torn" in caplog.text
    bad = lines[1].replace(b'"seq":1', b'"seq":7')
    path.write_bytes(lines[0] + bad + b"".join(lines[2:]))
    with pytest.raises(RecordLogCorrupt, match="damaged record"):
        RecordLog(path)


def test_log_lines_are_plain_json_lines(tmp_path):
    """Before: `<crc32> <json>` per line, so pandas.read_json(lines=True) failed on a record log."""
    import orjson
    import pandas

    rec = ExecutionRecords(tmp_path, "ex")
    _fill(rec)
    n = len(rec.tree)
    rec.close()
    path = log_path(tmp_path, "ex")
    frame = pandas.read_json(path, lines=True)
    assert len(frame) == n and set(frame["execution_id"]) == {"ex"} and list(frame["seq"]) == list(range(n))
    for line in path.read_bytes().splitlines():
        obj = orjson.loads(line)
        crc = obj.pop("crc32")
        assert int(crc, 16) == zlib.crc32(CallRecord.model_validate(obj).model_dump_json().encode())


def test_logs_in_the_old_format_are_still_read_and_appended_in_it(tmp_path):
    rec = ExecutionRecords(tmp_path, "ex")
    _fill(rec)
    records = list(rec.tree.records())
    rec.close()
    path = log_path(tmp_path, "ex")
    path.write_bytes(b"".join(encode_line(r, legacy=True) for r in records[:-1]))
    assert path.read_bytes()[8:9] == b" "  # "<crc32 hex> <json>"
    again = ExecutionRecords(tmp_path, "ex")
    assert list(again.tree.records()) == records[:-1]
    again.append(records[-1].model_copy(update={"seq": 0}))
    again.close()
    lines = path.read_bytes().splitlines()
    assert len(lines) == len(records) and all(line[8:9] == b" " for line in lines)
    assert [r.call_id for r in read_log(path).records] == [r.call_id for r in records]
    bad = lines[0][:20] + b"X" + lines[0][21:]  # old-format damage is still detected
    path.write_bytes(bad + b"\n" + b"\n".join(lines[1:]) + b"\n")
    with pytest.raises(RecordLogCorrupt):
        read_log(path)


def test_failed_append_leaves_no_partial_line(tmp_path, monkeypatch):
    import os

    rec = ExecutionRecords(tmp_path, "ex")
    _fill(rec)
    size = log_path(tmp_path, "ex").stat().st_size
    real_write = os.write

    def half_then_fail(fd, data):
        real_write(fd, bytes(data[:10]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        SessionDriver(rec).call([5, 5], [6])
    monkeypatch.undo()
    assert log_path(tmp_path, "ex").stat().st_size == size
    assert len(rec.tree) == 4  # the tree did not take the record either
    SessionDriver(rec).call([5, 5], [6])
    rec.close()
    assert [r.call_id for r in read_log(log_path(tmp_path, "ex")).records] == ["c0", "c1", "c2", "c3", "c4"]


def test_any_cut_reloads_exactly_the_complete_records(tmp_path):
    """Crash at any byte: reopening keeps exactly the records whose whole line (with newline) made it to disk."""
    src = ExecutionRecords(tmp_path / "src", "ex")
    _fill(src)
    src.close()
    data = log_path(tmp_path / "src", "ex").read_bytes()
    ends = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    cuts = sorted({*range(0, len(data) + 1, 13), *ends, *(e - 1 for e in ends), *(e + 1 for e in ends)})
    for cut in (c for c in cuts if c <= len(data)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        log_path(d, "ex").write_bytes(data[:cut])
        rec = ExecutionRecords(d, "ex")
        complete = sum(1 for e in ends if e <= cut)
        assert [r.call_id for r in rec.tree.records()] == [f"c{i}" for i in range(complete)], cut
        assert log_path(d, "ex").stat().st_size == (ends[complete - 1] if complete else 0)
        rec.close()
