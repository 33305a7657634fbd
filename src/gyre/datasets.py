"""Task datasets: a documented file format for agent tasks, a loader whose errors name the line and the field.

Format
------
One task per JSON object, in any of:

- a **JSONL** file (``*.jsonl``): one object per line (blank lines and lines starting with ``#`` are skipped);
- a **Parquet** file (``*.parquet``): one row per task, the same columns; nested fields (``workspace``, ``scoring``,
  ``harness``, ``metadata``) are structs or JSON strings;
- a **local Hugging Face dataset folder**: ``datasets``' ``save_to_disk`` layout (``state.json`` listing Arrow
  files) or a folder of ``*.jsonl`` / ``*.parquet`` data files (``data/`` or the folder itself), read in path order.

Fields of a task (unknown fields are refused):

=====================  ====================================================================================
``query_id``           string, unique in the file (1-128 printable characters)
``prompt``             string: the task as the harness receives it
``workspace``          the initial workspace, one of ``{"dir": PATH}`` (a folder copied per execution),
                       ``{"tar": PATH}`` (a tarball extracted per execution; no absolute or ``..`` members),
                       ``{"git": REPO, "commit": SHA}`` (a clone checked out at that commit), or ``{"empty": true}``
``scoring``            ``{"kind": "exec", "command": [...], "files": PATH, "score_from": "score_file"|"exit_code"}``
                       (gyre-eval's executable check; ``files`` is a folder kept **outside** the workspace, passed
                       to the check as ``$GYRE_CHECK_FILES`` and substituted for ``{files}`` in ``command``),
                       ``{"kind": "judge", "rubric": TEXT}``, or ``{"kind": "python", "factory": "module:attr",
                       "options": {...}}`` (a Python evaluator: gyre-eval's plug-in, built in its service as
                       ``factory(**options)``; the module must be importable there, e.g. by ``PYTHONPATH``)
``harness_timeout_s``  number > 0: the task's deadline (the harness is stopped, its work is still assessed)
``overall_budget_s``   number >= ``harness_timeout_s``: execution plus evaluation retries
``harness``            optional: a harness name (``builtin``, ``command``, ``claude-code``) or
                       ``{"kind": NAME, ...options}`` overriding the run's harness for this task
``metadata``           optional object, kept as is
=====================  ====================================================================================

Relative paths resolve against the folder of the dataset file. Every error is one line, ``FILE:LINE: field: what``
(``FILE:row N`` for Parquet/Arrow rows); ``gyre tasks validate FILE`` prints it and exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

log = logging.getLogger("gyre")

__all__ = [
    "DirWorkspace",
    "EmptyWorkspace",
    "ExecScoring",
    "GitWorkspace",
    "JudgeScoring",
    "PythonScoring",
    "TarWorkspace",
    "TaskFileError",
    "TaskQuery",
    "TaskSpec",
    "evaluator_config",
    "load_tasks",
    "setup_workspace",
    "task_queries",
]


class TaskFileError(ValueError):
    """A task file that cannot be used; ``str(err)`` is one line naming the file, line (or row) and field."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DirWorkspace(_Model):
    dir: str = Field(min_length=1)


class TarWorkspace(_Model):
    tar: str = Field(min_length=1)


class GitWorkspace(_Model):
    git: str = Field(min_length=1)
    commit: str = Field(pattern=r"^[0-9a-fA-F]{7,40}$")


class EmptyWorkspace(_Model):
    empty: Literal[True]


class ExecScoring(_Model):
    kind: Literal["exec"]
    command: list[str] = Field(min_length=1)
    files: str | None = None
    """Folder of check files (hidden tests...) outside the workspace; the check sees it as $GYRE_CHECK_FILES."""
    score_from: Literal["score_file", "exit_code"] = "score_file"
    timeout_s: float = Field(600.0, gt=0)


class JudgeScoring(_Model):
    kind: Literal["judge"]
    rubric: str = Field(min_length=1)


class PythonScoring(_Model):
    kind: Literal["python"]
    factory: str = Field(min_length=3, pattern=r"^[\w.]+:[\w.]+$")
    """"package.module:callable" returning a gyre-eval Evaluator (gyre_eval.evaluator), called with `options`."""
    options: dict[str, Any] = Field(default_factory=dict)


class HarnessOverride(_Model):
    model_config = ConfigDict(frozen=True, extra="allow")
    kind: Literal["builtin", "command", "claude-code"]


Workspace = DirWorkspace | TarWorkspace | GitWorkspace | EmptyWorkspace
Scoring = Annotated[ExecScoring | JudgeScoring | PythonScoring, Field(discriminator="kind")]


class TaskSpec(_Model):
    query_id: str = Field(min_length=1, max_length=128)
    prompt: str = Field(min_length=1)
    workspace: Workspace
    scoring: Scoring
    harness_timeout_s: float = Field(gt=0)
    overall_budget_s: float = Field(gt=0)
    harness: HarnessOverride | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("query_id")
    @classmethod
    def _printable(cls, v: str) -> str:
        if not v.isprintable() or "/" in v or v in (".", ".."):
            raise ValueError("must be printable, without '/', and not '.' or '..'")
        return v

    @field_validator("harness", mode="before")
    @classmethod
    def _name(cls, v: Any) -> Any:
        return {"kind": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _budgets(self) -> TaskSpec:
        if self.harness_timeout_s > self.overall_budget_s:
            raise ValueError(
                f"harness_timeout_s ({self.harness_timeout_s:g}) > overall_budget_s ({self.overall_budget_s:g}): "
                "the budget must cover the harness and the evaluation"
            )
        return self


def _field_of(err: dict[str, Any]) -> str:
    loc = [str(x) for x in err["loc"] if not str(x).endswith("Workspace") and x not in ("exec", "judge")]
    return ".".join(loc)


def _describe(e: ValidationError) -> str:
    errs = e.errors()
    if all(str(x).endswith("Workspace") for err in errs for x in err["loc"][1:2]) and errs[0]["loc"][:1] == (
        "workspace",
    ):
        return 'workspace: must be one of {"dir": PATH}, {"tar": PATH}, {"git": REPO, "commit": SHA}, {"empty": true}'
    err = errs[0]
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        msg = "required field missing"
    elif err["type"] == "extra_forbidden":
        msg = "unknown field"
    field = _field_of(err)
    return f"{field}: {msg}" if field else msg


def _json_fields(row: dict[str, Any]) -> dict[str, Any]:
    """Parquet/Arrow rows may hold nested fields as JSON strings; struct columns drop their null members."""
    out = {}
    for k, v in row.items():
        if v is None:
            continue
        if k in ("workspace", "scoring", "harness", "metadata") and isinstance(v, str) and v[:1] in "{[":
            v = json.loads(v)
        if isinstance(v, dict):
            v = {kk: vv for kk, vv in v.items() if vv is not None}
        out[k] = v
    return out


def _rows(path: Path) -> list[tuple[str, dict[str, Any] | str]]:
    """(location, object or a parse error) for every task in the file or folder."""
    if path.is_dir():
        state = path / "state.json"
        if state.is_file():
            files = [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
        else:
            base = path / "data" if (path / "data").is_dir() else path
            files = sorted(p for p in base.rglob("*") if p.suffix in (".jsonl", ".parquet", ".arrow"))
        if not files:
            raise TaskFileError(
                f"{path}: no data files (*.jsonl, *.parquet, *.arrow or state.json) in the folder"
            )
        return [r for f in files for r in _rows(f)]
    if not path.is_file():
        raise TaskFileError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        rows: list[tuple[str, dict[str, Any] | str]] = []
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            loc = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                rows.append((loc, f"not valid JSON ({e.msg} at column {e.colno})"))
                continue
            rows.append(
                (
                    loc,
                    obj
                    if isinstance(obj, dict)
                    else f"a task must be a JSON object, got {type(obj).__name__}",
                )
            )
        return rows
    if path.suffix in (".parquet", ".arrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            if path.suffix == ".parquet":
                table = pq.read_table(path)
            else:
                with pa.memory_map(str(path)) as src:
                    try:
                        table = pa.ipc.open_stream(src).read_all()
                    except pa.ArrowInvalid:
                        table = pa.ipc.open_file(src).read_all()
        except (pa.ArrowException, OSError) as e:
            raise TaskFileError(f"{path}: not a readable {path.suffix[1:]} file ({e})") from e
        return [(f"{path}:row {i}", _json_fields(r)) for i, r in enumerate(table.to_pylist())]
    raise TaskFileError(f"{path}: unknown task file type (use .jsonl, .parquet, or a dataset folder)")


def _resolve(base: Path, p: str) -> Path:
    q = Path(p).expanduser()
    return (q if q.is_absolute() else base / q).resolve()


def _check_paths(task: TaskSpec, base: Path) -> str | None:
    ws = task.workspace
    ws_path = None
    if isinstance(ws, DirWorkspace):
        ws_path = _resolve(base, ws.dir)
        if not ws_path.is_dir():
            return f"workspace.dir: no such folder: {ws_path}"
    elif isinstance(ws, TarWorkspace):
        t = _resolve(base, ws.tar)
        if not t.is_file():
            return f"workspace.tar: no such file: {t}"
    elif isinstance(ws, GitWorkspace) and not ws.git.startswith(("http://", "https://", "git@", "ssh://")):
        g = _resolve(base, ws.git)
        if not g.exists():
            return f"workspace.git: no such repository: {g}"
    sc = task.scoring
    if isinstance(sc, ExecScoring) and sc.files is not None:
        f = _resolve(base, sc.files)
        if not f.is_dir():
            return f"scoring.files: no such folder: {f}"
        if ws_path is not None and (f == ws_path or ws_path in f.parents):
            return f"scoring.files: {f} lies inside the workspace; the check's files must be kept outside it"
    return None


def load_tasks(path: str | Path, *, check_paths: bool = True) -> list[TaskSpec]:
    """Every task of a JSONL/Parquet file or dataset folder, with relative paths made absolute; raises
    `TaskFileError` (one line: file, line or row, field) at the first problem."""
    path = Path(path)
    base = (path if path.is_dir() else path.parent).resolve()
    tasks: list[TaskSpec] = []
    seen: dict[str, str] = {}
    for loc, obj in _rows(path):
        if isinstance(obj, str):
            raise TaskFileError(f"{loc}: {obj}")
        try:
            task = TaskSpec.model_validate(obj)
        except ValidationError as e:
            raise TaskFileError(f"{loc}: {_describe(e)}") from None
        if task.query_id in seen:
            raise TaskFileError(f"{loc}: query_id: {task.query_id!r} already used at {seen[task.query_id]}")
        seen[task.query_id] = loc
        if check_paths and (problem := _check_paths(task, base)):
            raise TaskFileError(f"{loc}: {problem}")
        tasks.append(_absolute(task, base))
    if not tasks:
        raise TaskFileError(f"{path}: no tasks in the file")
    return tasks


def _absolute(task: TaskSpec, base: Path) -> TaskSpec:
    ws = task.workspace
    if isinstance(ws, DirWorkspace):
        ws = DirWorkspace(dir=str(_resolve(base, ws.dir)))
    elif isinstance(ws, TarWorkspace):
        ws = TarWorkspace(tar=str(_resolve(base, ws.tar)))
    elif isinstance(ws, GitWorkspace) and not ws.git.startswith(("http://", "https://", "git@", "ssh://")):
        ws = GitWorkspace(git=str(_resolve(base, ws.git)), commit=ws.commit)
    sc = task.scoring
    if isinstance(sc, ExecScoring) and sc.files is not None:
        sc = sc.model_copy(update={"files": str(_resolve(base, sc.files))})
    return task.model_copy(update={"workspace": ws, "scoring": sc})


def setup_workspace(task: TaskSpec, dest: Path) -> Path:
    """Materialize the task's initial workspace at `dest` (a fresh folder per execution)."""
    dest = Path(dest)
    ws = task.workspace
    if isinstance(ws, DirWorkspace):
        shutil.copytree(ws.dir, dest, symlinks=True, dirs_exist_ok=True)
    elif isinstance(ws, TarWorkspace):
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(ws.tar) as tf:
            tf.extractall(dest, filter="data")  # refuses absolute paths, '..', devices and links out of dest
    elif isinstance(ws, GitWorkspace):
        dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "clone", "-q", ws.git, str(dest)], check=True, capture_output=True)
        subprocess.run(["git", "-C", str(dest), "checkout", "-q", ws.commit], check=True, capture_output=True)
    else:
        dest.mkdir(parents=True, exist_ok=True)
    return dest


def evaluator_config(task: TaskSpec) -> dict[str, Any]:
    """The gyre-eval evaluator for the task's scoring rule (an `exec` or `plugin` config; a judge needs the run's
    endpoint)."""
    sc = task.scoring
    if isinstance(sc, JudgeScoring):
        return {"kind": "judge", "rubric": sc.rubric}
    if isinstance(sc, PythonScoring):
        return {"kind": "plugin", "factory": sc.factory, "options": dict(sc.options)}
    env = {"GYRE_CHECK_FILES": sc.files} if sc.files else {}
    command = [a.replace("{files}", sc.files) for a in sc.command] if sc.files else list(sc.command)
    return {
        "kind": "exec",
        "command": command,
        "score_from": sc.score_from,
        "sandbox": {"timeout_s": sc.timeout_s, "env": env},
    }


def unreadable_check_files(tasks: list[TaskSpec]) -> list[str]:
    """Warnings, one line per check-files folder an unprivileged check cannot read. Run as root, gyre-eval drops
    each check to its own unprivileged user (gyre_eval.sandbox `run_as`), which reads `$GYRE_CHECK_FILES` in
    place: the folder must be readable and every folder above it enterable by others (`chmod o+rx`)."""
    if os.geteuid() != 0:
        return []  # the check runs as this same user
    out: list[str] = []
    for folder in sorted(
        {t.scoring.files for t in tasks if isinstance(t.scoring, ExecScoring) and t.scoring.files}
    ):
        path = Path(folder)
        for p in (path, *path.parents):
            need = stat.S_IXOTH | (stat.S_IROTH if p == path else 0)
            if p.stat().st_mode & need != need:
                out.append(
                    f"warning: scoring.files {path}: checks run as an unprivileged user, who cannot "
                    f"{'read' if p == path else 'enter'} {p} (mode {p.stat().st_mode & 0o777:o}); "
                    "every assessment would fail: chmod o+rx"
                )
                break
    return out


def validate_main(path: str) -> int:
    """`gyre tasks validate FILE`: one line, exit status 0 (valid) or 1 (and a warning line per check-files
    folder that checks could not read)."""
    import sys

    from gyre.harbor_tasks import is_harbor_path, load_harbor_tasks

    if is_harbor_path(path):  # Harbor task folders: refused ones name their reason
        try:
            print(f"{path}: {len(load_harbor_tasks(path))} Harbor tasks OK")
        except TaskFileError as e:
            print(str(e), file=sys.stderr)
            return 1
        return 0
    try:
        tasks = load_tasks(path)
    except TaskFileError as e:
        print(str(e), file=sys.stderr)
        return 1
    for warning in unreadable_check_files(tasks):
        print(warning, file=sys.stderr)
    print(f"{path}: {len(tasks)} tasks OK")
    return 0


class TaskQuery:
    """A dataset task as the controller uses a query: `query_id`, `prompt`, and how to launch it (workspace setup,
    harness override, deadline, budget) and score it (a gyre-eval evaluator config)."""

    def __init__(self, task: TaskSpec) -> None:
        self.task = task
        self.query_id = task.query_id
        self.prompt = task.prompt

    def launch_options(self) -> dict[str, Any]:
        """Keyword arguments for `ExecutionRunner.run`."""
        from functools import partial

        harness = self.task.harness.model_dump() if self.task.harness is not None else None
        return {
            "setup": partial(setup_workspace, self.task),
            "harness": harness,
            "harness_timeout_s": self.task.harness_timeout_s,
            "overall_budget_s": self.task.overall_budget_s,
        }

    def evaluator(self) -> dict[str, Any]:
        return evaluator_config(self.task)


def task_queries(path: str | Path, limit: int | None = None) -> list[Any]:
    """The run's queries from a task file (the first `limit`), or from Harbor task folders (gyre.harbor_tasks)."""
    from gyre.harbor_tasks import harbor_queries, is_harbor_path

    if is_harbor_path(path):
        return harbor_queries(path, limit)
    tasks = load_tasks(path)[:limit]
    for warning in unreadable_check_files(tasks):
        log.warning("%s", warning)
    return [TaskQuery(t) for t in tasks]
