"""Run a command against a private copy of a preserved workspace, contained.

Always enforced: a private copy per run (the preserved workspace is never touched), its own session/process group
killed as a group on the wall-clock timeout, CPU-time, address-space, file-size and core rlimits, a scrubbed
environment (no inherited variables, so no credentials), stdout/stderr to files.
With namespace isolation (root, or unprivileged user namespaces): no network (an empty network namespace), every
mount read-only except the sandbox directory, a private PID namespace whose processes all die with the check, and no
privileges (root drops to ``run_as``; otherwise a nested user namespace). ``isolation="auto"`` uses it when a probe
succeeds and records which guarantees held in every result; ``"required"`` refuses to run without it.
Where the service may write cgroups (root): a cgroup per check bounds the total memory and processes of all its
processes. With isolation, the copy lives in a tmpfs of ``disk_bytes``: the total the check can write is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gyre_eval.cgroup import CgroupUsage, CheckCgroup
from gyre_eval.errors import CgroupUnavailable, SandboxError

_TAIL = 4000


class SandboxConfig(BaseModel):
    """Limits and isolation of one sandboxed run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock limit; the whole process group is killed when it passes (also capped by the budget)."""
    cpu_s: int | None = Field(default=600, ge=1)
    """RLIMIT_CPU per process, in CPU seconds."""
    memory_bytes: int | None = Field(default=8 << 30, ge=1 << 20)
    """RLIMIT_AS per process (address space)."""
    file_bytes: int | None = Field(default=1 << 30, ge=1 << 10)
    """RLIMIT_FSIZE: the largest file the check may write."""
    max_processes: int | None = Field(default=512, ge=1)
    """RLIMIT_NPROC, applied only when dropping to ``run_as`` (it counts every process of that uid)."""
    isolation: Literal["auto", "required", "off"] = "auto"
    """Namespace isolation: use when available, insist on it, or never."""
    run_as: int | Literal["per-run"] | None = "per-run"
    """uid/gid a root-run check drops to. ``"per-run"`` (default): a uid of its own for every run, leased from
    ``uid_range`` (so ``max_processes``, which counts per uid, and file permissions never mix two checks); an int: that
    fixed uid for every run; None keeps uid 0 without capabilities."""
    uid_range: tuple[int, int] = (200_000, 4096)
    """(first uid, count) of the per-run uid pool; leases are flock'ed files, so several services share it safely."""
    memory_total_bytes: int | None = Field(default=8 << 30, ge=16 << 20)
    """Total resident memory of all the check's processes and its tmpfs copy (a cgroup per check, swap off). Past it
    the kernel kills processes of this check only, and the attempt fails (never a score)."""
    pids_total: int | None = Field(default=512, ge=8)
    """Total processes and threads of the check, whatever their uid (the check's cgroup; 3 are the sandbox's own)."""
    disk_bytes: int | None = Field(default=2 << 30, ge=1 << 20)
    """Size of the tmpfs holding the private copy, its tmp, home and score file (needs isolation): the total the check
    can write, over any number of files. Filling it fails the attempt. Its pages count against memory_total_bytes."""
    cgroup: Literal["auto", "required", "off"] = "auto"
    """The per-check cgroup: made where the service may write one (else the results say the totals do not hold),
    insisted on, or never made."""
    scratch_dir: str | None = None
    """Where private copies are made (default: the system temp directory)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the check (the parent's environment is never inherited)."""

    @model_validator(mode="after")
    def _copy_fits_in_memory(self) -> SandboxConfig:
        if self.disk_bytes and self.memory_total_bytes and self.disk_bytes >= self.memory_total_bytes:
            raise ValueError(
                f"disk_bytes ({self.disk_bytes}) must be below memory_total_bytes ({self.memory_total_bytes}): "
                "the tmpfs copy's pages count against the check's total memory"
            )
        return self


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    """Exit code; negative for a signal; None when the wall-clock timeout killed it."""
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    score_file: str | None
    """Contents of $GYRE_SCORE_FILE if the check wrote one."""
    wall_s: float
    guarantees: dict[str, bool | str] = field(default_factory=dict)
    usage: CgroupUsage = field(default_factory=CgroupUsage)
    """The check's cgroup events (OOM kills, refused forks) and peak memory; zeros without a cgroup."""
    disk_full: bool = False
    """The tmpfs copy was full when the check ended (a write failed with ENOSPC)."""
    limits: dict[str, int] = field(default_factory=dict)
    """The configured totals the violations below refer to."""
    cgroups: tuple[str, ...] = ()
    """The check's cgroup directories (removed when it ended)."""

    def limit_violation(self) -> str | None:
        """Why the check broke a total limit of its sandbox, or None: such a run is a failed attempt, never a score
        (a check whose worker was OOM-killed may still exit with a fail code)."""
        if self.usage.oom_kills:
            return (
                f"check exceeded its total memory (memory_total_bytes={self.limits.get('memory_total_bytes')}): "
                f"the kernel killed {self.usage.oom_kills} of its processes (out of memory)"
            )
        if self.disk_full:
            return (
                f"check filled its disk (disk_bytes={self.limits.get('disk_bytes')}): "
                "writes failed with ENOSPC (No space left on device)"
            )
        if self.usage.pids_limit_hits:
            return (
                f"check reached its process limit (pids_total={self.limits.get('pids_total')}): "
                f"{self.usage.pids_limit_hits} forks refused"
            )
        return None


class Sandbox:
    """Runs checks under one ``SandboxConfig``. Probes namespace support once, on first use."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._isolate: bool | None = None
        self._probe_error: str | None = None

    # -- isolation support ----------------------------------------------------------------------------------------

    def isolated(self) -> bool:
        """Whether runs get namespace isolation (probing on first call)."""
        if self._isolate is None:
            if self.config.isolation == "off" or not sys.platform.startswith("linux"):
                self._isolate = False
            else:
                self._isolate, self._probe_error = _probe(self.config)
            if self.config.isolation == "required" and not self._isolate:
                raise SandboxError(f"namespace isolation required but unavailable: {self._probe_error}")
        return self._isolate

    def guarantees(self) -> dict[str, bool | str]:
        iso = self.isolated()
        dropped = iso and os.geteuid() == 0 and self.config.run_as is not None
        per_run = self.config.run_as == "per-run"
        return {
            "private_copy": True,
            "process_group_kill": True,
            "rlimits": True,
            "scrubbed_env": True,
            "no_network": iso,
            "no_unix_sockets": iso,
            "read_only_outside_copy": iso,
            "pid_namespace": iso,
            "privileges": ("uid per run" if per_run else "uid " + str(self.config.run_as))
            if dropped
            else ("no capabilities" if iso else "as service"),
            "no_new_privileges": True,
            "dies_with_service": True,
            "disk_cap": f"tmpfs size={self.config.disk_bytes}" if iso and self.config.disk_bytes else False,
            **({"isolation_unavailable": self._probe_error} if not iso and self._probe_error else {}),
        }

    # -- running ----------------------------------------------------------------------------------------------------

    async def run(self, argv: list[str], workspace: Path, deadline: float | None = None) -> SandboxResult:
        """Copy ``workspace`` privately and run ``argv`` in the copy; ``deadline`` (unix time) caps the timeout."""
        if not argv:
            raise SandboxError("empty command")
        isolate = await asyncio.to_thread(self.isolated)
        timeout = self.config.timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - time.time())
        if timeout <= 0:
            raise SandboxError("no time left before the deadline")
        await asyncio.to_thread(sweep_stale_sandboxes, self.config.scratch_dir)
        root, owner = await asyncio.to_thread(_new_root, self.config.scratch_dir)
        lease = None
        cgroup = None
        try:
            drop = isolate and os.geteuid() == 0 and self.config.run_as is not None
            uid = self.config.run_as
            if drop and uid == "per-run":
                lease = await asyncio.to_thread(_lease_uid, *self.config.uid_range, self.config.scratch_dir)
                uid = lease[0]
            cgroup, totals = await asyncio.to_thread(self._cgroup, root.name)
            return await self._spawn(
                argv, workspace, root, timeout, isolate, uid if drop else None, cgroup, totals
            )
        finally:
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)  # kills what is left in it first
            # the lock goes last: no sweep sees a live root
            await asyncio.to_thread(_remove_root, root, owner)
            if lease is not None:
                os.close(lease[1])

    def _cgroup(self, name: str) -> tuple[CheckCgroup | None, dict[str, bool | str]]:
        """The check's cgroup and what it guarantees (or why the totals do not hold)."""
        cfg = self.config
        if cfg.cgroup == "off" or not (cfg.memory_total_bytes or cfg.pids_total):
            return None, {"total_memory": False, "total_processes": False}
        try:
            cg = CheckCgroup.create(name, cfg.memory_total_bytes, cfg.pids_total)
        except CgroupUnavailable as e:
            if cfg.cgroup == "required":
                raise SandboxError(f"a cgroup per check is required but unavailable: {e}") from None
            return None, {"total_memory": f"unavailable: {e}", "total_processes": f"unavailable: {e}"}
        return cg, {
            "total_memory": cg.limits.get("memory", False),
            "total_processes": cg.limits.get("pids", False),
        }

    async def _spawn(
        self,
        argv: list[str],
        workspace: Path,
        root: Path,
        timeout: float,
        isolate: bool,
        uid: int | None,
        cgroup: CheckCgroup | None,
        totals: dict[str, bool | str],
    ) -> SandboxResult:
        cfg = self.config
        score_path = root / "out" / "score"
        work = root / "work"
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(root / "home"),
            "TMPDIR": str(root / "tmp"),
            "GYRE_WORKSPACE": str(work),
            "GYRE_SCORE_FILE": str(score_path),
            **cfg.env,
        }
        tmpfs = isolate and cfg.disk_bytes is not None
        spec = {
            "argv": argv,
            "cwd": str(work),
            "env": env,
            "root": str(root),
            "workspace": str(workspace),
            "score_path": str(score_path),
            "isolate": isolate,
            "run_as": uid if uid is not None else (None if cfg.run_as == "per-run" else cfg.run_as),
            "chown": uid is not None,
            "disk_bytes": cfg.disk_bytes if tmpfs else None,
            "cgroups": cgroup.procs_files() if cgroup else [],
            "limits": {
                "cpu_s": cfg.cpu_s,
                "memory_bytes": cfg.memory_bytes,
                "file_bytes": cfg.file_bytes,
                "nproc": cfg.max_processes if uid is not None else None,
            },
        }
        status_r, status_w = os.pipe()
        fcntl.fcntl(status_r, fcntl.F_SETFL, os.O_NONBLOCK)
        out_path, err_path = root / "stdout", root / "stderr"
        started = time.monotonic()
        try:
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = await asyncio.create_subprocess_exec(
                    *_child_command(),
                    json.dumps(spec),
                    str(status_w),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    pass_fds=(status_w,),
                    start_new_session=True,
                    env={},
                )
            os.close(status_w)
            status_w = -1
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                timed_out = True
            finally:
                # Kill the group even after a normal exit: background processes must not outlive the check.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            wall = time.monotonic() - started
            setup = _read_all(status_r)
        finally:
            os.close(status_r)
            if status_w >= 0:
                os.close(status_w)
        if "error:" in setup:
            raise SandboxError(f"sandbox could not start the check: {setup.split('error:', 1)[1].strip()}")
        # The first line is the setup result; the namespace's init adds "key:value" lines about the ended check.
        head, *lines = setup.split("\n")
        report = dict(line.partition(":")[::2] for line in lines)
        returncode = proc.returncode
        if "signal" in report:  # init reports a check killed by a signal (it cannot re-raise it on itself)
            returncode = -int(report["signal"] or 0)
        if not timed_out and head != "ok":
            raise SandboxError(
                f"sandbox child exited {proc.returncode} before running the check: {_tail(err_path)}"
            )
        if "score" in report:  # read by init inside the namespace, as the check's uid
            score = bytes.fromhex(report["score"]).decode(errors="replace")
        else:
            score = None if isolate else _read_score(score_path)
        usage = await asyncio.to_thread(cgroup.usage) if cgroup else CgroupUsage()
        return SandboxResult(
            returncode=None if timed_out else returncode,
            timed_out=timed_out,
            stdout_tail=_tail(out_path),
            stderr_tail=_tail(err_path),
            score_file=score,
            wall_s=wall,
            guarantees={**self.guarantees(), **totals},
            usage=usage,
            disk_full="disk_full" in report,
            limits={
                k: v
                for k, v in (
                    ("memory_total_bytes", cfg.memory_total_bytes),
                    ("pids_total", cfg.pids_total),
                    ("disk_bytes", cfg.disk_bytes),
                )
                if v
            },
            cgroups=tuple(str(p) for p in cgroup.paths) if cgroup else (),
        )


_LOCKS = "gyre-sbx-locks"


def _lock_dir(scratch_dir: str | None) -> Path:
    d = Path(scratch_dir or tempfile.gettempdir()) / _LOCKS
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _new_root(scratch_dir: str | None) -> tuple[Path, int]:
    """A fresh sandbox root and the fd of its owner lock (flock'ed until the root is removed).

    The lock comes first and the root after it, so a concurrent sweep never sees a root without a held lock. A sweep
    can still take a lock in the instant between its creation and our flock and unlink it; we then hold a lock on an
    unlinked file, which protects nothing, so we check that the path still names our file and try again if not."""
    locks = _lock_dir(scratch_dir)
    while True:
        fd, lock = tempfile.mkstemp(prefix="gyre-sbx-", suffix=".lock", dir=locks)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _names_fd(lock, fd):
            root = Path(scratch_dir or tempfile.gettempdir()).resolve() / Path(lock).name[: -len(".lock")]
            try:
                root.mkdir(mode=0o700)
                return root, fd
            except FileExistsError:  # a stale root whose lock is already gone: leave it to its sweep
                Path(lock).unlink(missing_ok=True)
        os.close(fd)


def _remove_root(root: Path, owner: int) -> None:
    """Remove our root, then our lock file while we still hold it (no sweep can take it), then release it."""
    shutil.rmtree(root, ignore_errors=True)
    lock = _lock_dir(str(root.parent)) / (root.name + ".lock")
    if _names_fd(str(lock), owner):
        lock.unlink(missing_ok=True)
    os.close(owner)


def _names_fd(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (it was not unlinked or replaced meanwhile)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def sweep_stale_sandboxes(scratch_dir: str | None) -> list[str]:
    """Remove sandbox roots whose owner died (its lock is free): a crashed service leaks no private copies.

    Several checks sweep at once (every check sweeps before it starts); a lock another sweep or its owner removed
    between our listing and our open is skipped, and so is one whose path no longer names the file we locked."""
    removed = []
    locks = _lock_dir(scratch_dir)
    for lock in locks.glob("gyre-sbx-*.lock"):
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live sandbox
            if not _names_fd(str(lock), fd):
                continue  # its owner or another sweep removed it after our open
            root = lock.parent.parent / lock.name[: -len(".lock")]
            shutil.rmtree(root, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(root.name)
        finally:
            os.close(fd)
    return removed


def _lease_uid(first: int, count: int, scratch_dir: str | None) -> tuple[int, int]:
    """A uid of the pool no other run holds (an flock per uid, released when the fd closes, even on a crash)."""
    locks = _lock_dir(scratch_dir)
    for uid in range(first, first + count):
        fd = os.open(locks / f"uid-{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise SandboxError(f"all {count} uids of the sandbox pool from {first} are in use")


def _child_command() -> list[str]:
    """The child is a stdlib-only script: isolated mode (-I) and no site (-S) keep its start fast and clean."""
    return [sys.executable, "-I", "-S", str(Path(__file__).with_name("_sandbox_child.py"))]


def _read_score(path: Path) -> str | None:
    """The score file without isolation: never through a symlink, never a FIFO (it could block the service)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, _TAIL).decode(errors="replace")
    finally:
        os.close(fd)


def _read_all(fd: int) -> str:
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


_PROBE_PREFIX = "gyre-sbx-probe-"


def _sweep_stale_probes(scratch: str | None) -> int:
    """Remove the probe folders of processes that are gone (killed mid-probe: their cleanup never ran); their names
    carry the prober's pid. Returns how many were removed."""
    removed = 0
    for path in Path(scratch or tempfile.gettempdir()).glob(f"{_PROBE_PREFIX}*-*"):
        pid = path.name[len(_PROBE_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _probe(config: SandboxConfig) -> tuple[bool, str | None]:
    """Run ``true`` fully isolated once; any failure means this platform cannot isolate."""
    _sweep_stale_probes(config.scratch_dir)
    prefix = f"{_PROBE_PREFIX}{os.getpid()}-"
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=config.scratch_dir)).resolve()
    try:
        os.chmod(root, 0o755)
        spec = {
            "argv": ["true"],
            "cwd": str(root),
            "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            "root": str(root),
            "isolate": True,
            "run_as": 65534 if config.run_as == "per-run" else config.run_as,
            "disk_bytes": config.disk_bytes and 1 << 20,  # the tmpfs mount is probed too
            "chown": os.geteuid() == 0 and config.run_as is not None,
            "limits": {},
        }
        r, w = os.pipe()
        try:
            proc = subprocess.run(
                [*_child_command(), json.dumps(spec), str(w)],
                pass_fds=(w,),
                capture_output=True,
                timeout=30,
                env={},
            )
            os.close(w)
            w = -1
            fcntl.fcntl(r, fcntl.F_SETFL, os.O_NONBLOCK)
            status = _read_all(r)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if status == "ok" and proc.returncode == 0:
            return True, None
        return False, (status or proc.stderr.decode(errors="replace")[-500:] or f"exit {proc.returncode}")
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
