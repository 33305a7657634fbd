"""The sandbox: private copy, no writes outside it, no network, group kill on timeout, rlimits, scrubbed env."""

import os
import shutil
import signal
import socket
import tempfile
from pathlib import Path

import pytest
from eval_helpers import run

from gyre_eval.contract import tree_digest
from gyre_eval.errors import SandboxError
from gyre_eval.sandbox import Sandbox, SandboxConfig

ISOLATED = Sandbox().isolated()
needs_isolation = pytest.mark.skipif(
    not ISOLATED, reason="no namespace isolation on this platform (see README)"
)


def _sandbox(**kw) -> Sandbox:
    return Sandbox(SandboxConfig(**{"timeout_s": 10, **kw}))


def test_check_runs_on_a_private_copy_and_the_preserved_workspace_is_untouched(workspace):
    before = tree_digest(workspace)
    cmd = [
        "bash",
        "-c",
        'cat main.py; echo changed > main.py; rm README.md; echo new > new.txt; pwd; echo "$HOME"',
    ]
    result = run(_sandbox().run(cmd, workspace))
    assert result.returncode == 0, result.stderr_tail
    out = result.stdout_tail.splitlines()
    assert out[0] == "print('hello')"
    assert out[1] != str(workspace) and out[1].endswith("/work")
    assert tree_digest(workspace) == before
    assert not Path(out[1]).exists(), "the private copy is removed after the run"


def test_special_files_in_the_artifact_are_not_copied(workspace):
    os.mkfifo(workspace / "pipe")  # copying it by content would block forever
    result = run(_sandbox().run(["bash", "-c", "ls"], workspace))
    assert result.returncode == 0 and "pipe" not in result.stdout_tail and "main.py" in result.stdout_tail


@needs_isolation
# As root: drop to nobody, or keep uid 0 without any capability.
@pytest.mark.parametrize("run_as", [65534, None])
def test_sandbox_cannot_write_outside_its_copy(workspace, run_as):
    # A world-writable directory reachable by anyone: only the read-only mount stops the write, not permissions.
    outside = Path(tempfile.mkdtemp(prefix="gyre-outside-"))
    os.chmod(outside, 0o777)
    (outside / "existing.txt").write_text("original\n")
    os.chmod(outside / "existing.txt", 0o666)
    target, existing = outside / "escaped.txt", outside / "existing.txt"
    script = f"""
        echo x > {target} && echo WROTE_NEW
        echo y >> {existing} && echo APPENDED
        touch {workspace}/planted && echo PLANTED_IN_PRESERVED
        ln -s {outside} link && echo z > link/via_symlink && echo VIA_LINK
        echo fine > inside.txt && echo INSIDE_OK
        mount -o remount,rw / 2>/dev/null && echo REMOUNTED
        mount -t tmpfs none {outside} 2>/dev/null && echo MOUNTED
    """
    result = run(_sandbox(run_as=run_as).run(["bash", "-c", script], workspace))
    assert "INSIDE_OK" in result.stdout_tail
    for marker in ("WROTE_NEW", "APPENDED", "PLANTED_IN_PRESERVED", "VIA_LINK", "REMOUNTED", "MOUNTED"):
        assert marker not in result.stdout_tail, (marker, result.stderr_tail)
    assert "Read-only file system" in result.stderr_tail
    assert not target.exists() and not (outside / "via_symlink").exists()
    assert existing.read_text() == "original\n"
    assert not (workspace / "planted").exists()
    assert result.guarantees["read_only_outside_copy"] is True
    shutil.rmtree(outside)


@needs_isolation
def test_sandbox_has_no_network(workspace):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    result = run(
        _sandbox().run(["bash", "-c", f"echo hi > /dev/tcp/127.0.0.1/{port} && echo CONNECTED"], workspace)
    )
    # A completed handshake would sit in the backlog even without accept(): there must be none.
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    assert "CONNECTED" not in result.stdout_tail
    assert result.guarantees["no_network"] is True


@needs_isolation
@pytest.mark.parametrize("run_as", ["per-run", None])
def test_sandbox_cannot_connect_to_a_filesystem_unix_socket(workspace, run_as):
    """A service's unix socket reachable by path (mode 777, through the read-only mounts) refuses the check: it
    cannot even create an AF_UNIX socket (issue 15 #11). Anonymous socket pairs still work."""
    folder = Path(tempfile.mkdtemp(prefix="gyre-unix-"))
    os.chmod(folder, 0o755)
    path = folder / "service.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    os.chmod(path, 0o777)
    listener.listen(1)
    code = (
        "import socket\n"
        "a, b = socket.socketpair(); a.send(b'x'); print('PAIR', b.recv(1).decode())\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.connect({str(path)!r}); print('CONNECTED')\n"
    )
    try:
        result = run(_sandbox(run_as=run_as).run(["/usr/bin/python3", "-I", "-c", code], workspace))
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing reached the service
            listener.accept()
    finally:
        listener.close()
        shutil.rmtree(folder)
    assert "PAIR x" in result.stdout_tail, result.stderr_tail
    assert "CONNECTED" not in result.stdout_tail
    assert "PermissionError" in result.stderr_tail, result.stderr_tail
    assert result.guarantees["no_unix_sockets"] is True


def _processes_with(token: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_timeout_kills_the_whole_process_group(workspace):
    token = "4242.125"  # a unique sleep duration to find stray processes by
    cmd = ["bash", "-c", f"sleep {token} & sleep {token} & wait"]
    result = run(_sandbox(timeout_s=0.5).run(cmd, workspace))
    assert result.timed_out and result.returncode is None  # the 4242 s sleeps were cut at the timeout
    assert _processes_with(token) == []


def test_background_processes_do_not_outlive_a_finished_check(workspace):
    token = "4343.125"
    result = run(_sandbox().run(["bash", "-c", f"(sleep {token} &) ; echo started"], workspace))
    assert result.returncode == 0 and "started" in result.stdout_tail
    assert _processes_with(token) == []


def test_deadline_caps_the_timeout(workspace):
    import time

    result = run(_sandbox(timeout_s=60).run(["sleep", "30"], workspace, deadline=time.time() + 0.5))
    assert result.timed_out  # uncapped, the 30 s sleep would have ended well inside the 60 s timeout: exit 0
    with pytest.raises(SandboxError, match="no time left"):
        run(_sandbox().run(["true"], workspace, deadline=time.time() - 1))


def test_cpu_limit_kills_a_spinning_check(workspace):
    result = run(_sandbox(cpu_s=1).run(["bash", "-c", "while :; do :; done"], workspace))
    assert not result.timed_out
    assert result.returncode == -signal.SIGXCPU


def test_memory_limit_stops_a_large_allocation(workspace):
    cmd = ["bash", "-c", 'x=$(head -c 300000000 /dev/zero | tr "\\0" a); echo "${#x}"; echo DONE']
    result = run(_sandbox(memory_bytes=128 << 20).run(cmd, workspace))
    assert "DONE" not in result.stdout_tail and result.returncode != 0
    assert "cannot allocate" in result.stderr_tail


def test_environment_is_scrubbed(workspace, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_SECRET_TOKEN", "sk-do-not-leak")
    result = run(_sandbox(env={"EXTRA": "1"}).run(["bash", "-c", "env"], workspace))
    assert "sk-do-not-leak" not in result.stdout_tail
    assert "EXTRA=1" in result.stdout_tail and "GYRE_SCORE_FILE=" in result.stdout_tail


def test_score_file_lives_outside_the_copy(workspace):
    cmd = [
        "bash",
        "-c",
        'case "$GYRE_SCORE_FILE" in "$GYRE_WORKSPACE"/*) exit 3;; esac; echo 0.25 > "$GYRE_SCORE_FILE"',
    ]
    result = run(_sandbox().run(cmd, workspace))
    assert result.returncode == 0 and result.score_file.strip() == "0.25"


def test_missing_command_is_a_sandbox_error_not_a_result(workspace):
    with pytest.raises(SandboxError, match="could not start"):
        run(_sandbox().run(["definitely-not-a-command-xyz"], workspace))


def test_required_isolation_refuses_when_disabled_platform(workspace):
    sb = Sandbox(SandboxConfig(isolation="off"))
    assert sb.isolated() is False
    assert sb.guarantees()["no_network"] is False


@needs_isolation
@pytest.mark.skipif(os.geteuid() != 0, reason="per-run uids are taken as root")
def test_a_fork_bomb_never_touches_a_concurrent_checks_process_limit(workspace):
    """Before: every check ran as uid 65534 and RLIMIT_NPROC counts per uid: a fork bomb in one artifact turned an
    innocent concurrent check into a valid 0.0. Each run now has its own uid."""
    import asyncio

    bomb = _sandbox(max_processes=12, timeout_s=30)
    innocent = _sandbox(max_processes=12, timeout_s=30)
    # the bomb fills its process limit and holds it while the innocent check runs (cancelled afterwards)
    bomb_cmd = ["bash", "-c", "for i in $(seq 40); do sleep 60 & done 2>/dev/null; echo full; wait"]
    ok_cmd = ["bash", "-c", "for i in 1 2 3 4 5 6; do (true) & done; wait && echo innocent-ok"]

    async def scenario():
        bomb_task = asyncio.ensure_future(bomb.run(bomb_cmd, workspace, deadline=None))
        # gate: wait until the bomb's processes hold its limit (count `sleep 60` processes of a non-root uid)
        for _ in range(3000):
            if _count_sleepers() >= 8:
                break
            await asyncio.sleep(0.01)
        assert _count_sleepers() >= 8, "the bomb never filled its limit"
        result = await innocent.run(ok_cmd, workspace)
        bomb_task.cancel()
        return result

    result = run(scenario())
    assert result.returncode == 0 and "innocent-ok" in result.stdout_tail, result.stderr_tail


def _count_sleepers() -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == b"sleep\x0060\x00" and os.stat(f"/proc/{pid}").st_uid != 0:
                    n += 1
        except OSError:
            pass
    return n


@needs_isolation
@pytest.mark.skipif(os.geteuid() != 0, reason="making a setuid-root binary needs root")
def test_setuid_binaries_do_not_gain_privileges(workspace):
    """Before: setuid binaries still ran with their owner's privileges inside the sandbox. A setuid-root copy of `id`
    (outside the copy, on a mount that honours setuid) reports euid=0 when the bit takes effect; in the check it runs
    with the check's own uid: no_new_privs and the nosuid remounts each neutralize it."""
    outside = Path(tempfile.mkdtemp(prefix="gyre-setuid-"))
    os.chmod(outside, 0o755)
    setuid_id = outside / "id"
    shutil.copy(shutil.which("id"), setuid_id)
    os.chown(setuid_id, 0, 0)
    os.chmod(setuid_id, 0o4755)
    try:
        script = f"grep NoNewPrivs /proc/self/status; id -u; {setuid_id}"
        result = run(_sandbox().run(["bash", "-c", script], workspace))
        assert result.returncode == 0, result.stderr_tail
        assert "euid=" not in result.stdout_tail, "the setuid bit took effect"
        uid = result.stdout_tail.splitlines()[1]
        assert uid != "0" and result.stdout_tail.splitlines()[2].startswith(f"uid={uid} ")
        assert "NoNewPrivs:\t1" in result.stdout_tail
        assert result.guarantees["no_new_privileges"] is True
    finally:
        shutil.rmtree(outside)


def test_stale_sandbox_copies_of_a_dead_service_are_swept(tmp_path):
    """A crashed service leaves its private copies behind; the next run removes those whose owner lock is free."""
    import fcntl

    from gyre_eval.sandbox import _new_root, sweep_stale_sandboxes

    live_root, live_fd = _new_root(str(tmp_path))
    dead_root, dead_fd = _new_root(str(tmp_path))
    (dead_root / "copy.txt").write_text("leaked")
    os.close(dead_fd)  # its owner is gone (a crash releases the flock the same way)
    try:
        removed = sweep_stale_sandboxes(str(tmp_path))
        assert removed == [dead_root.name] and not dead_root.exists() and live_root.exists()
        fcntl.flock(live_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # still ours
    finally:
        os.close(live_fd)


def test_concurrent_checks_sweeping_at_once_never_fail_or_remove_a_live_sandbox(tmp_path):
    """Every check sweeps before it starts. Two sweeps listing the same finished lock once raced: the loser's open
    failed (FileNotFoundError ended a check in CI). Several threads now create, sweep and remove roots at once; none
    fails, no live root is removed, and nothing is left behind."""
    import threading

    from gyre_eval.sandbox import _new_root, _remove_root, sweep_stale_sandboxes

    errors: list[BaseException] = []
    lost: list[str] = []

    def check_loop() -> None:
        try:
            for _ in range(60):
                sweep_stale_sandboxes(str(tmp_path))
                root, owner = _new_root(str(tmp_path))
                (root / "copy.txt").write_text("mine")
                sweep_stale_sandboxes(str(tmp_path))
                if not (root / "copy.txt").exists():
                    lost.append(root.name)
                _remove_root(root, owner)
        except BaseException as e:  # reported to the test thread
            errors.append(e)

    threads = [threading.Thread(target=check_loop) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and lost == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gyre-sbx-locks"]
    assert list((tmp_path / "gyre-sbx-locks").iterdir()) == []


def test_probe_folders_of_killed_probers_are_swept(tmp_path):
    """A process killed mid-probe never ran the probe's cleanup (11 empty folders in /tmp after one CI run); the next
    probe removes the folders whose prober is gone, and none of a live process."""
    import subprocess
    import sys

    from gyre_eval.sandbox import _sweep_stale_probes

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"gyre-sbx-probe-{dead_pid}-abc"
    mine = tmp_path / f"gyre-sbx-probe-{os.getpid()}-def"
    live = tmp_path / "gyre-sbx-probe-1-ghi"  # pid 1 is alive
    other = tmp_path / "gyre-sbx-probe-unnamed"  # not ours to judge
    for d in (stale, mine, live, other):
        d.mkdir()
    assert not Path(f"/proc/{dead_pid}").exists()
    assert _sweep_stale_probes(str(tmp_path)) == 1
    assert not stale.exists() and mine.exists() and live.exists() and other.exists()


@needs_isolation
def test_checks_die_when_the_service_dies(workspace, tmp_path):
    """Before: a gyre-eval crash orphaned running checks (and leaked their copies)."""
    import subprocess
    import sys
    import textwrap
    import time

    prog = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from gyre_eval.sandbox import Sandbox, SandboxConfig
        sb = Sandbox(SandboxConfig(timeout_s=120, scratch_dir={str(tmp_path)!r}))
        async def main():
            task = asyncio.ensure_future(sb.run(["bash", "-c", "echo started; sleep 77"], Path({str(workspace)!r})))
            await asyncio.sleep(3600)
        asyncio.run(main())
        """
    )
    service = subprocess.Popen([sys.executable, "-c", prog])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _sleeping(b"77"):  # gate: the check is running
            time.sleep(0.05)
        assert _sleeping(b"77"), "the check never started"
        service.kill()
        service.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _sleeping(b"77"):
            time.sleep(0.05)
        assert not _sleeping(b"77"), "the check outlived the service"
    finally:
        if service.poll() is None:
            service.kill()


def _sleeping(arg: bytes) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read() == b"sleep\x00" + arg + b"\x00":
                        return True
            except OSError:
                pass
    return False


@needs_isolation
@pytest.mark.skipif(os.geteuid() != 0, reason="a root-only file needs root")
def test_a_score_file_symlink_never_reads_a_file_the_check_cannot(workspace, tmp_path):
    """Before: the service (root) read $GYRE_SCORE_FILE after the check, following a symlink the check planted: a
    root-only file's text came back as the score file (and into provenance through the parse error). Now the
    namespace's init reads it as the check's uid, never through a symlink."""
    secret = Path(tempfile.mkdtemp(prefix="gyre-secret-")) / "secret.txt"
    secret.write_text("0.9 root-only\n")
    os.chmod(secret, 0o600)
    os.chmod(secret.parent, 0o755)
    try:
        cmd = ["bash", "-c", f'ln -s {secret} "$GYRE_SCORE_FILE"; cat {secret} || echo unreadable']
        result = run(_sandbox().run(cmd, workspace))
        assert "unreadable" in result.stdout_tail
        assert result.score_file is None
    finally:
        shutil.rmtree(secret.parent)
