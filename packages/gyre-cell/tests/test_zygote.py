"""The zygote (gyre_cell.zygote): children forked from it run their entry as a plain start would run them (argv,
environment, working directory, logs, session, title, a secret by fd), their exit statuses come back as Popen's do,
they die with the zygote, and a preload that fails names itself. Real processes; no sleeps order anything (each wait
is on a report file the child writes, or on an exit)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gyre_cell.errors import ZygoteError
from gyre_cell.zygote import Zygote

PROBE_DIR = Path(__file__).parent / "zygote_probe"
SECRET = "tok-" + "9f" * 16


@pytest.fixture
def zygote():
    env = {**os.environ, "PYTHONPATH": str(PROBE_DIR)}
    z = Zygote.start(["colorsys"], env)
    z.wait_ready(timeout_s=120)
    yield z
    z.close()


def _spawn(z: Zygote, tmp_path: Path, mode: str, **kw):
    report = tmp_path / f"report-{mode}.json"
    log = tmp_path / "child.log"
    proc = z.spawn(
        "zygote_probe:run",
        [str(report), mode],
        title=f"probe-worker --config {report}",
        env=kw.pop("env", {"ONLY": "this"}),
        cwd=str(tmp_path),
        stdout=str(tmp_path / "child.out"),
        stderr=str(log),
        **kw,
    )
    return proc, report


def _report(path: Path, proc, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None or path.exists(), f"child ended ({proc.returncode}) without a report"
        assert time.monotonic() < deadline, "no report"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_a_child_runs_its_entry_as_a_plain_start_would(zygote, tmp_path):
    proc, report = _spawn(zygote, tmp_path, "exit", secrets={"--token": SECRET})
    assert proc.wait(timeout=60) == 7  # the entry's return value is the exit status
    info = _report(report, proc)
    # its own session: the launcher signals its group
    assert info["pid"] == proc.pid and info["sid"] == proc.pid
    assert info["ppid"] == zygote.pid
    assert info["args"][:2] == [str(report), "exit"] and info["args"][2] == "--token"
    assert info["token"] == SECRET  # read from the fd it was given
    assert info["env"] == {"ONLY": "this"} and info["cwd"] == str(tmp_path)
    assert info["cmdline"].startswith(f"probe-worker --config {report}")  # ps shows what it stands for
    assert SECRET not in info["cmdline"] and SECRET not in info["proc_environ"]
    assert info["preloaded"] and info["stdin"] == ""
    assert (tmp_path / "child.out").read_text() == "to stdout\n"
    assert (tmp_path / "child.log").read_text() == "to stderr\n"


def test_exit_statuses_read_like_popens(zygote, tmp_path):
    proc, report = _spawn(zygote, tmp_path, "hold")
    _report(report, proc)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
    bad = zygote.spawn(
        "zygote_probe:no_such_entry",
        [],
        title="x",
        env={},
        cwd=str(tmp_path),
        stdout=str(tmp_path / "b.out"),
        stderr=str(tmp_path / "b.err"),
    )
    assert bad.wait(timeout=30) == 1
    assert "AttributeError" in (tmp_path / "b.err").read_text()  # the traceback is in its log


def test_children_die_with_the_zygote(zygote, tmp_path):
    procs = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        procs.append(_spawn(zygote, tmp_path / str(i), "hold"))
    for proc, report in procs:
        _report(report, proc)
    os.kill(zygote.pid, signal.SIGKILL)
    for proc, _ in procs:
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert not Path(f"/proc/{proc.pid}").exists() or _state(proc.pid) == "Z"
    with pytest.raises(ZygoteError):
        _spawn(zygote, tmp_path, "exit")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_preload_that_fails_names_itself():
    z = Zygote.start(["colorsys", "gyre_no_such_module"], dict(os.environ))
    try:
        with pytest.raises(ZygoteError, match="gyre_no_such_module"):
            z.wait_ready(timeout_s=120)
    finally:
        z.close()


def test_close_ends_the_zygote_at_once_whatever_its_preloads_left_running():
    """A preload left a thread that never ends (the preloaded torch and transformers held the zygote's exit for
    seconds): `close` ends it without the interpreter's shutdown, so it exits by itself (0), never killed (-9, the
    5 s that every `gyre run` waited at its end)."""
    z = Zygote.start(["zygote_lingering_thread"], {**os.environ, "PYTHONPATH": str(PROBE_DIR)})
    try:
        z.wait_ready(timeout_s=120)
    finally:
        z.close()
    assert z.returncode == 0
