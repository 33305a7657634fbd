"""Services that stop answering without exiting (gyre.launch.health): a stopped process plays a hung one or a host
gone quiet. Before, the launcher saw only exits: a stopped gyre-eval ended a run after 70 s with
"run failed: ReadTimeout:", naming nothing.

- `HealthWatch` against real loopback servers: one that answers is never reported however long the (injected) clock
  runs; a SIGSTOPped one is reported once `hang_s` passed since its last answer, and only once.
- End to end (slow): gyre-eval stopped mid-run is killed and started again on its port, and the run completes every
  step with every execution assessed; the proxy stopped mid-run ends the run with one line naming it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.launch.health import HealthWatch

_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}/health"


def test_health_watch_reports_a_stopped_service_once_and_never_an_answering_one():
    clock = _Clock()
    watch = HealthWatch(hang_s=30.0, probe_timeout_s=1.0, clock=clock)
    live, live_url = _server()
    stopped, stopped_url = _server()
    try:
        watch.add("live", live_url)
        watch.add("stopped", stopped_url)
        assert asyncio.run(watch.hung()) == []
        os.kill(stopped.pid, signal.SIGSTOP)  # accepts connections (the kernel's backlog), answers nothing
        for t in (15.0, 29.0):
            clock.t = t
            assert asyncio.run(watch.hung()) == []  # silent, but not for 30 s yet
        assert watch.silent_for("stopped") == 29.0 and watch.silent_for("live") == 0.0
        clock.t = 30.0
        assert asyncio.run(watch.hung()) == ["stopped"]
        clock.t = 1000.0
        assert asyncio.run(watch.hung()) == []  # reported once; the live one answered every probe
        watch.add("stopped", stopped_url)  # watched again (after a restart): its silence counts from now
        clock.t = 1010.0
        assert asyncio.run(watch.hung()) == []
        clock.t = 2000.0  # a pause in probing (between two supervised phases) is not silence
        watch.restart_clock()
        clock.t = 2001.0
        assert asyncio.run(watch.hung()) == [] and watch.silent_for("stopped") == 1.0
    finally:
        for proc in (live, stopped):
            proc.kill()
            proc.wait()


def test_health_watch_counts_a_refused_connection_as_silence():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/health"
    clock = _Clock()
    watch = HealthWatch(hang_s=5.0, clock=clock)
    watch.add("gone", url)
    clock.t = 5.0
    assert asyncio.run(watch.hung()) == ["gone"]
    with pytest.raises(ValueError, match="hang_s"):
        HealthWatch(hang_s=0)


def _assessed(lines: list[dict]) -> bool:
    return any(x["ev"] == "assessed" for x in lines)


def _stop(run_dir: Path, name: str) -> int:
    pid = json.loads((run_dir / "services.json").read_text())["pids"][name]
    os.kill(pid, signal.SIGSTOP)
    return pid


@pytest.mark.slow
def test_a_hung_gyre_eval_is_killed_and_restarted_and_the_run_completes(fault_run, tmp_path, wait_gone):
    run_dir = tmp_path / "run"
    stopped: list[int] = []
    steps = 4
    summary = fault_run(
        tmp_path,
        run_dir,
        _assessed,
        lambda: stopped.append(_stop(run_dir, "gyre-eval")),
        f"train.steps={steps}",
        "launcher.service_hang_s=10",
    )
    assert summary["steps"] == steps
    (pid,) = stopped
    wait_gone([pid], "the stopped gyre-eval (the launcher kills it before the restart)")
    log = (tmp_path / "controller.log").read_text()
    assert "gyre-eval no answer to its health check for 10 s: killing it" in log
    assert (
        "gyre-eval stopped answering (no answer to its health check for 10 s) and was killed; restarted"
        in log
    )
    services = json.loads((run_dir / "services.json").read_text())
    assert services["pids"]["gyre-eval"] != pid  # the new one, on the same port
    lines = fault_run.trace(run_dir)
    terminated = {x["execution"] for x in lines if x["ev"] == "terminate" and x["outcome"] == "completed"}
    assessed = {x["execution"] for x in lines if x["ev"] == "assessed"}
    assert terminated and terminated <= assessed, sorted(terminated - assessed)


@pytest.mark.slow
def test_a_hung_proxy_ends_the_run_with_one_line_naming_it(fault_run, tmp_path):
    run_dir = tmp_path / "run"
    fault_run(
        tmp_path,
        run_dir,
        _assessed,
        lambda: _stop(run_dir, "proxy"),
        "train.steps=4",
        "launcher.service_hang_s=10",
        expect_failure=True,
    )
    last = (tmp_path / "controller.log").read_text().strip().splitlines()[-1]
    assert last == (
        "gyre run: run failed: ServiceError: proxy stopped answering (no answer to its health check for 10 s) and "
        f"was killed; see {run_dir}/logs/proxy.log"
    ), last
