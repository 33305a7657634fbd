"""Run a command against a private copy of a preserved workspace, contained.

Always enforced: a private copy per run (the preserved workspace is never touched), its own session/process group
killed as a group on the wall-clock timeout, CPU-time, address-space, file-size and core rlimits, a scrubbed
environment (no inherited variables, so no credentials), stdout/stderr to files.
With namespace isolation (root, or unprivileged user namespaces): no network (an empty network namespace), every
mount read-only except the sandbox directory, a private PID namespace whose processes all die with the check, and no
privileges (root drops to ``run_as``; otherwise a nested user namespace). ``isolation="auto"`` uses it when a probe
succeeds and records which guarantees held in every result; ``"required"`` refuses to run without it.
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

from pydantic import BaseModel, ConfigDict, Field

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
    scratch_dir: str | None = None
    """Where private copies are made (default: the system temp directory)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the check (the parent's environment is never inherited)."""


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


class SandboxError(Exception):
    """The sandbox could not be set up (never a verdict on the artifact)."""


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
        try:
            work = root / "work"
            await asyncio.to_thread(_private_copy, workspace, work)
            for sub in ("tmp", "home", "out"):
                (root / sub).mkdir()
            drop = isolate and os.geteuid() == 0 and self.config.run_as is not None
            uid = self.config.run_as
            if drop and uid == "per-run":
                lease = await asyncio.to_thread(_lease_uid, *self.config.uid_range, self.config.scratch_dir)
                uid = lease[0]
            if drop:
                await asyncio.to_thread(_chown_tree, root, uid)
            return await self._spawn(argv, root, work, timeout, isolate, drop, uid if drop else None)
        finally:
            await asyncio.to_thread(shutil.rmtree, root, True)
            os.close(owner)  # after the copy is gone: a sweep never removes a live sandbox
            if lease is not None:
                os.close(lease[1])

    async def _spawn(
        self,
        argv: list[str],
        root: Path,
        work: Path,
        timeout: float,
        isolate: bool,
        drop: bool,
        uid: int | None,
    ) -> SandboxResult:
        cfg = self.config
        score_path = root / "out" / "score"
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(root / "home"),
            "TMPDIR": str(root / "tmp"),
            "GYRE_WORKSPACE": str(work),
            "GYRE_SCORE_FILE": str(score_path),
            **cfg.env,
        }
        spec = {
            "argv": argv,
            "cwd": str(work),
            "env": env,
            "root": str(root),
            "isolate": isolate,
            "run_as": uid if drop else (None if cfg.run_as == "per-run" else cfg.run_as),
            "limits": {
                "cpu_s": cfg.cpu_s,
                "memory_bytes": cfg.memory_bytes,
                "file_bytes": cfg.file_bytes,
                "nproc": cfg.max_processes if drop else None,
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
        returncode = proc.returncode
        if "signal:" in setup:  # the namespace's init reports a check killed by a signal
            returncode = -int(setup.rsplit("signal:", 1)[1].strip() or 0)
            setup = setup.split("\n", 1)[0]
        if not timed_out and setup != "ok":
            raise SandboxError(
                f"sandbox child exited {proc.returncode} before running the check: {_tail(err_path)}"
            )
        score = score_path.read_text(errors="replace")[:_TAIL] if score_path.is_file() else None
        return SandboxResult(
            returncode=None if timed_out else returncode,
            timed_out=timed_out,
            stdout_tail=_tail(out_path),
            stderr_tail=_tail(err_path),
            score_file=score,
            wall_s=wall,
            guarantees=self.guarantees(),
        )


_LOCKS = "gyre-sbx-locks"


def _lock_dir(scratch_dir: str | None) -> Path:
    d = Path(scratch_dir or tempfile.gettempdir()) / _LOCKS
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _new_root(scratch_dir: str | None) -> tuple[Path, int]:
    """A fresh sandbox root and the fd of its owner lock (flock'ed until the root is removed)."""
    root = Path(tempfile.mkdtemp(prefix="gyre-sbx-", dir=scratch_dir)).resolve()
    fd = os.open(_lock_dir(scratch_dir) / (root.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return root, fd


def sweep_stale_sandboxes(scratch_dir: str | None) -> list[str]:
    """Remove sandbox roots whose owner died (its lock is free): a crashed service leaks no private copies."""
    removed = []
    locks = _lock_dir(scratch_dir)
    for lock in locks.glob("gyre-sbx-*.lock"):
        fd = os.open(lock, os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live sandbox
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


def _private_copy(src: Path, dst: Path) -> None:
    # symlinks=True: a link in the artifact stays a link (pointing outside is harmless under read-only mounts).
    shutil.copytree(src, dst, symlinks=True, copy_function=_copy_regular)


def _copy_regular(src: str, dst: str) -> None:
    """Copy regular files only: opening a FIFO or device left in an artifact would block or read a device."""
    if stat.S_ISREG(os.lstat(src).st_mode):
        shutil.copy2(src, dst)


def _chown_tree(root: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, uid)
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


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


def _probe(config: SandboxConfig) -> tuple[bool, str | None]:
    """Run ``true`` fully isolated once; any failure means this platform cannot isolate."""
    root = Path(tempfile.mkdtemp(prefix="gyre-sbx-probe-", dir=config.scratch_dir)).resolve()
    try:
        os.chmod(root, 0o755)
        spec = {
            "argv": ["true"],
            "cwd": str(root),
            "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            "root": str(root),
            "isolate": True,
            "run_as": 65534 if config.run_as == "per-run" else config.run_as,
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
