"""Settings every test directory shares.

Property tests draw the same examples on every run and machine and print what reproduces a failure; every
counterexample one ever found is kept in the test's source (see the hypothesis profile below).

The system packages the selected tests need are installed here when missing (as root), or the run stops at once with
one line naming them; the Claude Code CLI is installed by tests/conftest.py."""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

# Hypothesis: derandomized, so CI draws the same examples on every run and a failure there reproduces anywhere (it
# no longer meets a case by chance), and print_blob, so a failure prints its @reproduce_failure line. No example
# database: one keys its entries by the test's source and hypothesis's encoding (an edit or an upgrade drops them
# silently) and rewrites itself as examples pass (CI would write into the tree). A counterexample found is kept as an
# @example on the property, or, for a test drawing from st.data(), as a named test replaying it. To search for new
# ones: `pytest --hypothesis-profile=gyre-explore` (fresh random draws; its database is the ignored .hypothesis/).
settings.register_profile("gyre", derandomize=True, database=None, print_blob=True)
settings.register_profile("gyre-explore", derandomize=False, print_blob=True)
settings.load_profile("gyre")

# One intra-op thread for torch in every test process and what it starts (torch reads OMP_NUM_THREADS when it is first
# imported: this file is loaded before any test module). The suite runs on two xdist workers on two cores and its
# models are tiny: a second thread per process only spins against the other worker. Measured on 2 cores: 32 episodes
# of the demo policy took 2.8 s of CPU on one thread and 9-17 s on two; gyre-train's tests ran ~10x faster. A cell
# worker sets its own (`cpu_threads`); a test that wants more threads sets them.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# What the tests need from the system (Debian's package names), by the test paths that need it: the README's test
# command installs what is missing with apt-get when it runs as root, else stops at once with one line naming it.
# tests/test_workspace.py checks that every test file naming chromium, bubblewrap or runc is listed here.
SYSTEM_PACKAGES: dict[str, tuple[str, ...]] = {
    # the dashboard and report tests drive Debian's chromium headless with playwright (no browser download)
    "chromium": ("tests/test_dashboard.py", "tests/test_report.py"),
    # the execution sandbox (gyre_sched.sandbox) at launch and its probes
    "bubblewrap": (
        "packages/gyre-sched/tests/test_sandbox_check.py",
        "tests/test_harbor_env.py",  # Harbor's agents and verifier run in it too
        "tests/test_harbor_run.py",
        "tests/test_harbor_tasks.py",
        "tests/test_harness_contract.py",
        "tests/test_harness_sandbox.py",
        "tests/test_sandbox_run.py",
    ),
    # the same sandbox through an OCI container runtime
    "runc": ("tests/test_harness_sandbox.py", "tests/test_sandbox_run.py"),
    # Mooncake's transfer engine loads it even for TCP; a run uses Mooncake wherever it loads
    "libibverbs1": ("tests", "packages/gyre-cell/tests"),
}


def _installed(package: str) -> bool:
    if package == "libibverbs1":
        try:
            ctypes.CDLL("libibverbs.so.1")  # as Mooncake loads it (LD_LIBRARY_PATH included)
        except OSError:
            return False
        return True
    return shutil.which({"bubblewrap": "bwrap"}.get(package, package)) is not None


def _selected(config) -> list[Path]:
    """The paths this session collects from: its arguments (less any ::test part), else the configured testpaths."""
    args = [a.split("::")[0] for a in config.args if not a.startswith("-")]
    if not args:
        return [config.rootpath / p for p in config.getini("testpaths")]
    return [(config.invocation_params.dir / a).resolve() for a in args]


def _needed(config) -> list[str]:
    """The packages of the selected paths: a path needs what any test path under or above it needs."""
    selected = _selected(config)
    needed = []
    for package, paths in SYSTEM_PACKAGES.items():
        for path in (config.rootpath / p for p in paths):
            if any(path == s or path.is_relative_to(s) or s.is_relative_to(path) for s in selected):
                needed.append(package)
                break
    return needed


def _apt_get_install(packages: list[str]) -> str:
    """apt-get install (after an update if the first try fails); '' on success, else its last line of output."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=600", *packages]
    proc = subprocess.run(install, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
        proc = subprocess.run(install, capture_output=True, text=True, env=env)
    if proc.returncode == 0:
        return ""
    return (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["(no output)"])[-1]


def pytest_configure(config):
    if hasattr(config, "workerinput") or config.option.help or config.option.version:
        return  # an xdist worker: the controller set the machine up before it started
    missing = [p for p in _needed(config) if not _installed(p)]
    if not missing:
        return
    if os.geteuid() != 0:
        why = "not root"
    elif shutil.which("apt-get") is None:
        why = "no apt-get on PATH"
    else:
        why = _apt_get_install(missing)
        missing = [p for p in missing if not _installed(p)]
        if not missing:
            return
    names = " ".join(missing)
    raise pytest.UsageError(
        f"the tests need Debian's {names} ({why}): run `apt-get install -y {names}` as root"
    )
