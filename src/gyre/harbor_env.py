"""A Harbor environment on Gyre's sandbox, for Harbor's own agents on tasks that need no image:

    PYTHONPATH=/path/to/gyre/src harbor run -p tasks/harbor -a oracle -e gyre.harbor_env:GyreEnvironment

Harbor (0.25) ships no local backend, but loads any ``BaseEnvironment`` subclass by import path. This one runs each
trial in one long-lived bubblewrap sandbox, laid out as the verifier's (`gyre.harbor_verify`): a root of its own with
the host's ``/usr`` and a few files of ``/etc`` read-only, and a per-trial folder bound at the paths a task expects
(the workdir, ``/app`` by default; ``/tests``, ``/solution``, ``/logs``, ``/installed-agent``; a private ``/tmp``),
no network, its own PID namespace. ``start`` launches the sandbox's idle init; every ``exec`` enters its namespaces
(``nsenter``), so what a command leaves running in the background (Terminus-2's tmux server) lives on until ``stop``,
which kills the whole sandbox. Run by root, every command runs as uid 65534 without capabilities (``setpriv``), and
``user`` is ignored; otherwise as the operator in bubblewrap's user namespace.

Files move through the per-trial folder on the host: uploads go only to the bound paths, downloads copy regular files
and folders and never follow a link (what a command writes is untrusted). The task's Dockerfile is not built: a task
is refused unless `gyre.harbor_tasks` could run it (a stock userland), and its COPY lines fill the workdir at start.

Imports only the standard library, Harbor and `gyre.harbor_tasks`' loader (via Gyre's ``src`` on ``PYTHONPATH``, or an
installed ``gyre-rl``); the module is for Harbor's environment, not Gyre's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path, PurePosixPath

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

from gyre.harbor_verify import PATH as _PATH
from gyre.harbor_verify import SANDBOX_UID as _UID
from gyre.harbor_verify import drop_privileges, sandbox_base

__all__ = ["GyreEnvironment"]

_BOUND = ("tests", "solution", "logs", "installed-agent", "tmp")
"""Folders of the trial bound at /NAME, besides the workdir."""


class GyreEnvironment(BaseEnvironment):
    """One bubblewrap sandbox per trial (see the module's docstring)."""

    @staticmethod
    def type() -> str:
        return "gyre-sandbox"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        from gyre.harbor_tasks import load_harbor_task  # refuses what needs an image, with one line

        if any(shutil.which(tool) is None for tool in ("bwrap", "nsenter", "setpriv")):
            raise RuntimeError(
                "the Gyre sandbox needs bubblewrap, nsenter and setpriv (apt-get install bubblewrap util-linux)"
            )
        task = load_harbor_task(Path(self.environment_dir).parent)
        self._workdir = self.task_env_config.workdir or task.workdir
        self._task = task
        self._root: Path | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._pid: int | None = None
        self._pidfd: int | None = None

    # ---- the sandbox -------------------------------------------------------------------------------------------

    def _host(self, path: str) -> Path:
        """The host path behind sandbox path `path` (absolute, under a bound folder), or ValueError."""
        p = PurePosixPath(path)
        if not p.is_absolute() or ".." in p.parts or self._root is None:
            raise ValueError(f"{path!r}: not an absolute path of a started Gyre sandbox")
        work = PurePosixPath(self._workdir)
        if p == work or work in p.parents:
            return self._root / "work" / p.relative_to(work)
        if len(p.parts) > 1 and p.parts[1] in _BOUND:
            return self._root / Path(*p.parts[1:])
        raise ValueError(f"{path!r}: the Gyre sandbox writes only {self._workdir} and /{', /'.join(_BOUND)}")

    def _bwrap(self, info_fd: int) -> list[str]:
        cmd = [*sandbox_base(os.geteuid() == 0), "--bind", str(self._root / "work"), self._workdir]
        for name in _BOUND:
            cmd += ["--bind", str(self._root / name), f"/{name}"]
        drop = drop_privileges() if os.geteuid() == 0 else []
        return [
            *cmd,
            "--chdir",
            self._workdir,
            "--info-fd",
            str(info_fd),
            "--",
            *drop,
            "sh",
            "-c",
            "echo ready; exec sleep infinity",
        ]

    async def start(self, force_build: bool) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="gyre-harbor-"))
        (self._root / "work").mkdir()
        for name in _BOUND:
            (self._root / name).mkdir()
        for sub in ("agent", "verifier", "artifacts"):
            (self._root / "logs" / sub).mkdir()
        self._task.setup(self._root / "work")  # the Dockerfile's COPY lines
        if os.geteuid() == 0:
            for path in [self._root, *self._root.rglob("*")]:
                os.lchown(path, _UID, _UID)
        self._root.chmod(0o755)
        info_r, info_w = os.pipe()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._bwrap(info_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(info_w,),
                start_new_session=True,
                env={"PATH": _PATH},
            )
        finally:
            os.close(info_w)
        try:
            async with asyncio.timeout(60):
                # bubblewrap's --info-fd holds the init's pid, written before its mounts are done; the init's first
                # line comes once every mount is in place
                data = await _info(info_r)
                ready = await self._proc.stdout.readline()
        except TimeoutError:
            data, ready = {}, b""
        if "child-pid" not in data or ready != b"ready\n":
            proc = self._proc
            await self.stop(delete=True)  # bubblewrap gone: its stderr ends
            err = (await proc.stderr.read(4000)).decode(errors="replace")
            raise RuntimeError(f"the Gyre sandbox did not start: {err.strip()[-500:]}")
        self._pid = int(data["child-pid"])
        # stop() waits on it: the namespace is empty once its init is gone
        self._pidfd = os.pidfd_open(self._pid)

    async def stop(self, delete: bool) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            # The kernel kills every process of the namespace and reaps them before its init is gone.
            done = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(self._pidfd, lambda: done.done() or done.set_result(None))
            try:
                async with asyncio.timeout(30):
                    await done
            finally:
                asyncio.get_running_loop().remove_reader(self._pidfd)
                os.close(self._pidfd)
                self._pidfd = None
        if self._proc is not None and self._proc.returncode is None:
            # bubblewrap (and its init, should start have failed)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            await self._proc.wait()
        self._proc, self._pid = None, None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if self._pid is None:
            raise RuntimeError("the Gyre sandbox is not started")
        root = os.geteuid() == 0
        enter = ["nsenter", "-t", str(self._pid), "-m", "-p", "-n", "-u", "-i", "-r", "-w"]
        if not root:
            enter += ["-U", "--preserve-credentials"]
        drop = drop_privileges() if root else []
        variables = {
            "PATH": _PATH,
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "TERM": "xterm-256color",
            **(self.task_env_config.env or {}),
            **(self._merge_env(env) or {}),
        }
        script = (
            f"cd {_quote(cwd or self._workdir)} || exit 1\n{command}"  # a line of its own: `cmd &` stays cmd
        )
        argv = [*enter, *drop, "env", "-i", *(f"{k}={v}" for k, v in variables.items()), "bash", "-c", script]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={"PATH": _PATH},
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                # the command's group; what it detached lives on, as in Docker
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from None
        return ExecResult(
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            return_code=proc.returncode,
        )

    # ---- files -------------------------------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._host(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, target)
        self._give(target)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        target = self._host(target_dir)
        shutil.copytree(source_dir, target, dirs_exist_ok=True)
        self._give(target)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        source = self._host(source_path)
        st = os.lstat(source)
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(f"{source_path}: not a regular file in the sandbox")
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        _copy_regular(source, Path(target_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        source = self._host(source_dir)
        if not stat.S_ISDIR(os.lstat(source).st_mode):
            raise FileNotFoundError(f"{source_dir}: not a folder in the sandbox")
        shutil.copytree(
            source,
            target_dir,
            symlinks=True,
            dirs_exist_ok=True,
            copy_function=_copy_regular,
            ignore=_links_and_specials,
        )

    def _give(self, path: Path) -> None:
        if os.geteuid() == 0:
            for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
                os.lchown(p, _UID, _UID)


async def _info(fd: int) -> dict:
    """bubblewrap's --info-fd: a JSON object with the sandbox's init pid ({} when it ended without one)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb")
    )
    buf = b""
    try:
        while chunk := await reader.read(4096):
            buf += chunk
            with contextlib.suppress(ValueError):
                return json.loads(buf)
        return {}
    finally:
        transport.close()


def _quote(path: str) -> str:
    return "'" + path.replace("'", "'\\''") + "'"


def _links_and_specials(directory: str, names: list[str]) -> set[str]:
    """copytree's ignore: links (never followed out of the sandbox) and anything not a file or folder."""
    return {
        n
        for n in names
        if not (stat.S_ISREG(m := os.lstat(os.path.join(directory, n)).st_mode) or stat.S_ISDIR(m))
    }


def _copy_regular(src: str | Path, dst: str | Path) -> None:
    """Copy a regular file's bytes, never through a link (O_NOFOLLOW) nor blocking on a FIFO."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        with open(dst, "wb") as out, os.fdopen(os.dup(fd), "rb") as f:
            shutil.copyfileobj(f, out)
    finally:
        os.close(fd)
