"""The launch sandbox's per-execution cgroups on the real cgroup trees of this machine: v1 hierarchies and the
cgroup2 (v2) mount, each chosen through `LaunchSandbox.cgroup_root`.

For each tree: the execution's cgroup is made, a harness's process tree joins it (the child before exec, as the
runner does), every limit `limits_applied` claims is enforced by the kernel (pids: a fork past `pids.max` fails;
memory: an allocation past the limit is killed), and removal kills the whole tree and removes the cgroup. On a hybrid
host the v2 tree offers none of pids/memory/cpu (those controllers are bound to the v1 hierarchies, and a controller
serves one hierarchy at a time), so there the v2 cgroup holds and kills the tree (`cgroup.kill`) but limits nothing,
and `limits_applied` must say so."""

import os
import subprocess
import sys
import uuid
from functools import partial
from pathlib import Path

import pytest

from gyre_sched.sandbox import LIMITED, LaunchSandbox

# Forks `n` sleepers (each a real process), then prints how many started and waits to be killed.
FORKER = r"""
import os, sys, time
n, started = int(sys.argv[1]), []
for _ in range(n):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    started.append(pid)
print(len(started), " ".join(map(str, started)), flush=True)
time.sleep(600)
"""
# Touches `mb` MiB one page at a time, then says so.
EATER = "b = bytearray({mb} << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('allocated', flush=True)"


def _trees() -> list:
    """The writable cgroup trees here: the v1 folder (/sys/fs/cgroup with pids/memory/cpu hierarchies) and every
    cgroup2 mount."""
    trees = []
    base = Path("/sys/fs/cgroup")
    if any((base / c / "cgroup.procs").exists() for c in LIMITED) and os.access(base / "pids", os.W_OK):
        trees.append(pytest.param(base, id="v1"))
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount, kind, *_ = line.split()
        if kind == "cgroup2" and os.access(mount, os.W_OK):
            trees.append(pytest.param(Path(mount), id="v2"))
            break
    return trees or [pytest.param(None, id="none")]


def _offered(root: Path) -> set[str]:
    if (root / "cgroup.controllers").exists():  # v2: what the root can delegate
        return set((root / "cgroup.controllers").read_text().split()) & set(LIMITED)
    return {c for c in LIMITED if os.access(root / c, os.W_OK)}


@pytest.mark.parametrize("root", _trees())
def test_an_executions_cgroup_limits_and_kills_its_whole_tree(root):
    if root is None:
        pytest.fail("no writable cgroup tree on this machine (run as root, or delegate a cgroup2 subtree)")
    sandbox = LaunchSandbox(cgroup_root=root, max_processes=6, memory_bytes=64 << 20, cpu_cores=0.5)
    name = f"test-{uuid.uuid4().hex[:8]}"
    cgroups = sandbox.make_cgroup(name)
    try:
        v2 = (root / "cgroup.controllers").exists()
        expected = (
            [root / "gyre" / f"{os.getpid()}-{name}"]
            if v2
            else [root / c / "gyre" / f"{os.getpid()}-{name}" for c in LIMITED if c in _offered(root)]
        )
        assert cgroups == expected and all(cg.is_dir() for cg in cgroups)
        offered = _offered(root)
        assert set(sandbox.limits_applied) == offered  # claims exactly what the tree can limit
        if v2:
            print(
                f"cgroup2 at {root} offers {sorted(offered) or 'none'} of {LIMITED}: {sandbox.limits_applied}"
            )

        # A harness's tree: the parent joins before exec, its forks inherit the cgroup.
        forker = subprocess.Popen(
            [sys.executable, "-c", FORKER, "12"],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=partial(LaunchSandbox.enter, cgroups),
        )
        count, *children = forker.stdout.readline().split()
        tree = {forker.pid, *map(int, children)}
        for cg in cgroups:
            assert set(map(int, (cg / "cgroup.procs").read_text().split())) == tree
        if v2:
            rel = "/" + cgroups[0].relative_to(root).as_posix()
            assert f"0::{rel}" in Path(f"/proc/{forker.pid}/cgroup").read_text().splitlines()
        if "pids" in offered:  # 6 tasks at most: the forker and 5 children; the 6th fork fails (EAGAIN)
            assert int(count) == 5
        else:
            assert int(count) == 12

        if "memory" in offered:  # 128 MiB against a 64 MiB limit: the kernel's OOM killer ends it
            eater = subprocess.run(
                [sys.executable, "-c", EATER.format(mb=128)],
                capture_output=True,
                text=True,
                preexec_fn=partial(LaunchSandbox.enter, cgroups),
                timeout=60,
            )
            assert eater.returncode == -9 and "allocated" not in eater.stdout
            fits = subprocess.run(
                [sys.executable, "-c", EATER.format(mb=8)],
                capture_output=True,
                text=True,
                preexec_fn=partial(LaunchSandbox.enter, cgroups),
                timeout=60,
            )
            assert fits.returncode == 0 and "allocated" in fits.stdout
    finally:
        LaunchSandbox.remove_cgroups(cgroups)

    assert forker.wait(timeout=10) == -9
    # rmdir succeeds only on an empty cgroup: the children died too
    assert not any(cg.exists() for cg in cgroups)
    for pid in tree - {forker.pid}:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "gone"
        assert state in ("gone", "Z"), (pid, state)
