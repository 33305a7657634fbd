"""The execution runner: creates an execution's credential, workspace and harness process at launch, ends it once.

A launched execution ends exactly once with one outcome: `completed` (the harness exited 0), `failed` (it exited
non-zero), `harness_timeout` (the task's own deadline passed: the harness is stopped and its work is still assessed),
`stalled` (the stall watchdog stopped it: see below) or `cancelled` (the controller withdrew it).

Stall watchdog (``stall_detect_s``; off when None): an execution that makes no progress for that long is stopped
and ends `stalled`, which the scheduler's exclusion model excludes without assessment (a hang is known when it is
detected, not when the overall budget runs out). Progress is a model call running or newly recorded at the proxy (the
admin API's ``active_calls`` and ``calls``) or new harness output (its log grows): a long model call is not a stall,
a harness stuck in its own tool or loop is. The watchdog looks every ``stall_poll_s`` (default: a tenth of
``stall_detect_s``, at least 1 s), so a hang is detected within one poll after ``stall_detect_s``. The harness is a black box in its own process group (its own session);
the runner only sees its exit status and the workspace it leaves behind. When the harness ends, however it ends, the
whole process group is killed, so nothing it started outlives the execution.

The harness is an adapter (``gyre_sched.harness``: ``builtin``, ``command``, ``claude-code``; chosen per run, and per
execution through ``run(..., harness=...)``), or a command template (``harness_argv``): ``{workspace}`` and ``{task}``
are substituted in every argument per execution, e.g. ``[sys.executable, "-m", "gyre.demo.agent", "--workspace",
"{workspace}", "--task", "{task}"]``. ``run(..., setup=fn)`` fills the fresh workspace before the harness starts. The harness runs in its workspace with an environment built from an allow-list of the
runner's variables (``DEFAULT_ENV_ALLOW``: PATH, HOME, locale, TMPDIR, the Python environment...) plus ``extra_env``
and the execution's own: ``OPENAI_BASE_URL`` (proxy/v1), ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL`` (proxy),
``ANTHROPIC_API_KEY`` (the execution's credential). Nothing else of the runner's environment reaches a harness: in
particular not the proxy's admin token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from gyre_sched.harness import CommandHarness, Harness, HarnessContext, make_harness
from gyre_sched.sandbox import LaunchSandbox, ProxyRelay, check_workdir

__all__ = [
    "DEFAULT_ENV_ALLOW",
    "ExecutionRunner",
    "Finished",
    "exported_trajectories",
    "harness_argv",
    "harness_env",
]

DEFAULT_ENV_ALLOW: tuple[str, ...] = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "TERM",
    "TZ",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "LC_MESSAGES",
    "TMPDIR",
    "TEMP",
    "TMP",
    "PYTHONPATH",
    "PYTHONHOME",
    "VIRTUAL_ENV",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "NO_PROXY",
    "no_proxy",
)
"""The runner's environment variables a harness inherits (when set); everything else is withheld."""

_PLACEHOLDER = re.compile(r"\{(workspace|task)\}")


def harness_argv(template: Sequence[str], workspace: Path, task: str) -> list[str]:
    """Substitute ``{workspace}`` and ``{task}`` in each argument (in one pass: a task that contains the text
    ``{workspace}`` stays as it is). Other braces are left alone."""
    values = {"workspace": str(workspace), "task": task}
    return [_PLACEHOLDER.sub(lambda m: values[m[1]], arg) for arg in template]


def harness_env(
    base: Mapping[str, str], allow: Iterable[str], per_execution: Mapping[str, str]
) -> dict[str, str]:
    """The allowed variables of ``base`` that are set, then ``per_execution`` (which wins)."""
    env = {k: base[k] for k in allow if k in base}
    env.update(per_execution)
    return env


def _check_budget(harness_timeout_s: float, overall_budget_s: float | None) -> None:
    if overall_budget_s is not None and harness_timeout_s > overall_budget_s:
        raise ValueError(
            f"harness_timeout_s ({harness_timeout_s:g}) > overall_budget_s ({overall_budget_s:g}): the overall "
            "budget must cover the harness and its evaluation"
        )


def exported_trajectories(run_dir: Path, execution_id: str) -> Path:
    """Where an execution's selected trajectories are exported (Parquet; ``ExecutionRunner.export``)."""
    return run_dir / "trajectories" / f"{execution_id}.parquet"


@dataclass(frozen=True, slots=True)
class Finished:
    execution_id: str
    outcome: str
    """completed / failed / harness_timeout / stalled / cancelled."""
    workspace: Path
    launched_at: float
    """Unix time of launch: the overall budget runs from here."""
    returncode: int | None = None
    """The harness's exit status (negative: killed by that signal); None when it was never started."""
    no_work: str | None = None
    """Why the execution left no assessable work, when it did not: its harness could not start (no such program,
    not executable: exit 126 or 127, or the sandbox's exec failed). Assessed as the paper's zero-reward placeholder
    (``no_work``), never as a valid zero of its untouched workspace."""


NO_START_CODES = (126, 127)
"""Exit statuses of a shell (and of setpriv's `sh -c exec`) whose command could not be run."""


def _could_not_start(returncode: int | None, log: Path) -> str | None:
    """Why the harness never ran, from its exit status and the first line of its log; None if it ran."""
    try:
        with log.open("rb") as f:
            head = f.read(600).split(b"\n", 1)[0].decode(errors="replace").strip()
    except OSError:
        head = ""
    if returncode in NO_START_CODES or (returncode == 1 and head.startswith("bwrap: execvp")):
        return f"the harness could not start (exit {returncode}: {head or 'no output'})"
    return None


def _die_with_runner(parent: int, cgroups: Sequence[Path]) -> None:
    """In the harness before exec: join its cgroups (sandboxed), and get SIGKILL when the runner's process dies
    (PR_SET_PDEATHSIG), so a killed controller leaves no harness running against a dead proxy."""
    LaunchSandbox.enter(cgroups)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the runner died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


_SETPRIV = shutil.which("setpriv")
"""util-linux's setpriv: an unsandboxed harness gets its death signal from it (`--pdeathsig`) instead of from Python
code run between fork and exec, so the spawn can use vfork. A controller of hundreds of MB (torch imported) paid
about 20 ms of page-table copying per plain fork, per harness (py-spy, `gyre demo`). Without setpriv: the fork."""


_SH = shutil.which("dash") or shutil.which("sh") or "/bin/sh"
_PARENT_CHECK = '[ "$PPID" = "$0" ] || exit 70; unset PWD OLDPWD SHLVL; exec "$@"'
"""Run by sh after setpriv's PR_SET_PDEATHSIG, before the harness: a runner that died before the death signal was
set left its child to another parent, so the harness must not start (exit 70, nobody waits for it). The variables
the shell itself exports are dropped: the harness's environment stays the runner's allow-list."""


def _dying_with_runner(
    argv: list[str], runner_pid: int | None = None
) -> tuple[list[str], Callable[[], None] | None]:
    """An unsandboxed harness's argv and preexec_fn so that it gets SIGKILL when the runner's process dies.

    With setpriv the harness is exec'd after its PR_SET_PDEATHSIG through a one-line sh check of its parent: a
    runner that died in the millisecond before the prctl (no signal will come) is caught by the check, one that dies
    after it sends the signal. The shell costs one exec (about a millisecond), not a fork of the runner."""
    runner_pid = os.getpid() if runner_pid is None else runner_pid
    if _SETPRIV is not None:
        return [_SETPRIV, "--pdeathsig", "KILL", "--", _SH, "-c", _PARENT_CHECK, str(runner_pid), *argv], None
    return argv, partial(_die_with_runner, runner_pid, ())


async def _spawn(
    argv: Sequence[str], log: Path, env: dict[str, str], cwd: Path, preexec: Callable[[], None] | None
) -> asyncio.subprocess.Process:
    """The harness's process, in its own session, its output to `log`. A cancellation that lands while it is being
    created still returns it to the canceller's clean-up: the spawn goes on under a shield, its whole group is killed
    and reaped, then the cancellation goes on (asyncio's own clean-up killed only the group's leader)."""
    with log.open("wb") as out:
        created = asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=preexec,
        )
        spawn = asyncio.ensure_future(created)
        try:
            return await asyncio.shield(spawn)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                proc = await spawn
                ExecutionRunner._kill(proc)
                await proc.wait()
            raise


class ExecutionRunner:
    """Runs one harness process per execution against the TITO proxy's admin API (``/admin``)."""

    def __init__(
        self,
        run_dir: Path,
        proxy_url: str,
        admin_token: str,
        harness_argv: Sequence[str] | Harness | Mapping[str, object],
        harness_timeout_s: float,
        *,
        env_allow: Iterable[str] = DEFAULT_ENV_ALLOW,
        extra_env: Mapping[str, str] | None = None,
        admin_timeout_s: float = 60.0,
        model: str = "gyre-policy",
        overall_budget_s: float | None = None,
        sandbox: LaunchSandbox | None = None,
        stall_detect_s: float | None = None,
        stall_poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        stall_wait: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        if isinstance(harness_argv, Harness | Mapping):
            self.harness = make_harness(harness_argv)
        else:
            if (
                isinstance(harness_argv, str)
                or not harness_argv
                or not all(isinstance(a, str) for a in harness_argv)
            ):
                raise ValueError(f"harness_argv must be a non-empty list of strings, got {harness_argv!r}")
            self.harness = CommandHarness(list(harness_argv))
        if not harness_timeout_s > 0:
            raise ValueError(f"harness_timeout_s must be > 0, got {harness_timeout_s}")
        _check_budget(harness_timeout_s, overall_budget_s)
        if stall_detect_s is not None and not stall_detect_s > 0:
            raise ValueError(f"stall_detect_s must be > 0 (or None: no watchdog), got {stall_detect_s}")
        if sandbox is not None:
            sandbox.check()
            sandbox.sweep()  # what a controller killed before its clean-up left
        self.stall_detect_s = stall_detect_s
        self.stall_poll_s = stall_poll_s or max(1.0, (stall_detect_s or 0.0) / 10)
        # injectable: tests drive the watchdog's clock and when it looks
        self.clock, self.stall_wait = clock, stall_wait
        self.overall_budget_s = overall_budget_s
        self.sandbox = sandbox
        self.run_dir = Path(run_dir)
        self.proxy_url = proxy_url.rstrip("/")
        self.model = model
        self.harness_timeout_s = harness_timeout_s
        self.env_allow = tuple(env_allow)
        self.extra_env = dict(extra_env or {})
        self.admin = httpx.AsyncClient(
            base_url=f"{self.proxy_url}/admin",
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=admin_timeout_s,
        )
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._cancelled: set[str] = set()
        # Registration, reroutes and the end of one execution are serialized: a reroute decided while the
        # registration is still in flight must not be lost (the harness would call a draining engine), and a
        # reroute that arrives after the end has nothing to move.
        self._locks: dict[str, asyncio.Lock] = {}
        self._routes: dict[str, str] = {}
        self._state: dict[str, str] = {}  # registering -> registered -> ended

    async def aclose(self) -> None:
        await self.admin.aclose()

    async def admin_call(self, method: str, path: str, body: dict | None = None) -> dict:
        response = await self.admin.request(method, path, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"proxy admin {method} {path}: {response.status_code} {response.text}")
        return response.json()

    def _lock(self, execution_id: str) -> asyncio.Lock:
        return self._locks.setdefault(execution_id, asyncio.Lock())

    def _env(self, harness: Harness, ctx: HarnessContext) -> dict[str, str]:
        return harness_env(os.environ, self.env_allow, {**self.extra_env, **harness.env(ctx)})

    async def run(
        self,
        execution_id: str,
        group_id: str,
        engine_url: str,
        task: str,
        *,
        harness: Harness | str | Mapping[str, object] | None = None,
        setup: Callable[[Path], object] | None = None,
        harness_timeout_s: float | None = None,
        overall_budget_s: float | None = None,
        workdir: str | None = None,
    ) -> Finished:
        """Register the execution at the proxy, run its harness (the run's, or `harness` for this execution; in a
        workspace `setup` filled), end it; returns its single outcome. `workdir`: where a sandboxed harness sees its
        workspace (a Harbor task's `/app`); without a sandbox it works at the host path."""
        chosen = self.harness if harness is None else make_harness(harness)
        timeout_s = self.harness_timeout_s if harness_timeout_s is None else harness_timeout_s
        budget_s = self.overall_budget_s if overall_budget_s is None else overall_budget_s
        _check_budget(timeout_s, budget_s)  # refused before anything is registered
        if workdir is not None and self.sandbox is not None:
            check_workdir(workdir)
        async with self._lock(execution_id):
            self._state[execution_id] = "registering"
            route = self._routes.setdefault(execution_id, engine_url)  # a reroute that came first wins
            body = {"execution_id": execution_id, "group_id": group_id, "route": [route]}
            try:
                registered = await self.admin_call("POST", "/executions", body)
            except BaseException:
                self._state.pop(execution_id, None)
                raise
            self._state[execution_id] = "registered"
        workspace = self.run_dir / "workspaces" / execution_id
        workspace.mkdir(parents=True, exist_ok=True)
        if setup is not None:
            setup(workspace)
        log = self.run_dir / "logs" / "agents" / f"{execution_id}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        launched_at = time.time()
        returncode: int | None = None
        start_error: str | None = None
        outcome = "cancelled"
        if execution_id not in self._cancelled:  # cancelled while registering: never started
            outcome, returncode, start_error = await self._launch(
                execution_id,
                chosen,
                workspace,
                task,
                registered["credential"],
                log,
                launched_at,
                timeout_s,
                budget_s,
                workdir,
            )
        if execution_id in self._cancelled:
            outcome = "cancelled"
        no_work = (start_error or _could_not_start(returncode, log)) if outcome == "failed" else None
        done = Finished(execution_id, outcome, workspace, launched_at, returncode, no_work)
        return await self._end(execution_id, done)

    async def _launch(
        self,
        execution_id: str,
        chosen: Harness,
        workspace: Path,
        task: str,
        credential: str,
        log: Path,
        launched_at: float,
        timeout_s: float,
        budget_s: float | None,
        workdir: str | None = None,
    ) -> tuple[str, int | None, str | None]:
        """Start the harness (in the sandbox, with its relay and cgroups) and wait for its end: (outcome, exit
        status, why it could not start). Whatever the launch made goes when it ends, however it ends: a
        cancellation (the controller's shutdown at a SIGINT) that lands while the relay starts or the harness is
        being spawned too, where the relay folder and the cgroups were left behind."""
        relay: ProxyRelay | None = None
        cgroups: list[Path] = []
        proc: asyncio.subprocess.Process | None = None
        try:
            base_url = self.proxy_url
            if self.sandbox is not None:
                parts = urlsplit(self.proxy_url)
                port = parts.port or (443 if parts.scheme == "https" else 80)
                base_url = (
                    f"http://127.0.0.1:{port}"  # the relay inside listens on loopback at the proxy's port
                )
                relay = ProxyRelay(parts.hostname or "127.0.0.1", port)
                await relay.start()
            seen = Path(workdir) if workdir is not None and self.sandbox is not None else workspace
            ctx = HarnessContext(execution_id, seen, task, base_url, credential, self.model)
            argv, env = chosen.argv(ctx), self._env(chosen, ctx)
            preexec: Callable[[], None] | None = None
            if self.sandbox is not None and relay is not None:
                if "HOME" not in chosen.env(ctx):  # the host's home is not in the sandbox: a private one
                    env["HOME"] = str(workspace.with_name(workspace.name + ".home"))
                Path(env["HOME"]).mkdir(parents=True, exist_ok=True)
                env["TMPDIR"] = "/tmp"
                env.pop("TEMP", None)
                env.pop("TMP", None)
                argv = self.sandbox.wrap(
                    argv, workspace, Path(env["HOME"]), env, port, relay.dir, execution_id, workdir
                )
                env = {"PATH": "/usr/bin:/bin"}
                cgroups = self.sandbox.make_cgroup(execution_id)
                preexec = partial(_die_with_runner, os.getpid(), cgroups)
            else:
                argv, preexec = _dying_with_runner(argv)
            try:
                proc = await _spawn(argv, log, env, workspace, preexec)
            except OSError as exc:  # no such program, not executable: nothing ran, nothing to assess
                start_error = f"the harness could not start ({type(exc).__name__}: {exc})"
                log.write_text(start_error + "\n")
                return "failed", None, start_error
            self._procs[execution_id] = proc
            if budget_s is not None:
                timeout_s = min(timeout_s, max(0.0, launched_at + budget_s - time.time()))
            try:
                if execution_id in self._cancelled:  # cancelled while the process was being created
                    self._kill(proc)
                returncode, stalled = await self._wait(execution_id, proc, log, timeout_s)
                return (
                    ("stalled" if stalled else "completed" if returncode == 0 else "failed"),
                    returncode,
                    None,
                )
            except TimeoutError:
                self._kill(proc)
                return "harness_timeout", await proc.wait(), None
        finally:
            self._procs.pop(execution_id, None)
            if proc is not None:
                self._kill(proc)  # whatever the harness left running in its group goes with it
            await self._release_launch(execution_id, relay, cgroups)

    async def _release_launch(self, execution_id: str, relay: ProxyRelay | None, cgroups: list[Path]) -> None:
        """What a launch holds besides the harness: the sandbox's relay to the proxy, its cgroups, its lease."""
        if relay is not None:
            await relay.close()
        LaunchSandbox.remove_cgroups(cgroups)
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.release, execution_id)

    async def _end(self, execution_id: str, done: Finished) -> Finished:
        """The execution is over: its proxy registration ends (once), and so does the runner's state of it."""
        async with self._lock(execution_id):
            self._state[execution_id] = "ended"
            self._routes.pop(execution_id, None)
            self._cancelled.discard(execution_id)
            await self.admin_call("POST", f"/executions/{execution_id}/end")
        self._locks.pop(execution_id, None)
        return done

    async def _wait(
        self, execution_id: str, proc: asyncio.subprocess.Process, log: Path, timeout_s: float
    ) -> tuple[int, bool]:
        """The harness's exit status, and whether the watchdog stopped it; TimeoutError past `timeout_s`."""
        if self.stall_detect_s is None:
            return await asyncio.wait_for(proc.wait(), timeout=timeout_s), False
        exited = asyncio.ensure_future(proc.wait())
        watch = asyncio.ensure_future(self._watch_stall(execution_id, log))
        try:
            done, _ = await asyncio.wait(
                {exited, watch}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            watch.cancel()
        if exited in done:
            return exited.result(), False
        if watch in done:
            watch.result()  # a failure of the watchdog itself surfaces here
            self._kill(proc)
            return await exited, True
        exited.cancel()
        raise TimeoutError

    async def _watch_stall(self, execution_id: str, log: Path) -> None:
        """Returns once the execution has made no progress (model call, output) for `stall_detect_s`."""
        assert self.stall_detect_s is not None
        seen, _ = await self._progress(execution_id, log, None)
        since = self.clock()
        while True:
            await self.stall_wait(self.stall_poll_s)
            progress, calling = await self._progress(execution_id, log, seen)
            now = self.clock()
            if progress != seen or calling:  # a model call still running is progress too
                seen, since = progress, now
            elif now - since >= self.stall_detect_s:
                return

    async def _progress(
        self, execution_id: str, log: Path, last: tuple[int, int] | None
    ) -> tuple[tuple[int, int], bool]:
        """((model calls the proxy recorded, bytes of harness output), whether a model call of it runs now); a proxy
        that does not answer keeps the count seen last (the harness's own calls fail then, and it ends by itself)."""
        calls, calling = (last[0] if last is not None else 0), False
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            r = await self.admin.get(f"/executions/{execution_id}")
            if r.status_code == 200:
                body = r.json()
                calls, calling = int(body["calls"]), bool(body.get("active_calls"))
        try:
            size = log.stat().st_size
        except OSError:
            size = last[1] if last is not None else 0
        return (calls, size), calling

    def cancel(self, execution_id: str) -> None:
        """Stop an execution's harness (or keep it from starting); its run() returns with outcome `cancelled`."""
        if self._state.get(execution_id) == "ended":
            return
        self._cancelled.add(execution_id)
        proc = self._procs.get(execution_id)
        if proc is not None:
            self._kill(proc)

    def cancel_all(self) -> None:
        """Cancel every execution that has not ended (shutdown)."""
        for execution_id, state in list(self._state.items()):
            if state != "ended":
                self.cancel(execution_id)

    async def reroute(self, execution_id: str, engine_url: str) -> None:
        """Move an execution's model calls to another engine (before, during or after its registration)."""
        async with self._lock(execution_id):
            if self._state.get(execution_id) == "ended":
                return
            self._routes[execution_id] = engine_url
            if self._state.get(execution_id) == "registered":
                await self.admin_call("PUT", f"/executions/{execution_id}/route", {"engines": [engine_url]})

    def trajectories_path(self, execution_id: str) -> Path:
        return exported_trajectories(self.run_dir, execution_id)

    async def export(self, execution_id: str, j_max: int, seed: int) -> Path:
        """Have the proxy select the execution's trajectories (J_max) and write them as Parquet at
        RUN/trajectories/<execution>.parquet; returns that path. Trajectories never travel in the reply: whatever
        the proxy also returns in its body is ignored."""
        path = self.trajectories_path(execution_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"j_max": j_max, "seed": seed, "path": str(path)}
        await self.admin_call("POST", f"/executions/{execution_id}/export", body)
        if not path.is_file():
            raise RuntimeError(f"proxy admin export of {execution_id} answered but wrote no file at {path}")
        return path

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
