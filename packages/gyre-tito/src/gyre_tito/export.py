"""Trajectory files another stack can read without Gyre: JSONL and Parquet (schema in packages/gyre-tito/README.md).

API summary
-----------
- ``write_jsonl(path, trajectories)`` / ``read_jsonl(path) -> list[Trajectory]``: one ``Trajectory`` JSON object a line.
- ``write_parquet(path, trajectories)`` / ``read_parquet(path) -> list[Trajectory]``: one row per trajectory, columns of
  ``parquet_schema()``; file metadata ``gyre_tito.format = "trajectories"``, ``gyre_tito.schema_version = "1"``.
- ``write_trajectories(path, trajectories)`` / ``read_trajectories(path)``: by suffix (``.jsonl`` or ``.parquet``).
- ``export_execution(records_dir, execution_id, group_id, out, config=None, no_work=False) -> list[Trajectory]``: load
  an execution's record log, select and materialize its trajectories (or the placeholder for ``no_work``), write
  ``out``.

Reading validates every row into a ``Trajectory``: a malformed file raises ``pydantic.ValidationError`` (or
``ValueError`` for a Parquet file that is not a trajectory file). pyarrow is imported only when Parquet is used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from gyre_tito.materialize import placeholder_trajectory, select_trajectories
from gyre_tito.records import log_path, read_log
from gyre_tito.selection import SelectionConfig
from gyre_tito.tree import ExecutionTree
from gyre_tito.types import Trajectory

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "export_execution",
    "parquet_schema",
    "read_jsonl",
    "read_parquet",
    "read_trajectories",
    "write_jsonl",
    "write_parquet",
    "write_trajectories",
]

FORMAT_KEY = b"gyre_tito.format"
VERSION_KEY = b"gyre_tito.schema_version"


def write_jsonl(path: str | os.PathLike[str], trajectories: Iterable[Trajectory]) -> None:
    with open(path, "wb") as f:
        for t in trajectories:
            f.write(t.model_dump_json().encode() + b"\n")


def read_jsonl(path: str | os.PathLike[str]) -> list[Trajectory]:
    out = []
    for line in Path(path).read_bytes().splitlines():
        if line.strip():
            out.append(Trajectory.model_validate(orjson.loads(line)))
    return out


def parquet_schema() -> pa.Schema:
    import pyarrow as pa

    span = pa.struct(
        [
            pa.field("schema_version", pa.int16(), nullable=False),
            pa.field("start", pa.int32(), nullable=False),
            pa.field("end", pa.int32(), nullable=False),
            pa.field("engine_id", pa.string(), nullable=False),
            pa.field("weight_version", pa.string(), nullable=False),
        ]
    )
    return pa.schema(
        [
            pa.field("schema_version", pa.int16(), nullable=False),
            pa.field("execution_id", pa.string(), nullable=False),
            pa.field("group_id", pa.string(), nullable=False),
            pa.field("index", pa.int32(), nullable=False),
            pa.field("leaf_call_id", pa.string()),
            pa.field("agent_id", pa.string()),
            pa.field("role_class", pa.string(), nullable=False),
            pa.field("placeholder", pa.bool_(), nullable=False),
            pa.field("token_ids", pa.list_(pa.field("element", pa.int32(), nullable=False)), nullable=False),
            pa.field("target_mask", pa.list_(pa.field("element", pa.int8(), nullable=False)), nullable=False),
            pa.field(
                "behavior_logprobs",
                pa.list_(pa.field("element", pa.float64(), nullable=False)),
                nullable=False,
            ),
            pa.field("weight_versions", pa.list_(pa.field("element", span, nullable=False)), nullable=False),
            pa.field("temperatures", pa.list_(pa.field("element", pa.float64(), nullable=False))),
        ],
        metadata={FORMAT_KEY: b"trajectories", VERSION_KEY: b"1"},
    )


def write_parquet(path: str | os.PathLike[str], trajectories: Iterable[Trajectory]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    rows = [t.model_dump() for t in trajectories]
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path)


def read_parquet(path: str | os.PathLike[str]) -> list[Trajectory]:
    import pyarrow.parquet as pq

    # one file, read as one: read_table goes through pyarrow.dataset, which imports pandas (2.3 s of a process)
    with pq.ParquetFile(path) as source:
        table = source.read()
    meta = table.schema.metadata or {}
    if meta.get(FORMAT_KEY) != b"trajectories":
        raise ValueError(f"{path}: not a gyre-tito trajectory file (missing {FORMAT_KEY.decode()} metadata)")
    return [Trajectory.model_validate(row) for row in table.to_pylist()]


def write_trajectories(path: str | os.PathLike[str], trajectories: Iterable[Trajectory]) -> None:
    suffix = Path(path).suffix
    if suffix == ".jsonl":
        write_jsonl(path, trajectories)
    elif suffix == ".parquet":
        write_parquet(path, trajectories)
    else:
        raise ValueError(f"{path}: unknown trajectory file type {suffix!r}; use .jsonl or .parquet")


def read_trajectories(path: str | os.PathLike[str]) -> list[Trajectory]:
    suffix = Path(path).suffix
    if suffix == ".jsonl":
        return read_jsonl(path)
    if suffix == ".parquet":
        return read_parquet(path)
    raise ValueError(f"{path}: unknown trajectory file type {suffix!r}; use .jsonl or .parquet")


def export_execution(
    records_dir: str | os.PathLike[str],
    execution_id: str,
    group_id: str,
    out: str | os.PathLike[str],
    config: SelectionConfig | None = None,
    *,
    no_work: bool = False,
) -> list[Trajectory]:
    """Select and write one execution's trajectories (the placeholder when ``no_work``); return them."""
    if no_work:
        trajectories = [placeholder_trajectory(execution_id, group_id)]
    else:
        path = log_path(records_dir, execution_id)
        if not path.is_file():
            raise FileNotFoundError(f"no record log for execution {execution_id!r} in {records_dir}")
        # Read-only: the proxy may still hold the log open; a partial last line is simply not included.
        tree = ExecutionTree.from_records(execution_id, read_log(path).records)
        trajectories = select_trajectories(tree, group_id, config)
    write_trajectories(out, trajectories)
    return trajectories
