"""The execution runner against a real loopback HTTP server standing in for the proxy's admin API, with real harness
subprocesses: one outcome per execution, process groups killed, reroutes during registration kept, the harness's
environment built from an allow-list, trajectories exported as a file."""

from __future__ import annotations

import asyncio
import json
import os
import select
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gyre_sched.runner import DEFAULT_ENV_ALLOW, ExecutionRunner, harness_argv

ADMIN_TOKEN = "admin-token-never-in-a-harness"

# A harness: optionally starts a child in its process group, reports its environment to the "proxy" with its
# credential (the moment the test knows it runs), then exits with the code the task names or hangs.
HARNESS = r"""
import json, os, subprocess, sys, time, urllib.request
workspace, task = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) if "spawn" in task else None
body = {"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv[1:], "child": child and child.pid,
        "pid": os.getpid()}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/hello", data=json.dumps(body).encode(),
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
urllib.request.urlopen(req).read()
open(os.path.join(workspace, "out.txt"), "w").write(task)
if "exit" in task:
    sys.exit(int(task.split("exit")[1]))
time.sleep(600)
"""


class FakeProxy:
    """The admin API subset the runner calls, plus /v1/hello for harnesses; every request is logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.routes: dict[str, list[str]] = {}
        self.hellos: dict[str, dict] = {}  # execution -> what its harness reported
        self.hello_event: dict[str, threading.Event] = {}
        self.registration_arrived = threading.Event()
        self.registration_gate: threading.Event | None = None  # set: registrations wait on it
        self.export_reply_trajectories = True
        self.calls: dict[str, int] = {}  # execution -> model calls recorded (GET /admin/executions/{id})
        self.active: dict[str, int] = {}  # execution -> model calls running now
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _reply(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"null") or {}

            def _handle(self, method: str) -> None:
                body, path = self._body(), self.path.rstrip("/")
                auth = self.headers.get("Authorization", "")
                if path.startswith("/v1/"):
                    eid = auth.removeprefix("Bearer cred-")
                    proxy.log.append(("hello", eid))
                    proxy.hellos[eid] = body
                    proxy.hello_event.setdefault(eid, threading.Event()).set()
                    return self._reply(200, {})
                if auth != f"Bearer {ADMIN_TOKEN}":
                    return self._reply(401, {"error": "admin token"})
                parts = path.split("/")  # ['', 'admin', 'executions', eid?, action?]
                if method == "POST" and len(parts) == 3:
                    eid = body["execution_id"]
                    proxy.registration_arrived.set()
                    if proxy.registration_gate is not None:
                        proxy.registration_gate.wait(30)
                    proxy.log.append(("register", eid, body["route"]))
                    proxy.routes[eid] = body["route"]
                    return self._reply(200, {"execution_id": eid, "credential": f"cred-{eid}"})
                eid, action = parts[3], parts[4]
                if eid not in proxy.routes:
                    return self._reply(404, {"error": f"unknown execution {eid}"})
                if method == "PUT" and action == "route":
                    proxy.log.append(("route", eid, body["engines"]))
                    proxy.routes[eid] = body["engines"]
                elif method == "POST" and action == "end":
                    proxy.log.append(("end", eid))
                elif method == "POST" and action == "export":
                    proxy.log.append(("export", eid, body))
                    Path(body["path"]).write_bytes(b"PAR1 stand-in PAR1")
                    if proxy.export_reply_trajectories:  # what the real proxy still answers: ignored
                        return self._reply(200, {"trajectories": [{"execution_id": eid}] * 3})
                return self._reply(200, {"execution_id": eid})

            def do_POST(self):
                self._handle("POST")

            def do_PUT(self):
                self._handle("PUT")

            def do_GET(self):
                if self.headers.get("Authorization", "") != f"Bearer {ADMIN_TOKEN}":
                    return self._reply(401, {"error": "admin token"})
                eid = self.path.rstrip("/").split("/")[3]
                calls, active = proxy.calls.get(eid, 0), proxy.active.get(eid, 0)
                return self._reply(200, {"execution_id": eid, "calls": calls, "active_calls": active})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def ends(self, eid: str) -> int:
        return sum(1 for x in self.log if x[0] == "end" and x[1] == eid)

    async def hello(self, eid: str, timeout: float = 60.0) -> dict:
        event = self.hello_event.setdefault(eid, threading.Event())
        assert await asyncio.to_thread(event.wait, timeout), f"{eid}'s harness never called the proxy"
        return self.hellos[eid]


@pytest.fixture
def proxy():
    p = FakeProxy()
    yield p
    p.close()


def make_runner(tmp_path: Path, proxy: FakeProxy, timeout_s: float = 60.0, **kw) -> ExecutionRunner:
    template = [sys.executable, "-c", HARNESS, "{workspace}", "{task}"]
    return ExecutionRunner(tmp_path, proxy.url, ADMIN_TOKEN, template, timeout_s, **kw)


def wait_dead(pid: int, timeout: float = 30.0) -> bool:
    """True once the process has exited (a zombie counts): waits on a pidfd, no polling."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def test_argv_template_substitutes_placeholders_once():
    got = harness_argv(["h", "--ws={workspace}", "{task}", "{other}", "{{x}}"], Path("/w"), "fix {workspace}")
    assert got == ["h", "--ws=/w", "fix {workspace}", "{other}", "{{x}}"]
    with pytest.raises(ValueError, match="harness_argv"):
        ExecutionRunner(Path("."), "http://x", "t", "python -m agent", 1.0)  # type: ignore[arg-type]


def test_outcomes_exactly_once_each(tmp_path, proxy):
    async def main():
        runner = make_runner(tmp_path, proxy, timeout_s=6.0)
        try:
            jobs = {
                eid: asyncio.create_task(runner.run(eid, "g0", "http://engine-0", task))
                for eid, task in [("ok", "exit0"), ("bad", "exit3"), ("slow", "hang"), ("gone", "hang")]
            }
            await proxy.hello("gone")
            runner.cancel("gone")
            done = {eid: await job for eid, job in jobs.items()}
            runner.cancel("ok")  # after the end: changes nothing
        finally:
            await runner.aclose()
        return done

    done = asyncio.run(main())
    assert {e: f.outcome for e, f in done.items()} == {
        "ok": "completed",
        "bad": "failed",
        "slow": "harness_timeout",
        "gone": "cancelled",
    }
    assert (done["ok"].returncode, done["bad"].returncode) == (0, 3)
    assert done["slow"].returncode == done["gone"].returncode == -9
    assert all(proxy.ends(e) == 1 for e in done)
    assert (done["ok"].workspace / "out.txt").read_text() == "exit0"
    assert proxy.hellos["ok"]["cwd"] == str(done["ok"].workspace)  # the harness runs in its workspace


def test_a_harness_that_cannot_start_leaves_no_work_not_a_valid_zero(tmp_path, proxy, monkeypatch):
    """A harness program that does not exist (a typo in the config) ran nothing: its execution is a `no_work`
    placeholder with the reason, whether the runner's exec fails itself (no setpriv: FileNotFoundError) or the
    setpriv shell reports it (exit 127); a harness that ran and failed is still an ordinary failure."""
    import gyre_sched.runner as runner_module

    async def main(template):
        runner = ExecutionRunner(tmp_path, proxy.url, ADMIN_TOKEN, template, 60.0)
        try:
            return await runner.run(f"e{len(proxy.log)}", "g0", "http://engine-0", "task")
        finally:
            await runner.aclose()

    missing = ["/nonexistent/harness", "{workspace}"]
    via_setpriv = asyncio.run(main(missing)) if runner_module._SETPRIV else None
    monkeypatch.setattr(runner_module, "_SETPRIV", None)
    direct = asyncio.run(main(missing))
    ran_and_failed = asyncio.run(main([sys.executable, "-c", "raise SystemExit(3)"]))
    for done in filter(None, (via_setpriv, direct)):
        assert done.outcome == "failed" and "could not start" in done.no_work, done
        assert proxy.ends(done.execution_id) == 1
    assert "FileNotFoundError" in direct.no_work and direct.returncode is None
    if via_setpriv is not None:
        assert via_setpriv.returncode == 127
    assert (ran_and_failed.outcome, ran_and_failed.returncode, ran_and_failed.no_work) == ("failed", 3, None)


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_process_group_killed(tmp_path, proxy, how):
    async def main():
        runner = make_runner(tmp_path, proxy, timeout_s=3.0 if how == "timeout" else 60.0)
        try:
            job = asyncio.create_task(runner.run("e", "g", "http://engine-0", "spawn-hang"))
            hello = await proxy.hello("e")
            if how == "cancel":
                runner.cancel("e")
            return await job, hello
        finally:
            await runner.aclose()

    done, hello = asyncio.run(main())
    assert done.outcome == ("harness_timeout" if how == "timeout" else "cancelled")
    assert proxy.ends("e") == 1
    assert wait_dead(hello["child"])  # the harness's own child went with its process group


# A runner in its own process (as in the controller): it launches one hanging harness, then waits to be killed.
RUNNER = r"""
import asyncio, sys
from pathlib import Path
from gyre_sched.runner import ExecutionRunner
run_dir, url, token, harness = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
runner = ExecutionRunner(run_dir, url, token, [sys.executable, "-c", harness, "{workspace}", "{task}"], 600.0)
asyncio.run(runner.run("orphan", "g", "http://engine-0", "hang"))
"""


def test_a_killed_runner_process_takes_its_harness_with_it(tmp_path, proxy):
    """SIGKILL the runner's process while its harness runs: the harness gets SIGKILL too (its death signal, set by
    setpriv before exec, or by the fork's preexec where there is no setpriv), so no harness outlives a controller."""
    import signal
    import subprocess

    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path), proxy.url, ADMIN_TOKEN, HARNESS])
    try:
        hello = asyncio.run(proxy.hello("orphan"))  # the gate: the harness runs
        harness = hello["pid"]
        assert not wait_dead(harness, timeout=0)
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=60)
        assert wait_dead(harness), "the harness outlived its runner"
    finally:
        if runner.poll() is None:
            runner.kill()


@pytest.mark.parametrize("spawn", ["setpriv", "fork"])
def test_a_harness_whose_runner_died_before_its_death_signal_never_starts(tmp_path, monkeypatch, spawn):
    """The race the death signal alone leaves open: the runner dies after the spawn but before PR_SET_PDEATHSIG, so
    no signal will ever come. The harness is then another process's child; it must exit instead of starting. Played
    by naming a runner that is not the parent (this test's process is)."""
    import subprocess

    from gyre_sched import runner as runner_mod

    if spawn == "setpriv" and runner_mod._SETPRIV is None:
        pytest.skip("no setpriv on this machine")
    if spawn == "fork":
        monkeypatch.setattr(runner_mod, "_SETPRIV", None)
    marker = tmp_path / "started"
    harness = [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"]
    for runner_pid, started in ((os.getpid(), True), (os.getppid(), False)):
        argv, preexec = runner_mod._dying_with_runner(harness, runner_pid)
        proc = subprocess.run(argv, preexec_fn=preexec, timeout=60)
        assert marker.exists() is started, (runner_pid, proc.returncode)
        assert proc.returncode == (0 if started else 70 if spawn == "setpriv" else -9)
        marker.unlink(missing_ok=True)


def test_group_leftovers_killed_after_a_normal_exit(tmp_path, proxy):
    async def main():
        runner = make_runner(tmp_path, proxy)
        try:
            return await runner.run("e", "g", "http://engine-0", "spawn-exit0")
        finally:
            await runner.aclose()

    done = asyncio.run(main())
    assert done.outcome == "completed"
    assert wait_dead(proxy.hellos["e"]["child"])


def test_cancel_while_registering_never_starts_the_harness(tmp_path, proxy):
    proxy.registration_gate = threading.Event()

    async def main():
        runner = make_runner(tmp_path, proxy)
        try:
            job = asyncio.create_task(runner.run("e", "g", "http://engine-0", "exit0"))
            await asyncio.to_thread(proxy.registration_arrived.wait, 30)
            runner.cancel("e")
            proxy.registration_gate.set()
            return await job
        finally:
            await runner.aclose()

    done = asyncio.run(main())
    assert (done.outcome, done.returncode) == ("cancelled", None)
    assert [x[0] for x in proxy.log] == ["register", "end"]  # no hello: nothing ran


def test_reroute_during_registration_is_not_lost(tmp_path, proxy):
    proxy.registration_gate = threading.Event()

    async def main():
        runner = make_runner(tmp_path, proxy)
        try:
            job = asyncio.create_task(runner.run("e", "g", "http://engine-a", "exit0"))
            await asyncio.to_thread(proxy.registration_arrived.wait, 30)  # the registration is in flight
            move = asyncio.create_task(runner.reroute("e", "http://engine-b"))
            await asyncio.sleep(0)  # the reroute now waits behind the registration
            assert not move.done()
            proxy.registration_gate.set()
            await move
            done = await job
            await runner.reroute("e", "http://engine-c")  # after the end: nothing to move
            return done
        finally:
            await runner.aclose()

    assert asyncio.run(main()).outcome == "completed"
    kinds = [x[:3] if x[0] in ("register", "route") else x[:2] for x in proxy.log]
    assert kinds == [
        ("register", "e", ["http://engine-a"]),
        ("route", "e", ["http://engine-b"]),
        ("hello", "e"),
        ("end", "e"),
    ]
    assert proxy.routes["e"] == ["http://engine-b"]


def test_reroute_before_launch_sets_the_registered_route(tmp_path, proxy):
    async def main():
        runner = make_runner(tmp_path, proxy)
        try:
            await runner.reroute("e", "http://engine-b")
            return await runner.run("e", "g", "http://engine-a", "exit0")
        finally:
            await runner.aclose()

    asyncio.run(main())
    assert proxy.log[0] == ("register", "e", ["http://engine-b"])


def test_harness_env_is_an_allow_list(tmp_path, proxy, monkeypatch):
    monkeypatch.setenv("GYRE_PROXY_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("SOME_SECRET", "hunter2")
    monkeypatch.setenv("LANG", "C.UTF-8")

    async def main():
        runner = make_runner(tmp_path, proxy, extra_env={"DISABLE_TELEMETRY": "1"})
        try:
            return await runner.run("e", "g", "http://engine-0", "exit0")
        finally:
            await runner.aclose()

    done = asyncio.run(main())
    hello = proxy.hellos["e"]
    env = hello["env"]
    assert "GYRE_PROXY_ADMIN_TOKEN" not in env and "SOME_SECRET" not in env
    assert not any(ADMIN_TOKEN in v or "hunter2" in v for v in env.values())
    assert env["OPENAI_BASE_URL"] == f"{proxy.url}/v1" and env["ANTHROPIC_BASE_URL"] == proxy.url
    assert env["OPENAI_API_KEY"] == env["ANTHROPIC_API_KEY"] == "cred-e"
    assert env["PATH"] == os.environ["PATH"] and env["LANG"] == "C.UTF-8" and env["DISABLE_TELEMETRY"] == "1"
    allowed = set(DEFAULT_ENV_ALLOW) | {"LC_CTYPE"}  # the interpreter may coerce LC_CTYPE (PEP 538)
    per_execution = {
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
        "ANTHROPIC_BASE_URL",
        "ANTHROPIC_API_KEY",
        "DISABLE_TELEMETRY",
    }
    assert set(env) <= allowed | per_execution, set(env) - allowed - per_execution
    assert hello["argv"] == [str(done.workspace), "exit0"]


def test_export_returns_the_parquet_path_not_trajectories(tmp_path, proxy):
    async def main():
        runner = make_runner(tmp_path, proxy)
        try:
            await runner.run("e", "g", "http://engine-0", "exit0")
            path = await runner.export("e", j_max=5, seed=7)
            proxy.export_reply_trajectories = False
            again = await runner.export("e", j_max=5, seed=7)
            return path, again
        finally:
            await runner.aclose()

    path, again = asyncio.run(main())
    assert path == again == tmp_path / "trajectories" / "e.parquet"
    assert path.read_bytes().startswith(b"PAR1")
    export = next(x for x in proxy.log if x[0] == "export")
    assert export[2] == {"j_max": 5, "seed": 7, "path": str(path)}


def test_cancel_all_ends_every_running_execution(tmp_path, proxy):
    async def main():
        runner = make_runner(tmp_path, proxy)
        try:
            jobs = [
                asyncio.create_task(runner.run(e, "g", "http://engine-0", "spawn-hang")) for e in ("a", "b")
            ]
            hellos = [await proxy.hello(e) for e in ("a", "b")]
            runner.cancel_all()
            return [await j for j in jobs], hellos
        finally:
            await runner.aclose()

    done, hellos = asyncio.run(main())
    assert [f.outcome for f in done] == ["cancelled", "cancelled"]
    assert proxy.ends("a") == proxy.ends("b") == 1
    assert all(wait_dead(h["child"]) for h in hellos)


class FakeClock:
    """The watchdog's clock, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Looks:
    """The watchdog's wait between two looks, driven by the test: `ready()` returns once the watchdog waits (its
    baseline is taken), `look()` lets exactly one look run and returns once the watchdog waits again, which proves
    that look did not stop the execution; `last()` lets one look run and returns at once."""

    def __init__(self) -> None:
        self.waiting: asyncio.Queue[float] = asyncio.Queue()
        self.go: asyncio.Queue[None] = asyncio.Queue()

    async def wait(self, poll_s: float) -> None:
        self.waiting.put_nowait(poll_s)
        await self.go.get()

    async def ready(self) -> float:
        return await asyncio.wait_for(self.waiting.get(), 30)

    async def look(self) -> None:
        self.last()
        await self.ready()

    def last(self) -> None:
        self.go.put_nowait(None)


def test_stall_watchdog_stops_an_execution_without_progress(tmp_path, proxy):
    """Model calls (recorded or running) and output reset the watchdog; stall_detect_s without any ends the execution
    `stalled`, its process group killed and the execution ended at the proxy once."""
    clock, looks = FakeClock(), Looks()

    async def main():
        runner = make_runner(tmp_path, proxy, stall_detect_s=100.0, clock=clock, stall_wait=looks.wait)
        try:
            job = asyncio.create_task(runner.run("e", "g", "http://engine-0", "spawn-hang"))
            hello = await proxy.hello("e")  # the harness runs and now hangs
            assert await looks.ready() == 10.0  # baseline taken (no call, no output); it looks every 10 s
            clock.t += 90
            proxy.calls["e"] = 1  # a model call was recorded: progress at +90
            await looks.look()
            clock.t += 90  # 90 s since the call
            await looks.look()
            log = tmp_path / "logs" / "agents" / "e.log"
            with log.open("ab") as out:  # the harness's output grows: progress at +240
                out.write(b"still working\n")
            clock.t += 60
            await looks.look()
            proxy.active["e"] = 1  # a model call runs for 150 s: nothing recorded, no output, but progress
            clock.t += 100
            await looks.look()
            clock.t += 50
            await looks.look()
            proxy.active["e"] = 0  # it returned at +390 (say it was not recorded: the harness then hangs)
            clock.t += 99  # 99 s without progress: not yet
            await looks.look()
            clock.t += 1
            looks.last()  # 100 s: stalled
            return await asyncio.wait_for(job, 30), hello
        finally:
            await runner.aclose()

    done, hello = asyncio.run(main())
    assert done.outcome == "stalled" and done.returncode == -9
    assert proxy.ends("e") == 1
    assert wait_dead(hello["child"])  # the harness's own child went with its process group


def test_stall_watchdog_leaves_finishing_executions_alone(tmp_path, proxy):
    """An execution that exits before a stall is detected keeps its own outcome; the watchdog polls at a tenth of
    stall_detect_s; without stall_detect_s there is no watchdog."""
    clock, looks = FakeClock(), Looks()

    async def main():
        runner = make_runner(tmp_path, proxy, stall_detect_s=50.0, clock=clock, stall_wait=looks.wait)
        try:
            ok = await runner.run("ok", "g", "http://engine-0", "exit0")
            bad = await runner.run("bad", "g", "http://engine-0", "exit3")
            poll_s = runner.stall_poll_s
        finally:
            await runner.aclose()
        return ok, bad, poll_s

    ok, bad, poll_s = asyncio.run(main())
    assert (ok.outcome, bad.outcome) == ("completed", "failed") and poll_s == 5.0
    with pytest.raises(ValueError, match="stall_detect_s"):
        make_runner(tmp_path, proxy, stall_detect_s=0.0)
    assert make_runner(tmp_path, proxy).stall_detect_s is None
