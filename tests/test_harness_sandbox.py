"""The execution sandbox at launch: a probe harness tries to read the host environment, the host's home folder, the
proxy's store and another execution's workspace, and to reach an address other than the proxy; every attempt
fails, while its own calls through the proxy work. Limits hold, the whole process tree dies at the harness
timeout, and a harness timeout longer than the overall budget is refused. Each under both sandboxes: bubblewrap, and
an OCI container runtime (runc; `.ci/run` installs both)."""

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from gyre_sched.harness import CommandHarness
from gyre_sched.runner import ExecutionRunner
from gyre_sched.sandbox import LaunchSandbox
from gyre_tito.proxy import ProxyConfig
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

PROBE = (Path(__file__).parent / "sandbox_probe.py").read_text()


RUNTIMES = {"bubblewrap": "bwrap", "oci": "runc"}


@pytest.fixture(params=sorted(RUNTIMES))
def runtime(request):
    if shutil.which(RUNTIMES[request.param]) is None:
        pytest.fail(
            f"{RUNTIMES[request.param]} is not installed: apt-get install {request.param.replace('oci', 'runc')}"
        )
    return request.param


@pytest.fixture
def stack(tmp_path, monkeypatch, runtime):
    monkeypatch.setenv("GYRE_HOST_SECRET", "host-secret")
    tok = build_tiny_tokenizer(tmp_path / "tok")
    eng = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), rules=[ScriptRule(reply="pong")]))
    eng.start()
    cfg = ProxyConfig(engines=[eng.url], tokenizer=str(tok), store=str(tmp_path / "store"), admin_token="adm")
    with ProxyServer(cfg) as srv:
        yield srv, eng, tmp_path, runtime
    eng.stop()


def _runner(srv, run_dir, harness, runtime, **kw):
    sandbox = LaunchSandbox(max_processes=32, memory_bytes=1 << 30, cpu_cores=1.0, runtime=runtime)
    runner = ExecutionRunner(run_dir, srv.url, "adm", harness, 60.0, sandbox=sandbox, **kw)
    runner.engine_for_tests = srv.proxy.config.engines[0]
    return runner, sandbox


def test_probe_cannot_reach_anything_but_the_proxy(stack):
    srv, eng, tmp, runtime = stack
    run_dir = tmp / "run"
    other = run_dir / "workspaces" / "other-exec"
    other.mkdir(parents=True)
    (other / "secret.txt").write_text("other execution's work")
    home_secret = Path.home() / f".gyre-probe-{uuid.uuid4().hex}"
    home_secret.write_text("host home secret")
    try:
        engine_port = int(eng.url.rsplit(":", 1)[1])
        paths = {
            "read": {
                "host_home_file": str(home_secret),
                "store_registry": str(Path(srv.proxy.config.store) / "executions.jsonl"),
                "store_config": str(Path(srv.proxy.config.store) / "config.json"),
                "other_workspace": str(other / "secret.txt"),
                "host_environ": "/proc/1/environ",
            },
            "host_home": str(Path.home()),
            "workspaces": str(run_dir / "workspaces"),
            "connect": {"engine": ["127.0.0.1", engine_port], "outside": ["1.1.1.1", 80]},
        }
        harness = CommandHarness([sys.executable, "-c", PROBE, json.dumps(paths)])
        runner, sandbox = _runner(srv, run_dir, harness, runtime)
        done = asyncio.run(_run(runner, "probe-1"))
        log = (run_dir / "logs" / "agents" / "probe-1.log").read_text()
        assert done.outcome == "completed", log
        out = json.loads((done.workspace / "probe.json").read_text())
    finally:
        home_secret.unlink()
    assert out["proxy_call"] == ["succeeded", "'pong'"]  # its own calls reach the proxy
    assert srv.admin("GET", "/admin/executions/probe-1").json()["calls"] == 1
    for key in paths["read"]:
        if key == "host_environ":  # its pid 1 is the sandbox's own init, whose environment is PATH only
            assert "host-secret" not in json.dumps(out["read:" + key]), out["read:" + key]
        else:
            assert out["read:" + key][0] == "failed", (key, out["read:" + key])
    assert out["list:other_workspaces"][0] == "failed" or "other-exec" not in out["list:other_workspaces"][1]
    assert out["list:host_home"][0] == "failed" or home_secret.name not in out["list:host_home"][1]
    assert out["connect:engine"][0] == "failed" and out["connect:outside"][0] == "failed"
    assert "GYRE_HOST_SECRET" not in out["env"] and out["uid"] == 65534
    assert out["home"] == str(done.workspace) + ".home"
    assert out["spawn_64"][0] == "failed" and out["spawned"] < 32  # pids limit
    assert set(sandbox.limits_applied) == {"pids", "memory", "cpu"}
    if runtime == "oci":  # the container, its state and its bundle are gone with the execution
        listed = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout.split()
        assert not [c for c in listed if c.endswith("-probe-1")] and not sandbox._bundles, listed


async def _run(runner, eid, **kw):
    try:
        return await runner.run(eid, "g", runner.engine_for_tests, "task", **kw)
    finally:
        await runner.aclose()


def test_a_task_workdir_shows_the_workspace_there_and_nowhere_else(stack):
    """A Harbor task's instruction names `/app`: the sandboxed harness starts there, finds the files the task's setup
    put in its workspace, and what it writes lands in that workspace; its host path is not mounted."""
    srv, _, tmp, runtime = stack
    host = tmp / "run" / "workspaces" / "wd-1"
    script = (
        "import os, pathlib, sys; seen = pathlib.Path('/app/start.txt').read_text();"
        f"hidden = not os.path.exists({str(host)!r});"
        "pathlib.Path('/app/out.txt').write_text('|'.join([os.getcwd(), sys.argv[1], seen, str(hidden)]))"
    )
    harness = CommandHarness([sys.executable, "-c", script, "{workspace}"])
    runner, _ = _runner(srv, tmp / "run", harness, runtime)
    done = asyncio.run(
        _run(runner, "wd-1", workdir="/app", setup=lambda ws: (ws / "start.txt").write_text("from setup"))
    )
    assert done.outcome == "completed", (tmp / "run" / "logs" / "agents" / "wd-1.log").read_text()[-2000:]
    assert done.workspace == host
    assert (host / "out.txt").read_text() == "/app|/app|from setup|True"  # `{workspace}` is where it works
    with pytest.raises(ValueError, match="mounts itself"):
        asyncio.run(_run(_runner(srv, tmp / "run", harness, runtime)[0], "wd-2", workdir="/usr/app"))
    assert srv.admin("GET", "/admin/executions/wd-2").status_code == 404  # refused before registration


def test_the_whole_tree_dies_at_the_harness_timeout(stack):
    srv, _, tmp, runtime = stack
    token = f"gyre-sandbox-orphan-{uuid.uuid4().hex}"
    script = f"import subprocess, time; subprocess.Popen(['/usr/bin/sleep', '1000', '{token}'])\nwhile True: time.sleep(1)"
    harness = CommandHarness([sys.executable, "-c", script])
    runner, _ = _runner(srv, tmp / "run", harness, runtime)
    done = asyncio.run(_run(runner, "hang-1", harness_timeout_s=2.0))
    assert done.outcome == "harness_timeout"
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


def test_harness_timeout_beyond_the_overall_budget_is_refused(stack):
    srv, _, tmp, _ = stack
    with pytest.raises(ValueError, match=r"harness_timeout_s \(60\) > overall_budget_s \(30\)"):
        ExecutionRunner(tmp / "run", srv.url, "adm", ["true"], 60.0, overall_budget_s=30.0)
    runner = ExecutionRunner(tmp / "run", srv.url, "adm", ["true"], 10.0, overall_budget_s=30.0)
    runner.engine_for_tests = srv.proxy.config.engines[0]
    with pytest.raises(ValueError, match="overall budget must cover"):
        asyncio.run(_run(runner, "x", harness_timeout_s=40.0))
    assert srv.admin("GET", "/admin/executions/x").status_code == 404  # refused before registration


@pytest.mark.skipif(os.geteuid() != 0, reason="a distinct host identity needs root (CI runs as root)")
def test_the_harness_is_not_root_outside_its_sandbox(stack):
    """Root-only files on the paths the sandbox mounts stay unreadable: the harness's uid 65534 is the host's nobody,
    not root (bubblewrap's user namespace mapped it to the operator's uid, root here). It still writes its workspace
    (probe.json) and reaches the proxy through the relay."""
    srv, _, tmp, runtime = stack
    mounted = tmp / "checkout"  # a read-only mounted folder, as the checkout's src folders are
    mounted.mkdir(mode=0o755)
    (mounted / "public.txt").write_text("shared")
    secret = mounted / "operator-only.txt"
    secret.write_text("operator secret")
    secret.chmod(0o600)
    paths = {
        "read": {"operator_file": str(secret), "public_file": str(mounted / "public.txt")},
        "list": {"ssl_private": "/etc/ssl/private"} if Path("/etc/ssl/private").is_dir() else {},
        "host_home": str(Path.home()),
        "workspaces": str(tmp / "run" / "workspaces"),
        "connect": {},
    }
    harness = CommandHarness([sys.executable, "-c", PROBE, json.dumps(paths)])
    runner, sandbox = _runner(srv, tmp / "run", harness, runtime)
    sandbox.ro_paths = [*sandbox.ro_paths, str(mounted)]
    done = asyncio.run(_run(runner, "ident-1"))
    assert done.outcome == "completed", (tmp / "run" / "logs" / "agents" / "ident-1.log").read_text()
    out = json.loads((done.workspace / "probe.json").read_text())
    assert out["uid"] == 65534 and out["proxy_call"] == ["succeeded", "'pong'"]
    assert out["read:public_file"] == ["succeeded", "'shared'"]  # mounted: only the identity keeps the secret
    assert out["read:operator_file"][:2] == ["failed", "PermissionError"], out["read:operator_file"]
    for key in paths["list"]:
        assert out["list:" + key][:2] == ["failed", "PermissionError"], out["list:" + key]


def _left_by(pid: int, runtime: str) -> list[Path]:
    """What the launches of controller `pid` made and have not removed: relay folders, cgroups, OCI bundles and
    containers' state."""
    tmpdir = Path(tempfile.gettempdir())
    left = [*tmpdir.glob(f"gyre-relay-{pid}-*"), *tmpdir.glob(f"gyre-oci-{pid}-*")]
    left += [cg for cg in Path("/sys/fs/cgroup").glob(f"**/gyre/{pid}-*") if cg.is_dir()]
    if runtime == "oci":
        listed = subprocess.run(["runc", "list", "-q"], capture_output=True, text=True).stdout.split()
        left += [Path("runc:" + c) for c in listed if c.startswith(f"gyre-{pid}-")]
    return left


def _alive(token: str) -> str:
    return subprocess.run(["pgrep", "-af", token], capture_output=True, text=True).stdout


def test_a_cancellation_during_the_launch_leaves_nothing(stack):
    """SIGINT's shutdown cancels an execution while its harness is being spawned: the harness, its relay folder and
    cgroups (its OCI container and bundle) go all the same (the relay folder and cgroups were left)."""
    srv, _, tmp, runtime = stack
    token = f"gyre-launch-cancel-{uuid.uuid4().hex}"
    harness = CommandHarness(["/usr/bin/sh", "-c", f"/usr/bin/sleep 1000; : {token}"])
    runner, sandbox = _runner(srv, tmp / "run", harness, runtime)
    made: list[Path] = []
    make_cgroup = sandbox.make_cgroup

    # the gate: the cgroups are made and the spawn comes next, with no wait between
    def make_then_cancel(
        name,
    ):
        made.extend(make_cgroup(name))
        asyncio.current_task().cancel()
        return made

    sandbox.make_cgroup = make_then_cancel

    async def launch():
        task = asyncio.ensure_future(_run(runner, "cancel-1"))
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(launch())
    assert made or runtime == "oci"  # this machine's cgroups are writable (bubblewrap makes them)
    assert _left_by(os.getpid(), runtime) == [] and not _alive(token)


CONTROLLER = """
import asyncio, sys
from pathlib import Path
from gyre_sched.harness import CommandHarness
from gyre_sched.runner import ExecutionRunner
from gyre_sched.sandbox import LaunchSandbox
run_dir, url, engine, runtime, token = sys.argv[1:6]
sandbox = LaunchSandbox(max_processes=32, memory_bytes=1 << 30, cpu_cores=1.0, runtime=runtime)
harness = CommandHarness(["/usr/bin/sh", "-c", f"echo up > ready; /usr/bin/sleep 1000; : {token}"])
runner = ExecutionRunner(Path(run_dir), url, "adm", harness, 600.0, sandbox=sandbox)
asyncio.run(runner.run("killed-1", "g", engine, "task"))
"""


def _read_gate(fifo: Path, proc: subprocess.Popen) -> str:
    """What the harness writes to `fifo`; "exited" if its controller ends first (then nobody else would write)."""

    def unblock() -> None:
        proc.wait()
        with contextlib.suppress(OSError):  # the reader waits in open(): this write end opens at once
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"exited")
            os.close(fd)

    threading.Thread(target=unblock, daemon=True).start()
    with open(fifo) as f:
        return f.read()


def test_what_a_killed_controller_left_is_swept_at_the_next_start(stack):
    """A controller SIGKILLed while its sandboxed harness runs cleans nothing up; the next runner's start removes
    what it left (relay folder, cgroups and what still runs in them, OCI container and bundle), found by its pid."""
    srv, eng, tmp, runtime = stack
    token = f"gyre-killed-controller-{uuid.uuid4().hex}"
    workspace = tmp / "run" / "workspaces" / "killed-1"
    workspace.mkdir(parents=True)
    os.mkfifo(workspace / "ready")  # the gate: the harness writes to it once it runs
    argv = [sys.executable, "-c", CONTROLLER, str(tmp / "run"), srv.url, eng.url, runtime, token]
    proc = subprocess.Popen(argv)
    try:
        assert _read_gate(workspace / "ready", proc) == "up\n"
    finally:
        proc.kill()
        proc.wait()
    assert _left_by(proc.pid, runtime)  # SIGKILL: no clean-up ran
    ExecutionRunner(tmp / "run2", srv.url, "adm", ["true"], 10.0, sandbox=LaunchSandbox(runtime=runtime))
    assert _left_by(proc.pid, runtime) == [] and not _alive(token)
