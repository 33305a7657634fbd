"""Top-level test set-up: the pinned Claude Code CLI (package.json / package-lock.json) is installed with `npm ci` when a
selected test drives it and it is missing, so the README's test command works on a fresh machine. Without npm, or
if the install fails, those tests fail with one line saying how to install it."""

import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLAUDE = ROOT / "node_modules" / ".bin" / "claude"
NEEDS_CLI = ("test_claude_code_", "test_harness_contract")
# What the interpreter had imported once collection was done (every xdist worker collects the whole suite, so an
# import at collection is paid once per worker): tests/test_collection_imports.py checks it holds no slow library.
COLLECTED_MODULES = pytest.StashKey[frozenset[str]]()


def pytest_collection_finish(session):
    session.config.stash[COLLECTED_MODULES] = frozenset(sys.modules)


# A hang guard, not a bound on speed: a test waiting on an event fails after this, never sooner.
HANG_GUARD_S = 300.0


def processes_gone(pids, what: str = "processes") -> None:
    """Block until every process in `pids` has exited. A pidfd becomes readable when its process exits (a zombie
    counts as exited), so this waits on the exit events themselves: no sleep, no polling of /proc, no race with a
    process that exits between two looks. Fails, naming what is left, only after HANG_GUARD_S."""
    poller, fds = select.poll(), {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone already
        fds[fd] = pid
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while fds and (left_s := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left_s * 1000):
                poller.unregister(fd)
                os.close(fd)
                del fds[fd]
        left = sorted(fds.values())
        assert not left, f"{what} still running after {HANG_GUARD_S:.0f} s: " + ", ".join(
            f"{pid} {_cmdline(pid)}" for pid in left
        )
    finally:
        for fd in fds:
            os.close(fd)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:160].decode(errors="replace")
    except OSError:
        return "(gone)"


@pytest.fixture
def wait_gone():
    """`wait_gone(pids, what)`: the gate on processes exiting (see processes_gone)."""
    return processes_gone


@pytest.fixture
def collected_modules(request) -> frozenset[str]:
    """The names in sys.modules when collection ended, before any test ran."""
    return request.config.stash[COLLECTED_MODULES]


def pytest_collection_modifyitems(session, config, items):
    if CLAUDE.exists() or not (ROOT / "package.json").exists():
        return
    if not any(Path(str(item.fspath)).name.startswith(NEEDS_CLI) for item in items):
        return
    # Every xdist worker collects: one installs while the others wait for it, then find the CLI there.
    with open(ROOT / ".npm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not CLAUDE.exists():
            _npm_ci()


def _npm_ci() -> None:
    if shutil.which("npm") is None:
        print(
            "\nClaude Code CLI missing and npm not found: install Node.js + npm, then run `npm ci` at the repo root"
        )
        return
    proc = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"\n`npm ci` failed ({last}): the Claude Code tests need `npm ci` at the repo root")


class FaultRun:
    """A `gyre run` of configs/elastic-k3.toml with a fault injected at a gate: call it with
    `(tmp_path, run_dir, gate, act, *sets)`; once `gate(trace lines)` holds it calls `act()` (kill, stop a process),
    waits for the run and returns its summary; the controller's stderr is kept in tmp_path/controller.log. A run
    that fails is returned as None when `expect_failure`, else the test fails with its last lines."""

    @staticmethod
    def trace(run_dir: Path) -> list[dict]:
        """The trace's complete lines so far."""
        path = run_dir / "trace.jsonl"
        if not path.exists():
            return []
        out = []
        for raw in path.read_bytes().splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                break  # a line being written
        return out

    @staticmethod
    def worker_pid(run_dir: Path, cell: int) -> int:
        """The `gyre-cell worker --config RUN/cells/cell-<cell>.json` process."""
        needle = str(run_dir / "cells" / f"cell-{cell}.json").encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if needle in (entry / "cmdline").read_bytes():
                        return int(entry.name)
                except OSError:
                    continue
        raise AssertionError(f"no worker process for cell {cell}")

    def __call__(
        self,
        tmp_path: Path,
        run_dir: Path,
        gate,
        act,
        *sets: str,
        hold: int = 1,
        expect_failure: bool = False,
    ) -> dict | None:
        argv = [
            sys.executable,
            "-m",
            "gyre.cli",
            "run",
            str(ROOT / "configs" / "elastic-k3.toml"),
            "--run-dir",
            str(run_dir),
            "--set",
            f"debug.hold_core_for_join={hold}",
            "--set",
            "dashboard.enabled=false",
            "--quiet",
            *(x for kv in sets for x in ("--set", kv)),
        ]
        proc = subprocess.Popen(
            argv, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 600
        try:
            while not gate(self.trace(run_dir)):
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, "the gate never opened"
                time.sleep(0.05)
            act()
            out, err = proc.communicate(timeout=900)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        (tmp_path / "controller.log").write_bytes(err)  # its warnings (lost, restarted), for a failure below
        if expect_failure:
            assert proc.returncode != 0, "the run succeeded"
            return None
        assert proc.returncode == 0, err.decode()[-3000:]
        return json.loads(out.decode().splitlines()[-1])


@pytest.fixture
def fault_run() -> FaultRun:
    return FaultRun()
