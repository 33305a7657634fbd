"""`kill -9` against a real `gyre run`: each service, killed at a gated point, either lets the run recover or ends it
with one line naming that service, how it ended and its log; a killed controller leaves no process behind.
A run that fails learns of the death from the process itself (its exit status in the line), not from a timeout
running out: that is what "fails at once" means here, asserted without a clock (how fast goes to the log, -s).
gyre-eval recovers (restarted by the launcher); a satellite cell recovers once dead-cell recovery is in (issue 14);
the proxy and a standalone engine end the run.

Each case is one small run (one cell and one standalone engine, 2 steps, mu=1; two cells for the satellite). The
kill waits for a real event of the run (a trace line, an agent process), never a timer. The proxy case first
checks the run's service tokens while everything is up: every service answers 401 without its token, and no
string in any child's or agent's /proc/PID/cmdline or /proc/PID/environ is accepted as a token by any service.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from gyre_sched.trace import iter_trace

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SMALL = ("cluster.cells=1", "scheduler.mu=1")  # colocate-standalone.toml: 1 cell + 1 standalone engine, B=2

pytestmark = pytest.mark.slow


class Run:
    """A `gyre run` subprocess with its stderr in a file (read at the end: a pipe could fill and block it)."""

    def __init__(self, run_dir: Path, config: str, *sets: str, steps: int = 2) -> None:
        self.run_dir = run_dir
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.err_path = run_dir.parent / f"{run_dir.name}.stderr"
        argv = [
            sys.executable,
            "-m",
            "gyre.cli",
            "run",
            str(CONFIGS / config),
            "--run-dir",
            str(run_dir),
            "--steps",
            str(steps),
            "--quiet",
        ]
        for s in sets:
            argv += ["--set", s]
        with self.err_path.open("wb") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, cwd=ROOT, text=True)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, what: str, found: Callable[[], object], timeout_s: float = 600.0):
        """The gate: poll a condition of the live run (fails at once if the run ended first)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if value := found():  # an event, a pid, a non-empty table
                return value
            assert self.proc.poll() is None, f"run ended before {what}: {self.stderr[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s"
            time.sleep(0.05)

    def trace_event(self, match: Callable[[dict], bool]) -> dict | None:
        trace = self.run_dir / "trace.jsonl"
        if not trace.exists():
            return None
        for line in trace.read_bytes().splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # the line being written
                continue
            if match(event):
                return event
        return None

    def services(self) -> dict:
        return json.loads((self.run_dir / "services.json").read_text())

    def wait_services(self, *names: str) -> dict:
        def ready():
            path = self.run_dir / "services.json"
            if not path.exists():
                return None
            try:
                info = json.loads(path.read_text())
            except ValueError:
                return None
            return (
                info
                if info["proxy"] and info["gyre-eval"] and all(n in info["pids"] for n in names)
                else None
            )

        return self.wait_for("services", ready)

    def assert_fails_naming(
        self,
        service: str,
        killed_at: float,
        named: str | None = None,
        how: str = "exited (killed by SIGKILL)",
    ) -> None:
        """The run fails; the last stderr line (the only failure line) names the service (`named`, default its log's
        name), how it ended (`how`, default its exit by the SIGKILL: the death itself was seen, no timeout ran out)
        and its log."""
        try:
            # a hang guard: a run that waited out a timeout instead fails on `how`
            self.proc.wait(timeout=300)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        took = time.monotonic() - killed_at
        err = self.stderr
        assert self.proc.returncode == 1, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        failures = [line for line in err.splitlines() if "run failed" in line]
        assert len(failures) == 1 and err.strip().splitlines()[-1] == failures[0], err[-3000:]
        log = self.run_dir / "logs" / f"{service}.log"
        assert failures[0].startswith("gyre run: run failed: ") and str(log) in failures[0], failures[0]
        assert (named or service) in failures[0].split("; see ")[0], failures[0]
        assert how in failures[0] and "Timeout" not in failures[0], failures[0]
        print(f"{service}: failed {took:.1f} s after the kill: {failures[0]}")  # shown with -s


def _proc_strings(pid: int) -> list[str]:
    """Every argv element and environment value of a process, split where a token could start or end."""
    out = []
    for name in ("cmdline", "environ"):
        try:
            raw = Path(f"/proc/{pid}/{name}").read_bytes()
        except OSError:
            continue
        for item in raw.split(b"\0"):
            text = item.decode(errors="replace")
            out.append(text)
            out += re.findall(r"[A-Za-z0-9_\-]{16,}", text)  # a token inside `--flag=TOKEN`, `KEY=TOKEN`, ...
    return out


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _agent_pid(run: Run) -> int | None:
    """A live built-in agent of this run (its argv names the run's workspace)."""
    marker = str(run.run_dir / "workspaces")
    for pid in _descendants(run.proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if "agent.py" in cmdline and marker in cmdline and environ:
            return pid
    return None


def _protected_calls(info: dict) -> list[tuple[str, str]]:
    """One call per service that needs that service's token (method, URL)."""
    return [
        ("GET", f"{info['cells'][0]}/cell/status"),
        ("POST", f"{info['cells'][0]}/pause_generation"),
        ("GET", f"{info['standalone'][0]}/server_info"),
        ("GET", f"{info['proxy']}/admin/executions/g0.e0"),
        ("GET", f"{info['gyre-eval']}/v1/assessments"),
    ]


def _check_tokens(run: Run, info: dict) -> None:
    with httpx.Client(timeout=30.0) as http:
        # Liveness answers without a token (so the 401s below come from the services themselves).
        for url in (
            f"{info['cells'][0]}/health",
            f"{info['standalone'][0]}/health",
            f"{info['proxy']}/health",
            f"{info['gyre-eval']}/healthz",
        ):
            assert http.get(url).status_code == 200, url
        calls = _protected_calls(info)
        for method, url in calls:
            assert http.request(method, url).status_code == 401, (method, url)
            wrong = {"authorization": "Bearer not-the-token", "x-admin-token": "not-the-token"}
            assert http.request(method, url, headers=wrong).status_code == 401, (method, url)
        # Nothing a local process can read from /proc authenticates: every child of the run, and an agent.
        agent = run.wait_for("a running agent", lambda: _agent_pid(run))
        pids = set(info["pids"].values()) | _descendants(run.proc.pid) | {agent}
        candidates = {s for pid in pids for s in _proc_strings(pid) if 16 <= len(s) <= 200}
        env_of_agent = Path(f"/proc/{agent}/environ").read_bytes()
        assert b"OPENAI_API_KEY=" in env_of_agent  # its own execution credential, and nothing else secret
        assert candidates, "no strings read from /proc"
        for token in sorted(candidates):
            for method, url in calls:
                headers = {"authorization": f"Bearer {token}", "x-admin-token": token}
                assert http.request(method, url, headers=headers).status_code == 401, (token[:8], url)
        assert not list((run.run_dir).rglob("*.token")), "a token file in the run directory"


def test_kill_proxy_after_tokens_checked(tmp_path):
    run = Run(tmp_path / "run", "colocate-standalone.toml", *SMALL)
    info = run.wait_services("cell-0", "standalone-0", "proxy", "gyre-eval")
    run.wait_for("a launch", lambda: run.trace_event(lambda e: e.get("ev") == "launch"))
    _check_tokens(run, info)
    killed_at = time.monotonic()
    os.kill(info["pids"]["proxy"], signal.SIGKILL)
    run.assert_fails_naming("proxy", killed_at)


def _assessments(run_dir: Path) -> dict[str, tuple[str, int]]:
    """execution -> (status, final) of every assessment gyre-eval stored (read-only)."""
    db = sqlite3.connect(f"file:{run_dir / 'assessments.sqlite'}?mode=ro", uri=True, timeout=30)
    try:
        return {e: (s, f) for e, s, f in db.execute("SELECT execution_id, status, final FROM assessments")}
    except sqlite3.OperationalError:  # created but not set up yet
        return {}
    finally:
        db.close()


def test_kill_gyre_eval_when_an_execution_ends_recovers(tmp_path):
    """gyre-eval is restarted on its port with its token; acknowledged assessments survive and the run completes."""
    run = Run(tmp_path / "run", "colocate-standalone.toml", *SMALL)
    info = run.wait_services("gyre-eval")
    run.wait_for(
        "a stored assessment",
        lambda: (run.run_dir / "assessments.sqlite").exists() and _assessments(run.run_dir),
    )
    before = _assessments(run.run_dir)  # acknowledged: submit returned
    killed_at = time.monotonic()
    os.kill(info["pids"]["gyre-eval"], signal.SIGKILL)
    out, _ = run.proc.communicate(timeout=900)
    err = run.stderr
    assert run.proc.returncode == 0, err[-3000:]
    print(f"gyre-eval: the run recovered and completed {time.monotonic() - killed_at:.1f} s after the kill")
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    assert "Traceback" not in err
    restarted = [
        line for line in err.splitlines() if "gyre-eval exited (killed by SIGKILL); restarted" in line
    ]
    assert len(restarted) == 1, err[-3000:]
    assert run.services()["pids"]["gyre-eval"] != info["pids"]["gyre-eval"]
    after = _assessments(run.run_dir)
    assert set(before) <= set(after) and all(final for _, final in after.values())
    assessed = [e["execution"] for e in iter_trace(run.run_dir / "trace.jsonl") if e.get("ev") == "assessed"]
    assert assessed and set(assessed) <= set(after)


def test_kill_standalone_engine_while_it_serves(tmp_path):
    run = Run(tmp_path / "run", "colocate-standalone.toml", *SMALL)
    info = run.wait_services("standalone-0")
    is_standalone_launch = lambda e: e.get("ev") == "launch" and e.get("engine") == "standalone"  # noqa: E731
    run.wait_for("a launch on the standalone engine", lambda: run.trace_event(is_standalone_launch))
    killed_at = time.monotonic()
    os.kill(info["pids"]["standalone-0"], signal.SIGKILL)
    run.assert_fails_naming("standalone-0", killed_at)


def test_kill_satellite_cell_while_it_trains(tmp_path):
    """Without dead-cell recovery the run ends naming the cell; with it (issue 14) the run completes its steps."""
    run = Run(tmp_path / "run", "colocate.toml", "scheduler.mu=1")
    info = run.wait_services("cell-0", "cell-1")
    claimed = lambda e: e.get("ev") == "microstep_claim" and e.get("cell") == 1  # noqa: E731
    run.wait_for("a claim by the satellite", lambda: run.trace_event(claimed))
    killed_at = time.monotonic()
    os.kill(info["pids"]["cell-1"], signal.SIGKILL)
    try:
        run.proc.wait(timeout=600)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    if run.proc.returncode == 0:  # recovered: every step done, every step's records counted
        print(f"cell-1: the run recovered in {time.monotonic() - killed_at:.1f} s after the kill")
        summary = json.loads(run.proc.stdout.read().strip().splitlines()[-1])
        assert summary["steps"] == 2
        rows = (run.run_dir / "metrics" / "steps.jsonl").read_text().splitlines()
        assert [json.loads(r)["policy_version"] for r in rows] == [1, 2]
        return
    run.assert_fails_naming("cell-1", killed_at, named="cell 1", how="stopped answering")


def test_kill_controller_leaves_no_process(tmp_path, wait_gone):
    run = Run(tmp_path / "run", "colocate-standalone.toml", *SMALL)
    info = run.wait_services("cell-0", "standalone-0", "proxy", "gyre-eval")
    run.wait_for("a running agent", lambda: _agent_pid(run))
    children = _descendants(run.proc.pid)
    assert set(info["pids"].values()) <= children
    assert any("agent.py" in " ".join(_proc_strings(p)) for p in children)  # a harness among them
    os.kill(run.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    run.proc.wait(timeout=300)  # a hang guard
    wait_gone(children, "the killed controller's processes")
    print(f"controller: {len(children)} processes gone {time.monotonic() - killed_at:.1f} s after")
