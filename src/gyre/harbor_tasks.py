"""Harbor's task folders as Gyre tasks: ``[tasks] file = "path/to/harbor-tasks"`` runs them in ``gyre run``, each
scored by its own verifier (``tests/test.sh``).

A Harbor task (Harbor 0.25, the Terminal-Bench 2 framework) is a folder: ``task.toml`` (verifier, agent and
environment settings), ``instruction.md`` (the prompt), ``tests/test.sh`` (the verifier: it writes
``/logs/verifier/reward.txt`` or ``reward.json``), ``solution/solve.sh`` (the reference, for Harbor's oracle agent) and
``environment/`` (a Dockerfile or compose file). ``[tasks] file`` names one task folder or a folder of them (each
subfolder holding a ``task.toml``, taken in name order); the query id is the folder's name.

Gyre runs a task without a container: its harness works in a fresh workspace (the agent's working directory, which
Harbor's verifier sees at the task's workdir, ``/app`` by default), and the verifier runs in gyre-eval's sandbox with
``/app``, ``/tests`` and ``/logs`` bound where it expects them (`gyre.harbor_verify`). So only a task whose
environment is a stock userland can run: no ``docker_image`` in ``task.toml``, no compose file, and a Dockerfile whose
only instructions are ``FROM`` a stock base (``STOCK_BASES``), ``WORKDIR``, ``COPY`` of files of ``environment/``
into the workdir (they fill the initial workspace) and the inert ``LABEL``/``CMD``/``ENTRYPOINT``/``EXPOSE``/``ARG``.
Any other task is refused with one line saying it needs a container runtime with its image (Terminal-Bench's own
tasks are such). Multi-step tasks, GPUs, MCP servers and a separate verifier environment are refused too. The
verifier runs without network: a ``test.sh`` that downloads its test tools cannot score here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tomllib
from dataclasses import dataclass
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gyre.datasets import TaskFileError

__all__ = [
    "STOCK_BASES",
    "HarborTask",
    "HarborTaskError",
    "HarborTaskQuery",
    "harbor_queries",
    "is_harbor_path",
    "load_harbor_task",
    "load_harbor_tasks",
    "verifier_config",
]

STOCK_BASES = ("ubuntu", "debian", "python", "buildpack-deps")
"""Base images whose userland the host's ``/usr`` stands in for (their packages are assumed, not checked)."""
_INERT = {"LABEL", "CMD", "ENTRYPOINT", "EXPOSE", "ARG", "MAINTAINER", "STOPSIGNAL"}
_RESERVED = {
    "",
    "usr",
    "etc",
    "bin",
    "sbin",
    "lib",
    "lib64",
    "proc",
    "dev",
    "sys",
    "run",
    "tmp",
    "tests",
    "logs",
    "solution",
    "var",
    "boot",
    "root",
    "home",
}
_QUERY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class HarborTaskError(TaskFileError):
    """A Harbor task Gyre cannot run; ``str(err)`` is one line naming the task folder and the reason."""


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")  # Harbor's schema has many more fields; the ones read are typed


class _Verifier(_Loose):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    environment: dict[str, Any] | None = None


class _Agent(_Loose):
    timeout_sec: float | None = Field(None, gt=0)


class _Environment(_Loose):
    docker_image: str | None = None
    os: str = "linux"
    gpus: int | None = Field(None, ge=0)
    tpu: dict[str, Any] | None = None
    mcp_servers: list[Any] = Field(default_factory=list)
    workdir: str | None = None


class _TaskToml(_Loose):
    verifier: _Verifier = Field(default_factory=_Verifier)
    agent: _Agent = Field(default_factory=_Agent)
    environment: _Environment = Field(default_factory=_Environment)
    steps: list[Any] | None = None


@dataclass(frozen=True)
class HarborTask:
    """One Harbor task folder as Gyre runs it."""

    query_id: str
    path: Path
    prompt: str
    workdir: str
    """Where the verifier sees the workspace (the task's working directory, ``/app`` by default)."""
    tests: Path
    copies: tuple[tuple[Path, str], ...]
    """(file or folder of environment/, path relative to the workspace, "/"-ended for a folder): the Dockerfile's COPY
    lines, which make the initial workspace."""
    agent_timeout_s: float
    verifier_timeout_s: float
    verifier_env: tuple[tuple[str, str], ...]

    def setup(self, workspace: Path) -> None:
        """Materialize the initial workspace (the Dockerfile's COPY lines) at `workspace`."""
        workspace.mkdir(parents=True, exist_ok=True)
        for src, dest in self.copies:
            rel = PurePosixPath(dest.rstrip("/") or ".")
            # the loader never makes one; never write out of the workspace
            if rel.is_absolute() or ".." in rel.parts:
                raise HarborTaskError(f"{self.path}: COPY destination {dest!r} leaves the workspace")
            target = workspace / rel
            if src.is_dir():
                # links stay links, as COPY keeps them
                shutil.copytree(src, target, symlinks=True, dirs_exist_ok=True)
                continue
            if dest.endswith("/") or rel == PurePosixPath(".") or target.is_dir():
                target = target / src.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _refuse_image(task: Path, why: str) -> HarborTaskError:
    return HarborTaskError(
        f"{task}: needs a container runtime with its image ({why}); Gyre runs Harbor tasks "
        "whose environment is a stock userland only"
    )


def _workdir(task: Path, value: str, where: str) -> str:
    p = PurePosixPath(value)
    if not p.is_absolute() or ".." in p.parts or p.parts[1:2] == () or p.parts[1] in _RESERVED:
        raise HarborTaskError(
            f"{task}: {where}: workdir {value!r} must be an absolute path outside the system's "
            "and Harbor's own folders (e.g. /app)"
        )
    return str(p)


def _dockerfile(task: Path, env_dir: Path) -> tuple[str | None, list[tuple[Path, str]]]:
    """(WORKDIR, COPY lines as (absolute source, absolute destination)) of a stock Dockerfile, or refuse it."""
    text = (env_dir / "Dockerfile").read_text(encoding="utf-8", errors="replace")
    lines, cur = [], ""
    for raw in text.splitlines():
        if not cur and raw.lstrip().startswith("#"):
            continue
        cur += raw.rstrip()
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        if cur.strip():
            lines.append(cur.strip())
        cur = ""
    workdir, copies, based = None, [], False
    for line in lines:
        op, _, rest = line.partition(" ")
        op, args = op.upper(), rest.split()
        if op == "FROM":
            image = next((a for a in args if not a.startswith("--")), "")
            head, _, tail = image.split("@")[0].rpartition("/")
            name = f"{head}/{tail.split(':')[0]}" if head else tail.split(":")[0]
            name = name.removeprefix("docker.io/").removeprefix("library/")
            if name not in STOCK_BASES:
                raise _refuse_image(task, f"environment/Dockerfile: FROM {image}")
            based = True
        elif op == "WORKDIR" and len(args) == 1:
            workdir = str(PurePosixPath(workdir or "/") / args[0])
        elif op == "COPY" and len(args) >= 2 and not any(a.startswith(("--", "[")) for a in args):
            *sources, dest = args
            dest = str(PurePosixPath(workdir or "/") / dest) + ("/" if dest.endswith("/") else "")
            for s in sources:
                src = (env_dir / s).resolve()
                if (
                    any(c in s for c in "*?[")
                    or not (src == env_dir or env_dir in src.parents)
                    or not src.exists()
                ):
                    raise _refuse_image(task, f"environment/Dockerfile: COPY {s}: not a file of environment/")
                copies.append((src, dest))
        elif op not in _INERT:
            raise _refuse_image(task, f"environment/Dockerfile: {line[:80]}")
    if not based:
        raise _refuse_image(task, "environment/Dockerfile has no FROM line")
    return workdir, copies


def load_harbor_task(path: str | Path) -> HarborTask:
    """One Harbor task folder, or `HarborTaskError` (one line) when Gyre cannot run it."""
    task = Path(path).resolve()
    config_path = task / "task.toml"
    if not config_path.is_file():
        raise HarborTaskError(f"{task}: no task.toml: not a Harbor task folder")
    if not _QUERY_ID.match(task.name):
        raise HarborTaskError(
            f"{task}: the folder's name is the task's id: letters, digits, '.', '_', '-' only"
        )
    try:
        raw = tomllib.loads(config_path.read_text(encoding="utf-8"))
        cfg = _TaskToml.model_validate(raw)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise HarborTaskError(f"{config_path}: not valid TOML ({e})") from None
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise HarborTaskError(f"{config_path}: {field}: {err['msg']}") from None
    env = cfg.environment
    if env.docker_image:
        raise _refuse_image(task, f"task.toml: environment.docker_image = {env.docker_image!r}")
    if env.os.lower() != "linux":
        raise HarborTaskError(f"{config_path}: environment.os = {env.os!r}: only linux tasks run here")
    if env.gpus or env.tpu:
        raise HarborTaskError(f"{config_path}: the task needs accelerators (environment.gpus/tpu)")
    if env.mcp_servers:
        raise HarborTaskError(f"{config_path}: environment.mcp_servers: MCP servers are not supported")
    if cfg.steps:
        raise HarborTaskError(f"{config_path}: steps: multi-step tasks are not supported")
    if cfg.verifier.environment:
        raise _refuse_image(task, "task.toml: a separate verifier.environment")
    env_dir = (task / "environment").resolve()
    for compose in ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml"):
        if (env_dir / compose).exists():
            raise _refuse_image(task, f"environment/{compose}")
    workdir, copies = _dockerfile(task, env_dir) if (env_dir / "Dockerfile").is_file() else (None, [])
    workdir = _workdir(task, env.workdir or workdir or "/app", "task.toml" if env.workdir else "Dockerfile")
    rel = []
    for src, dest in copies:
        d = PurePosixPath(dest)
        if d != PurePosixPath(workdir) and PurePosixPath(workdir) not in d.parents:
            raise _refuse_image(
                task, f"environment/Dockerfile: COPY to {dest}, outside the workdir {workdir}"
            )
        rel.append((src, str(d.relative_to(workdir)) + ("/" if dest.endswith("/") else "")))
    instruction = task / "instruction.md"
    prompt = (
        instruction.read_text(encoding="utf-8", errors="replace").strip() if instruction.is_file() else ""
    )
    if not prompt:
        raise HarborTaskError(f"{task}: instruction.md is missing or empty")
    tests = task / "tests"
    if not (tests / "test.sh").is_file():
        raise HarborTaskError(f"{task}: tests/test.sh is missing (the verifier)")
    agent_timeout = cfg.agent.timeout_sec or 900.0
    return HarborTask(
        query_id=task.name,
        path=task,
        prompt=prompt,
        workdir=workdir,
        tests=tests,
        copies=tuple(rel),
        agent_timeout_s=agent_timeout,
        verifier_timeout_s=cfg.verifier.timeout_sec,
        verifier_env=tuple(sorted(cfg.verifier.env.items())),
    )


def is_harbor_path(path: str | Path) -> bool:
    """Whether `path` is a Harbor task folder or a folder of them."""
    p = Path(path)
    return p.is_dir() and ((p / "task.toml").is_file() or any(p.glob("*/task.toml")))


def load_harbor_tasks(path: str | Path) -> list[HarborTask]:
    """The task folder `path`, or every task folder in it (name order); refuses the whole set at the first task
    Gyre cannot run."""
    p = Path(path)
    if (p / "task.toml").is_file():
        return [load_harbor_task(p)]
    folders = sorted(d for d in p.iterdir() if (d / "task.toml").is_file())
    if not folders:
        raise HarborTaskError(f"{p}: no Harbor task folders (subfolders with a task.toml)")
    return [load_harbor_task(d) for d in folders]


def verifier_config(task: HarborTask) -> dict[str, Any]:
    """gyre-eval's exec check running the task's verifier (`gyre.harbor_verify`). Its sandbox runs without gyre-eval's
    own namespaces (bubblewrap makes the verifier's, with the paths it expects; nested in gyre-eval's, bubblewrap
    could not map its user namespace) and keeps the rest: a private copy, the process-group kill on the timeout, the
    rlimits and the per-check cgroup. No fail code: every outcome but a reward is a failed attempt, never a zero."""
    from gyre import harbor_verify

    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    spec = {"workdir": task.workdir, "env": dict(task.verifier_env)}
    return {
        "kind": "exec",
        "command": [python, "-I", "-c", Path(harbor_verify.__file__).read_text(), json.dumps(spec)],
        "score_from": "score_file",
        "fail_codes": [],
        "sandbox": {
            "timeout_s": task.verifier_timeout_s
            + 30,  # bubblewrap's start and the copy on top of test.sh's own
            "isolation": "off",
            "env": {"GYRE_CHECK_FILES": str(task.tests)},
        },
    }


class HarborTaskQuery:
    """A Harbor task as the controller uses a query (the same surface as `gyre.datasets.TaskQuery`)."""

    def __init__(self, task: HarborTask) -> None:
        self.task = task
        self.query_id = task.query_id
        self.prompt = task.prompt

    def launch_options(self) -> dict[str, Any]:
        """Keyword arguments for `ExecutionRunner.run`: the run's harness, the task's agent timeout, a budget covering
        two verifier attempts, and the task's workdir (the sandboxed harness works there, as the verifier does)."""
        return {
            "setup": partial(HarborTask.setup, self.task),
            "harness": None,
            "harness_timeout_s": self.task.agent_timeout_s,
            "overall_budget_s": self.task.agent_timeout_s + 2 * (self.task.verifier_timeout_s + 30),
            "workdir": self.task.workdir,  # a sandboxed harness sees its workspace where the instruction says
        }

    def evaluator(self) -> dict[str, Any]:
        return verifier_config(self.task)


def harbor_queries(path: str | Path, limit: int | None = None) -> list[HarborTaskQuery]:
    """The run's queries from Harbor task folders (the first `limit`)."""
    if shutil.which("bwrap") is None or (os.geteuid() == 0 and shutil.which("setpriv") is None):
        raise HarborTaskError(
            f"{path}: Harbor verifiers run under bubblewrap (and setpriv, run by root): "
            "apt-get install bubblewrap util-linux"
        )
    return [HarborTaskQuery(t) for t in load_harbor_tasks(path)[:limit]]
