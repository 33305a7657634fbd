"""`gyre-tito export`: a run's or a store's selected trajectories with their rewards joined, as one Parquet file or a
dataset folder, readable without Gyre.

Sources: a run directory (``RUN/records/records/*.tito.jsonl`` and ``RUN/assessments.sqlite``), a proxy store
(``STORE/records/``, ``STORE/executions.jsonl``), or a folder of record logs. Record logs are only read (a damaged
log is reported and skipped, never repaired). Rewards come from gyre-eval's store (``assessments.sqlite``, read with
``sqlite3``, read-only): the designated assessment of each execution; ``valid`` gives its score, ``no_work`` a 0.0
reward on a placeholder trajectory, ``unresolved`` (or none) leaves the execution out unless ``include_unrewarded``.

Columns: the trajectory columns of ``gyre_tito.export`` plus ``reward`` (float64, null when unrewarded) and
``assessment_status`` (``valid`` / ``no_work`` / ``unresolved`` / ``none``). ``format="parquet"`` writes one file;
``format="dataset"`` writes ``OUT/data/train-00000-of-00001.parquet`` and ``OUT/README.md`` (loadable with
``datasets.load_dataset("parquet", data_dir="OUT/data")`` or plain pyarrow).

``per_step=True`` (a run directory only) groups the rows by the optimizer step that trained them, read from the run's
``metrics/steps.jsonl`` (each step lists its groups; the step number is the policy version it produced): one file
per step, ``OUT/step-00001.parquet`` (``format="parquet"``: OUT is a folder) or ``OUT/data/step-00001.parquet``,
with a ``step`` column (int32). Executions of groups no step trained (cancelled, or still running at the end) are
left out and counted in ``skipped``.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import orjson

from gyre_tito.errors import RecordLogCorrupt
from gyre_tito.materialize import placeholder_trajectory, select_trajectories
from gyre_tito.records import LOG_SUFFIX, read_log
from gyre_tito.selection import SelectionConfig
from gyre_tito.tree import ExecutionTree

__all__ = ["ExportSummary", "export_dataset", "find_sources"]


class ExportSummary(dict):
    """{"executions", "trajectories", "skipped": {execution_id: reason}, "out"}."""


def find_sources(source: str | os.PathLike[str]) -> tuple[Path, Path | None, Path | None]:
    """(record-log folder, assessments.sqlite or None, executions.jsonl registry or None) of a run, store or folder."""
    src = Path(source)
    for records, base in (
        (src / "records" / "records", src / "records"),
        (src / "records", src),
        (src, None),
    ):
        if records.is_dir() and any(p.name.endswith(LOG_SUFFIX) for p in records.iterdir()):
            rewards = src / "assessments.sqlite"
            registry = (base / "executions.jsonl") if base is not None else None
            return (
                records,
                rewards if rewards.is_file() else None,
                (registry if registry is not None and registry.is_file() else None),
            )
    raise FileNotFoundError(f"{src}: no record logs (*{LOG_SUFFIX}) in it, its records/ or records/records/")


def _groups_from_registry(registry: Path | None) -> dict[str, str]:
    groups: dict[str, str] = {}
    if registry is None:
        return groups
    for line in registry.read_bytes().splitlines():
        try:
            ev = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(ev, dict) and ev.get("ev") == "register" and "group_id" in ev:
            groups[str(ev["execution_id"])] = str(ev["group_id"])
    return groups


def _rewards(db: Path | None) -> tuple[dict[str, tuple[str, float | None]], dict[str, str]]:
    """execution -> (status, score) of its designated assessment; execution -> group (gyre-eval's store)."""
    if db is None:
        return {}, {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT execution_id, status, score, final FROM assessments WHERE designated = 1"
        ).fetchall()
        groups = dict(con.execute("SELECT execution_id, group_id FROM executions").fetchall())
    finally:
        con.close()
    out = {}
    for eid, status, score, final in rows:
        out[eid] = (status if final else "unresolved", score if status in ("valid", "no_work") else None)
    return out, groups


def _steps(run: Path) -> dict[str, int]:
    """Group id -> the optimizer step (policy version it produced) that trained it, from RUN/metrics/steps.jsonl."""
    path = run / "metrics" / "steps.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: per-step export needs a run directory with its step metrics")
    out: dict[str, int] = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            step = orjson.loads(line)
            for gid in step["group_ids"]:
                out[gid] = int(step["policy_version"])
    return out


def _rows(trajs: Iterable[Any], reward: float | None, status: str) -> list[dict[str, Any]]:
    return [{**t.model_dump(mode="json"), "reward": reward, "assessment_status": status} for t in trajs]


def export_dataset(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fmt: str = "parquet",
    rewards: str | os.PathLike[str] | None = None,
    executions: Iterable[str] | None = None,
    j_max: int = 5,
    seed: int = 0,
    include_unrewarded: bool = False,
    per_step: bool = False,
) -> ExportSummary:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gyre_tito.export import parquet_schema

    if fmt not in ("parquet", "dataset"):
        raise ValueError(f"format {fmt!r}: must be 'parquet' or 'dataset'")
    records_dir, found_db, registry = find_sources(source)
    db = Path(rewards) if rewards is not None else found_db
    if db is not None and not db.is_file():
        raise FileNotFoundError(f"{db}: no such assessments store")
    by_exec, eval_groups = _rewards(db)
    groups = {**_groups_from_registry(registry), **eval_groups}
    step_of = _steps(Path(source)) if per_step else None
    wanted = set(executions) if executions is not None else None
    config = SelectionConfig(j_max=j_max, seed=seed)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    n_exec = 0
    for log in sorted(records_dir.iterdir()):
        if not log.name.endswith(LOG_SUFFIX):
            continue
        eid = unquote(log.name[: -len(LOG_SUFFIX)])
        if wanted is not None and eid not in wanted:
            continue
        status, reward = by_exec.get(eid, ("none", None))
        if status in ("none", "unresolved") and not include_unrewarded and db is not None:
            skipped[eid] = f"no reward (assessment {status})"
            continue
        gid = groups.get(eid, eid)
        if step_of is not None and gid not in step_of:
            skipped[eid] = f"group {gid} was not trained in any step"
            continue
        if status == "no_work":
            rows += _rows([placeholder_trajectory(eid, gid)], 0.0, status)
            n_exec += 1
            continue
        try:
            tree = ExecutionTree.from_records(eid, read_log(log).records)
        except (RecordLogCorrupt, OSError, ValueError) as e:
            skipped[eid] = f"record log unreadable: {e}"
            continue
        rows += _rows(select_trajectories(tree, gid, config), reward, status)
        n_exec += 1
    base = parquet_schema()
    fields = [
        *base,
        pa.field("reward", pa.float64()),
        pa.field("assessment_status", pa.string(), nullable=False),
    ]
    out = Path(out)
    folder = out if fmt == "parquet" else out / "data"
    if step_of is None:
        parts = {folder / "train-00000-of-00001.parquet" if fmt == "dataset" else out: rows}
    else:
        fields.append(pa.field("step", pa.int32(), nullable=False))
        parts = {}
        for row in rows:
            row["step"] = step_of[row["group_id"]]
            parts.setdefault(folder / f"step-{row['step']:05d}.parquet", []).append(row)
    schema = pa.schema(fields, metadata=base.metadata)
    if step_of is not None:
        folder.mkdir(parents=True, exist_ok=True)  # even when no step has rows
    for target, part in sorted(parts.items()):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        pq.write_table(pa.Table.from_pylist(part, schema=schema), tmp)
        os.replace(tmp, target)
    target = next(iter(parts)) if step_of is None else folder
    if fmt == "dataset":
        (out / "README.md").write_text(
            "# Gyre trajectories\n\nOne row per selected trajectory (gyre-tito export): token_ids, target_mask, "
            "behavior_logprobs, weight_versions, role_class, reward (null: unrewarded), assessment_status.\n"
            f"\n{len(rows)} trajectories from {n_exec} executions.\n"
        )
    return ExportSummary(executions=n_exec, trajectories=len(rows), skipped=skipped, out=str(target))
