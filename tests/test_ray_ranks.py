"""The rank host of a cell spread over nodes (gyre.launch.ray_ranks) on a local Ray instance (slow: starts Ray).

A `RankHost` reports its ranks' exit statuses; once the host itself is gone (its node lost, its owner dead) the
worker's handle reads a rank killed by SIGKILL, and the rank does not outlive it (parent-death signal)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from gyre.config import LauncherConfig
from gyre.launch.ray import connect
from gyre.launch.ray_ranks import RankHost, _RemoteRank

# One xdist worker runs every Ray test in turn: a local Ray instance and the two-host namespaces (fixed names, a
# fixed GCS port) are machine-wide.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def test_a_rank_host_reports_its_ranks_ends_and_takes_them_down_with_it(tmp_path):
    ray = connect(LauncherConfig(kind="ray", num_cpus=2))
    try:
        host = ray.remote(max_concurrency=4)(RankHost).remote()
        node = ray.get(host.node.remote(), timeout=120)
        assert node["ip"] and node["python"] == sys.executable
        log = str(tmp_path / "rank.log")
        ends = _RemoteRank(
            host, ray.get(host.spawn.remote([sys.executable, "-c", "raise SystemExit(3)"], {}, log))
        )
        assert ends.wait(60) == 3

        argv = [sys.executable, "-c", "import threading; print('up', flush=True); threading.Event().wait()"]
        rank = _RemoteRank(host, ray.get(host.spawn.remote(argv, {"GYRE_PROBE": "1"}, log)))
        with pytest.raises(subprocess.TimeoutExpired):
            rank.wait(0.2)  # still running: the handle says so rather than an exit status
        with open(f"/proc/{rank.pid}/environ", "rb") as f:
            assert b"GYRE_PROBE=1" in f.read().split(b"\0")
        pidfd = os.pidfd_open(rank.pid)
        try:
            ray.kill(host)
            assert rank.wait() == -signal.SIGKILL  # the host is gone
            assert select.select([pidfd], [], [], 60)[0] == [pidfd], "the rank outlived its host"
        finally:
            os.close(pidfd)
    finally:
        ray.shutdown()
