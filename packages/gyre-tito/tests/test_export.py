"""Trajectory files: JSONL and Parquet round trips, readable with plain pyarrow/json, clear errors on bad files."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from gyre_tito.export import (
    export_execution,
    parquet_schema,
    read_jsonl,
    read_parquet,
    read_trajectories,
    write_jsonl,
    write_parquet,
    write_trajectories,
)
from gyre_tito.materialize import placeholder_trajectory, select_trajectories
from gyre_tito.records import ExecutionRecords
from gyre_tito.selection import SelectionConfig
from gyre_tito.testing.synthetic import SessionDriver
from gyre_tito.tree import ExecutionTree


def _trajectories():
    d = SessionDriver(ExecutionTree("ex"))
    d.call([1, 2, 3], [4, 5], weight_version="3")
    d.call([*d.context("c0"), 6], [7, 8], weight_version="4")
    d.call([1, 2, 9], [10], role_class="sub/task", agent_id="sub-x")
    return [*select_trajectories(d.tree, "g", SelectionConfig(seed=1)), placeholder_trajectory("ex2", "g")]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    trajs = _trajectories()
    path = tmp_path / f"t{suffix}"
    write_trajectories(path, trajs)
    assert read_trajectories(path) == trajs


def test_parquet_is_readable_without_gyre(tmp_path):
    trajs = _trajectories()
    write_parquet(tmp_path / "t.parquet", trajs)
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.schema.equals(parquet_schema(), check_metadata=True)
    rows = table.to_pylist()
    assert rows[0]["token_ids"] == trajs[0].token_ids
    assert rows[0]["target_mask"] == trajs[0].target_mask
    assert rows[0]["behavior_logprobs"] == trajs[0].behavior_logprobs
    assert rows[0]["weight_versions"][0]["weight_version"] == trajs[0].weight_versions[0].weight_version
    assert rows[-1]["placeholder"] is True and rows[-1]["leaf_call_id"] is None


def test_jsonl_is_plain_json(tmp_path):
    trajs = _trajectories()
    write_jsonl(tmp_path / "t.jsonl", trajs)
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert [json.loads(line)["token_ids"] for line in lines] == [t.token_ids for t in trajs]


def test_bad_files_give_clear_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"schema_version": 1, "execution_id": "x"}\n')
    with pytest.raises(ValidationError):
        read_jsonl(tmp_path / "bad.jsonl")
    pq.write_table(pa.table({"a": [1]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="not a gyre-tito trajectory file"):
        read_parquet(tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"use \.jsonl or \.parquet"):
        write_trajectories(tmp_path / "t.csv", [])


def test_export_execution_from_the_record_log(tmp_path):
    rec = ExecutionRecords(tmp_path / "records", "ex-1")
    d = SessionDriver(rec)
    d.call([1, 2, 3], [4, 5])
    d.call([*d.context("c0"), 6], [7])
    out = export_execution(tmp_path / "records", "ex-1", "g", tmp_path / "ex-1.parquet")
    assert read_parquet(tmp_path / "ex-1.parquet") == out
    assert len(out) == 1 and out[0].num_targets == 3
    rec.close()
    ph = export_execution(tmp_path / "records", "ex-2", "g", tmp_path / "ex-2.jsonl", no_work=True)
    assert ph[0].placeholder and read_jsonl(tmp_path / "ex-2.jsonl") == ph
    with pytest.raises(FileNotFoundError, match="no record log"):
        export_execution(tmp_path / "records", "missing", "g", tmp_path / "m.jsonl")
