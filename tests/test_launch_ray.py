"""The ray launcher for real (slow): a run on a one-machine Ray instance, and on two "hosts" made of network
namespaces joined by a veth pair (root only), with a Ray head in one and a Ray worker in the other.

Same step losses as the local launcher: the engines sample from one generator per engine shared by concurrent
requests, whose order depends on when each agent process calls; two runs of the *local* launcher with the same seed
already draw different trajectories, so their step losses differ. What holds for every launcher, and is asserted: the
step the cells compute on a batch equals the single-process reference on that batch (`replay_batch`, the check
`tests/test_run.py` makes of the local launcher), to 1e-6 in float64; the trainer's log-probs equal the engines'
behaviour log-probs; and the run's trace recomputes its counters. (With the tiny random model the demo's rewards are
often all 0 in two steps: advantages, loss and gradient are then 0 for every launcher, and the log-prob check is the
one that still compares numbers computed on different hosts.)
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from gyre.config import LauncherConfig
from gyre.launch.base import free_ports
from gyre.launch.ray import connect
from gyre.launch.ray_ranks import RankHost, _RemoteRank
from gyre_sched.trace import iter_trace, read_trace
from gyre_train.loss import LossConfig
from gyre_train.replay import replay_batch

ROOT = Path(__file__).resolve().parents[1]
# Every Ray test of the suite is in this file: xdist (`--dist loadfile`) runs a file's tests on one worker, in turn,
# and a local Ray instance and the two-host namespaces (fixed names, a fixed GCS port) are machine-wide.
pytestmark = pytest.mark.slow

# Token authentication off: the test cluster lives inside two private namespaces (no route out of them).
RAY_ENV = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
}


class _OneNode:
    """A one-node Ray instance (`ray start --head`, its own temp dir and ports) that the single-host tests join with
    `--ray ADDRESS`: Ray is started once for them, not once per run. This process stays connected (the idle check,
    and the in-process tests' driver)."""

    def __init__(self, logs: Path) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="gyre-ray-"))  # short: Ray's socket paths are under it
        ray = str(Path(sys.executable).with_name("ray"))
        ports = free_ports(2)
        # On loopback: nothing off this machine reaches it (its token authentication is off, as for the runs').
        argv = [
            ray,
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(ports[0]),
            "--ray-client-server-port",
            str(ports[1]),
            "--num-cpus",
            "4",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
            "--temp-dir",
            str(self.tmp),
        ]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **RAY_ENV},
        )
        self.address, lines = None, []
        for raw in self.proc.stdout:  # gate: the head is up, `ray start` names its address (or it exits)
            lines.append(raw.decode(errors="replace"))
            if (m := re.search(r"ray start --address='([^']+)'", lines[-1])) is not None:
                self.address = m.group(1)
                break
        if self.address is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail("ray start: " + "".join(lines)[-3000:])
        log = (logs / "ray-start.log").open("wb")
        threading.Thread(target=shutil.copyfileobj, args=(self.proc.stdout, log), daemon=True).start()

    def wait_idle(self, timeout: float = 300) -> None:
        """Every CPU free and no placement group left: the previous test's run released what it held (its driver
        exited; the GCS releases a finished driver's actors and groups shortly after)."""
        ray = connect(LauncherConfig(kind="ray", address=self.address))

        def held() -> tuple[float, list]:  # CPUs in use, placement groups not removed
            used = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
            return used, [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]

        deadline = time.monotonic() + timeout
        while held() != (0, []):
            assert time.monotonic() < deadline, f"held by a previous run: {held()}"
            time.sleep(0.5)

    def stop(self) -> None:
        import ray

        ray.shutdown()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


_ONE_NODE: list[_OneNode] = []


@pytest.fixture(scope="module")
def _one_node_module():
    with pytest.MonkeyPatch.context() as mp:  # this process joins it too: with the instance's settings
        for key, value in RAY_ENV.items():
            mp.setenv(key, value)
        yield
        _stop_one_node()


def _stop_one_node() -> None:
    """Before the two-host cluster starts (an idle head costs CPU), or at the module's end."""
    while _ONE_NODE:
        node = _ONE_NODE.pop()
        node.stop()
        shutil.rmtree(node.tmp, ignore_errors=True)


@pytest.fixture
def one_node(_one_node_module, tmp_path_factory) -> str:
    """The one-node instance's address, idle (asserted, not cleaned up), as if each test had an instance of its own."""
    if not _ONE_NODE:
        _ONE_NODE.append(_OneNode(tmp_path_factory.mktemp("ray-one-node")))
    _ONE_NODE[0].wait_idle()
    return _ONE_NODE[0].address


def _gyre(run_dir: Path, *args: str, prefix: list[str] | None = None, timeout: float = 600) -> dict:
    argv = [
        *(prefix or []),
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(ROOT / "configs" / "demo.toml"),
        "--run-dir",
        str(run_dir),
        "--quiet",
        *args,
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **RAY_ENV}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]


def _check(run_dir: Path, steps: int) -> list[dict]:
    """Counters from the trace, final weights, every dumped batch's loss and gradient equal to the reference."""
    state = json.loads((run_dir / "metrics" / "scheduler.json").read_text())
    trace = read_trace(run_dir / "trace.jsonl")
    assert (trace.d, trace.p, trace.f, trace.x) == (state["d"], state["p"], state["f"], state["x"])
    assert trace.steps == state["version"] >= steps
    assert (run_dir / "checkpoints" / f"policy-v{state['version']}" / "config.json").exists()
    rows = _steps(run_dir)
    checked = 0
    for batch, row in enumerate(rows):
        dump = run_dir / "metrics" / "batches" / f"batch-{batch}"
        if not dump.exists():
            continue
        loss, grads = replay_batch(
            dump, str(run_dir / "model"), dtype="float64", loss=LossConfig(), temperature=1.0
        )
        assert loss == pytest.approx(row["loss"], abs=1e-6)
        summed = torch.load(dump / "summed_grads.pt").double()  # float32 for a megatron cell
        assert torch.allclose(grads, summed, atol=1e-6, rtol=0)
        checked += 1
    assert checked >= 1
    # The trainer's log-probs (computed in the cells' actors) equal the behaviour log-probs the engines returned
    # through the proxy: non-zero and checked even when every reward of the tiny model is 0 (advantages 0, loss 0).
    assert all(r["metrics"]["ratio_dev_max"] < 1e-4 for r in rows if max(r["staleness"]) == 0), rows
    placement = [p for p in json.loads((run_dir / "logs" / "placement.json").read_text()) if "bundles" in p]
    assert [p["worker"] for p in placement] == [f"cell-{i}" for i in range(len(placement))]
    assert len({p["placement_group"] for p in placement}) == len(placement)  # one placement group per cell
    for p in placement:  # each actor's output in the run's logs, its resolved config first
        first = (run_dir / "logs" / f"{p['worker']}.log").read_text().splitlines()[0]
        assert json.loads(first)["host"] == p["ip"]
    return placement


def _services_placed(run_dir: Path) -> dict[str, dict]:
    """The proxy's and gyre-eval's rows of placement.json, checked against services.json: each ran as the child of
    its own actor (not of the controller), on the node and port the controller built its command line with."""
    rows = {p["worker"]: p for p in json.loads((run_dir / "logs" / "placement.json").read_text())}
    services = json.loads((run_dir / "services.json").read_text())
    for name, url in (("proxy", services["proxy"]), ("gyre-eval", services["gyre-eval"])):
        row = rows[name]
        assert url == f"http://{row['ip']}:{row['port']}"
        assert services["pids"][name] == row["pid"] != row["actor_pid"]
        assert (run_dir / "logs" / f"{name}.log").exists()  # opened by the actor, on its node
    return rows


@pytest.mark.parametrize("placed", [False, True], ids=["driver", "placed-controller"])
def test_sigterm_stops_the_ray_run_with_one_line(tmp_path, placed, wait_gone, request):
    """Ray's driver would exit on SIGTERM at once: gyre's handler stays, every actor and the instance stop. With
    the controller placed on a node (`controller_resources`), the `gyre run` that placed it passes the signal on:
    the controller stops everything and says so, and its line is the last one. (The driver's run starts its own
    instance, `--ray local`; the placed one joins the module's.)"""
    run_dir = tmp_path / "run"
    ray = request.getfixturevalue("one_node") if placed else "local"
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--ray",
        ray,
        "--run-dir",
        str(run_dir),
        "--steps",
        "50",
        "--set",
        "dashboard.enabled=false",
        "--quiet",
    ]
    if placed:
        argv += ["--set", "launcher.controller_resources={}"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **RAY_ENV},
    )
    trace, deadline = run_dir / "trace.jsonl", time.monotonic() + 600
    while not (trace.exists() and b'"ev":"launch"' in trace.read_bytes()):  # gate: executions are running
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.2)
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    if placed:
        controller = json.loads((run_dir / "logs" / "controller.json").read_text())
        assert controller["pid"] != proc.pid
        placement.append(controller)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    assert "interrupted by SIGTERM" in err.strip().splitlines()[-1]
    wait_gone([p["pid"] for p in placement], "the placed processes after the SIGTERM")


def test_a_controller_no_node_can_take_is_one_line(tmp_path, one_node):
    """No node offers the controller's resources: one line naming them and the cluster's, nothing of the run."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre.cli",
            "demo",
            "--ray",
            one_node,
            "--run-dir",
            str(run_dir),
            "--set",
            'launcher.controller_resources={"gpu_node":1}',
            "--set",
            "launcher.start_timeout_s=1",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **RAY_ENV},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gyre demo: ray: the controller not placed after 1 s") and "gpu_node" in last, last
    assert not (run_dir / "trace.jsonl").exists()


def test_a_placed_controller_whose_node_is_lost_is_resumed_and_every_step_matches_the_reference(
    tmp_path, wait_gone, one_node
):
    """The controller runs on a node by the config; its actor is SIGKILLed after the first step (as a node loss
    would end it). The `gyre run` that placed it ends in one line naming the node and the resume command, and nothing
    of the run is left running. `gyre run --resume RUN` places a controller again and finishes the run: contiguous
    step versions, the interrupted executions settled by the `resume` line, counters recomputed from the trace.
    Every dumped step (the one before the loss, the one after the resume) equals the single-process float64
    reference; the proxy and gyre-eval ran as actors' children; the actors and services are gone with the run.
    (One run for both, a local Ray run matching the reference and a lost controller resumed: the start of a run is
    most of its time.)"""
    run_dir, steps = tmp_path / "run", 3
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--ray",
        one_node,
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--set",
        "dashboard.enabled=false",
        "--set",
        "launcher.controller_resources={}",
        "--set",
        "train.dtype=float64",
        "--set",
        "debug.dump_batches=[0,1]",
        "--set",
        "launcher.proxy_resources={}",
        "--set",
        'launcher.eval_resources={"CPU":1}',
        "--quiet",
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **RAY_ENV},
    )
    rows, deadline = run_dir / "metrics" / "steps.jsonl", time.monotonic() + 600
    while not (rows.exists() and rows.read_text().strip()):  # gate: step 1 done (and checkpointed)
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.2)
    controller = json.loads((run_dir / "logs" / "controller.json").read_text())
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    os.kill(controller["actor_pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert f"controller on node {controller['ip']} ended: killed by SIGKILL" in last, last
    assert f"gyre run --resume {run_dir}" in last
    # the controller died with its actor, the cells and services with it
    wait_gone([controller["pid"], *(p["pid"] for p in placement)], "the lost controller's processes")
    done = len(_steps(run_dir))

    resumed = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "run", "--resume", str(run_dir), "--quiet"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, **RAY_ENV},
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == steps - done
    again = json.loads((run_dir / "logs" / "controller.json").read_text())
    assert again["pid"] != controller["pid"]
    assert [r["policy_version"] for r in _steps(run_dir)] == list(range(1, steps + 1))
    state = json.loads((run_dir / "metrics" / "scheduler.json").read_text())
    trace = read_trace(run_dir / "trace.jsonl")
    assert (trace.d, trace.p, trace.f, trace.x) == (state["d"], state["p"], state["f"], state["x"])
    assert [x["ev"] for x in iter_trace(run_dir / "trace.jsonl")].count("resume") == 1

    placement = _check(run_dir, steps)  # the resumed run's cells
    assert len(placement) == 2 and all(p["pid"] != os.getpid() for p in placement)
    services = _services_placed(run_dir)
    assert services["gyre-eval"]["resources"] == {"CPU": 1.0}
    # The actors, and the services they ran, are gone with the run (the instance stays up: Ray ends an actor
    # process after the kill, the event waited on; each service was reaped by its actor before the run ended).
    wait_gone([p["pid"] for p in placement], "the cells' actors after the run")
    for p in [*placement, *services.values()]:
        assert (
            not Path(f"/proc/{p['pid']}").exists()
            or b"ray::" not in Path(f"/proc/{p['pid']}/cmdline").read_bytes()
        )


def test_a_placed_gyre_eval_dies_and_is_restarted_through_its_actor(tmp_path, monkeypatch, one_node):
    """gyre-eval placed on the cluster (`eval_resources`): SIGKILL its process; the launcher's watch sees it through
    the actor, starts it again there on the same port with the same token, and the client is served again."""
    import asyncio

    import httpx

    from gyre.config import load_config
    from gyre.launch import make_launcher
    from gyre_eval.config import ServiceConfig

    for key, value in RAY_ENV.items():
        monkeypatch.setenv(key, value)
    overrides = {"launcher.kind": "ray", "launcher.address": one_node, "launcher.eval_resources": {}}
    cfg = load_config(None, overrides)
    launcher = make_launcher(cfg, tmp_path)

    async def scenario() -> tuple[int, int]:
        await launcher.start_eval(ServiceConfig())
        first = {p["worker"]: p for p in launcher.placement}["gyre-eval"]
        assert launcher.eval_url == f"http://{first['ip']}:{first['port']}"
        os.kill(first["pid"], signal.SIGKILL)

        async def until_restarted() -> int:  # the gate: the launcher's own restart count, then a real answer
            while launcher.restarts.get("gyre-eval", 0) < 1:
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient() as client:
                return (await client.get(f"{launcher.eval_url}/healthz")).status_code

        status = await launcher.supervise(asyncio.wait_for(until_restarted(), 120))
        second = {p["worker"]: p for p in launcher.placement}["gyre-eval"]
        assert (second["ip"], second["port"], second["actor_pid"]) == (
            first["ip"],
            first["port"],
            first["actor_pid"],
        )
        assert second["pid"] != first["pid"]
        return status, second["pid"]

    try:
        status, pid = asyncio.run(scenario())
        assert status == 200 and pid != 0
    finally:
        launcher.stop()
    assert not Path(f"/proc/{pid}").exists() or b"gyre-eval" not in Path(f"/proc/{pid}/cmdline").read_bytes()


# ---- the rank host of a cell spread over nodes (gyre.launch.ray_ranks), on the one-node instance --------------------
# (was tests/test_ray_ranks.py: in this file so that every Ray test runs on one xdist worker, in turn)
# (before the two-host tests: their cluster's start stops the one-node instance, and stays up to the module's end)
# A `RankHost` reports its ranks' exit statuses; once the host itself is gone (its node lost, its owner dead) the
# worker's handle reads a rank killed by SIGKILL, and the rank does not outlive it (parent-death signal).


def test_a_rank_host_reports_its_ranks_ends_and_takes_them_down_with_it(tmp_path, one_node):
    ray = connect(LauncherConfig(kind="ray", address=one_node))  # the idle check's connection
    host = None
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
        if host is not None:
            ray.kill(host)  # idempotent; on a failure above, the next test finds the instance idle


# ---- two hosts in network namespaces -----------------------------------------------------------------------------

NS = ("gyre-host-a", "gyre-host-b")
IPS = ("10.77.0.1", "10.77.0.2")


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _netns_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2"
    return None


@pytest.fixture(scope="module")
def _two_node_cluster(tmp_path_factory):
    """Two namespaces with loopback and one veth pair 10.77.0.1 <-> 10.77.0.2 (nothing routes outside them), a Ray
    head in the first and a Ray worker in the second: started once for the two-host tests, which share them."""
    if (why := _netns_available()) is not None:
        pytest.skip(why)
    _stop_one_node()
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    try:
        for ns in NS:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh(
            "ip",
            "link",
            "add",
            "gyre-va",
            "netns",
            NS[0],
            "type",
            "veth",
            "peer",
            "name",
            "gyre-vb",
            "netns",
            NS[1],
        )
        for ns, dev, ip in zip(NS, ("gyre-va", "gyre-vb"), IPS, strict=True):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
    except subprocess.CalledProcessError as exc:
        for ns in NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"ip netns unavailable here: {exc.stderr.decode().strip()}")
    logs = tmp_path_factory.mktemp("ray-nodes")
    nodes = [_ray_node(NS[0], IPS[0], logs, True, "host_a")]
    try:
        _wait_nodes(1)  # the worker's `ray start` gives up if the head's GCS is not up yet (slow under load)
        nodes.append(_ray_node(NS[1], IPS[1], logs, False, "host_b"))
        yield
    finally:
        _stop_nodes(nodes)
        for ns in NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def two_hosts(_two_node_cluster):
    """The two-node cluster, idle: each test starts as if on a cluster of its own. Asserted (not cleaned up): both
    nodes alive, every CPU and host resource free and no placement group left, i.e. the previous test's run
    released everything it held when its driver (`gyre run`) exited, a SIGKILLed actor's run included."""
    _wait_nodes(2, idle=True)


def _ray_node(ns: str, ip: str, tmp: Path, head: bool, resource: str) -> subprocess.Popen:
    ray = str(Path(sys.executable).with_name("ray"))
    argv = [
        "ip",
        "netns",
        "exec",
        ns,
        ray,
        "start",
        "--block",
        "--node-ip-address",
        ip,
        "--num-cpus",
        "3",
        "--resources",
        json.dumps({resource: 4}),
        "--disable-usage-stats",
    ]
    argv += (
        ["--head", "--port", "6379", "--include-dashboard", "false"]
        if head
        else ["--address", f"{IPS[0]}:6379"]
    )
    log = (tmp / f"ray-{ns}.log").open("wb")
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **RAY_ENV}
    )


def _wait_nodes(n: int, timeout: float = 300, idle: bool = False) -> None:
    """Until the head's GCS lists `n` alive nodes (asked from inside host A; the head may still be starting), and
    with `idle`, until every resource is free and every placement group removed (a finished driver's actors and
    placement groups are released by the GCS shortly after it exits)."""
    code = (
        "import ray, time\n"
        f"d = time.time() + {timeout}\n"
        "while True:\n"
        "    try:\n"
        f"        ray.init(address='{IPS[0]}:6379')\n"
        "        break\n"
        "    except Exception:\n"
        "        assert time.time() < d\n"
        "        time.sleep(1)\n"
        f"while sum(x['Alive'] for x in ray.nodes()) < {n}:\n"
        "    assert time.time() < d, ray.nodes()\n"
        "    time.sleep(0.5)\n"
    )
    if idle:
        code += (
            "keys = ('CPU', 'host_a', 'host_b')\n"
            "def held():\n"
            "    total, free = ray.cluster_resources(), ray.available_resources()\n"
            "    pgs = [p for p in ray.util.placement_group_table().values() if p['state'] != 'REMOVED']\n"
            "    return {k: total.get(k, 0) - free.get(k, 0) for k in keys if total.get(k, 0) != free.get(k, 0)}, pgs\n"
            "while held() != ({}, []):\n"
            "    assert time.time() < d, f'held by a previous run: {held()}'\n"
            "    time.sleep(0.5)\n"
        )
    proc = subprocess.run(
        ["ip", "netns", "exec", NS[0], sys.executable, "-c", code],
        timeout=timeout + 60,
        env={**os.environ, **RAY_ENV},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _stop_nodes(nodes: list[subprocess.Popen]) -> None:
    for proc in reversed(nodes):
        proc.terminate()
    for proc in reversed(nodes):
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    # `ray start --head` leaves its address for later `ray.init()` calls: not this test's namespaces' address.
    current = Path("/tmp/ray/ray_current_cluster")
    if current.exists() and current.read_text().startswith(IPS[0]):
        current.unlink()


def _trace_so_far(run_dir: Path) -> list[dict]:
    path = run_dir / "trace.jsonl"
    out = []
    for raw in path.read_bytes().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(raw))
        except ValueError:
            break  # a line being written
    return out


def test_two_hosts_elastic_run_crosses_hosts_and_a_killed_remote_cell_trains_again(two_hosts, tmp_path):
    """One cell per host, bound to its host's address; the controller placed on host B, the proxy and gyre-eval on
    host A (the config); gradients cross hosts over gloo, weights over Mooncake TCP, and every dumped step equals
    the one-process float64 reference. The satellite on host B dies (its actor process SIGKILLed) after it claimed
    a micro-step: its claims are requeued, Ray starts a new actor in the cell's placement group (host B again), the
    cell serves rollouts, then re-forms the gloo world across hosts at a burst boundary (the core picks the port on
    host A) and trains again. (One run for both: a run's start is most of its time.)"""
    steps = 5
    run_dir = tmp_path / "run"
    argv = [
        "ip",
        "netns",
        "exec",
        NS[0],
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(ROOT / "configs" / "demo.toml"),
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--ray",
        f"{IPS[0]}:6379",
        "--steps",
        str(steps),
        "--set",
        'launcher.cell_resources=[{"host_a":1},{"host_b":1}]',
        "--set",
        'launcher.proxy_resources={"host_a":0.5}',
        "--set",
        'launcher.eval_resources={"host_a":0.5}',
        "--set",
        'launcher.controller_resources={"host_b":0.5}',
        "--set",
        "train.dtype=float64",
        "--set",
        "debug.dump_batches=[0,1]",
        "--set",
        "debug.hold_core_for_join=1",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "scheduler.mu=1",
        "--set",
        "scheduler.B=2",
    ]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **RAY_ENV},
    )
    deadline = time.monotonic() + 600
    try:
        while not any(x["ev"] == "microstep_claim" and x["cell"] == 1 for x in _trace_so_far(run_dir)):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "cell 1 never claimed a micro-step"
            time.sleep(0.05)  # polls the run's trace (the gate), orders nothing
        placement = json.loads((run_dir / "logs" / "placement.json").read_text())
        (remote,) = [p for p in placement if p["worker"] == "cell-1"]
        assert remote["ip"] == IPS[1]
        os.kill(remote["pid"], signal.SIGKILL)  # one PID namespace: the netns split only the network
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    (tmp_path / "controller.log").write_bytes(err)
    assert proc.returncode == 0, err.decode()[-4000:]
    assert json.loads(out.decode().splitlines()[-1])["steps"] == steps

    placement = _check(run_dir, steps)
    # One cell per host, each bound to its host's address (never loopback).
    assert [(p["worker"], p["ip"]) for p in placement] == [("cell-0", IPS[0]), ("cell-1", IPS[1])]
    cell1 = json.loads((run_dir / "cells" / "cell-1.json").read_text())
    assert (cell1["host"], cell1["mooncake"]["local_hostname"]) == (IPS[1], IPS[1])
    assert cell1["training"]["master_host"] == IPS[0]
    # `gyre run` ran on host A and placed the controller on host B by the config; the controller placed the
    # proxy and gyre-eval on host A: the agents (beside the controller on host B) called the model through host
    # A, and the assessments of host B's workspaces were made there.
    controller = json.loads((run_dir / "logs" / "controller.json").read_text())
    assert controller["ip"] == IPS[1] and controller["pid"] != controller["actor_pid"]
    services = _services_placed(run_dir)
    assert services["proxy"]["ip"] == services["gyre-eval"]["ip"] == IPS[0]
    assert json.loads((run_dir / "services.json").read_text())["proxy"].startswith(f"http://{IPS[0]}:")
    # Gradients crossed hosts over gloo: a step with micro-steps of both cells (the remote one joined).
    rows = _steps(run_dir)
    assert any(
        r["microsteps_by_cell"].get("1", 0) > 0 and r["microsteps_by_cell"].get("0", 0) > 0 for r in rows
    )
    # Weights crossed hosts over Mooncake TCP: the remote cell went back to rollout with a published version.
    ends = [e for e in iter_trace(run_dir / "trace.jsonl") if e["ev"] == "transition_end" and e["cell"] == 1]
    assert any(e.get("to") == "rollout" for e in ends), ends

    lines = list(iter_trace(run_dir / "trace.jsonl"))
    (lost,) = [x for x in lines if x["ev"] == "cell_lost"]
    (restored,) = [x for x in lines if x["ev"] == "cell_restored" and not x["trains"]]
    (rejoined,) = [x for x in lines if x["ev"] == "cell_restored" and x["trains"]]
    assert lost["cell"] == restored["cell"] == rejoined["cell"] == 1
    assert lines.index(lost) < lines.index(restored) < lines.index(rejoined)
    # The new actor landed on host B again (the cell's placement group), bound to its address.
    restart = json.loads((run_dir / "cells" / "cell-1.restart-1.json").read_text())
    assert (restart["host"], restart["training"]["master_host"]) == (IPS[1], IPS[0])
    # Its claims of the batch it died in were claimed again by the core; after the rejoin it claims again.
    before = lines[: lines.index(lost)]
    claims = [x for x in before if x["ev"] == "microstep_claim" and x["cell"] == 1]
    died_in = max(x["batch"] for x in claims)
    mine = {x["index"] for x in claims if x["batch"] == died_in}
    again = {
        x["index"]
        for x in lines[lines.index(claims[-1]) + 1 :]
        if x["ev"] == "microstep_claim" and x["batch"] == died_in and x["cell"] == 0
    }
    assert mine <= again, (mine, again)
    after = [x for x in lines[lines.index(rejoined) :] if x["ev"] == "microstep_claim" and x["cell"] == 1]
    assert after and min(x["batch"] for x in after) > died_in
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    assert any(r["microsteps_by_cell"].get("1", 0) > 0 for r in rows[died_in + 1 :])


def test_two_hosts_a_pipelined_cell_spans_both_hosts(two_hosts, tmp_path):
    """`bundles_per_cell = 2`, STRICT_SPREAD: each two-stage Megatron cell has a bundle on each host, its worker
    (stage 0) where `cell_resources` pins it and its stage 1 on the other host, started there by the cell's rank
    host actor. Activations and gradients cross hosts inside each cell (megatron's p2p over gloo), the cells'
    summed gradients across them; every step equals the one-process float64 reference."""
    run_dir = tmp_path / "run"
    summary = _gyre(
        run_dir,
        "--ray",
        f"{IPS[0]}:6379",
        "--steps",
        "2",
        "--set",
        "train.backend=megatron",
        "--set",
        "train.pipeline_parallel=2",
        "--set",
        "train.lr_warmup_steps=0",
        "--set",
        "launcher.bundles_per_cell=2",
        "--set",
        "launcher.cell_strategy=STRICT_SPREAD",
        "--set",
        'launcher.cell_resources=[{"host_a":1},{"host_b":1}]',
        "--set",
        "debug.dump_batches=[0,1]",
        "--set",
        "debug.hold_core_for_join=1",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "scheduler.mu=1",
        "--set",
        "scheduler.B=2",
        prefix=["ip", "netns", "exec", NS[0]],
        timeout=900,
    )
    assert summary["steps"] == 2
    placement = _check(run_dir, 2)
    # Every rank process ends with its run, the remote ones too, on nodes that stay up (one PID
    # namespace: the netns split only the network; a pidfd is readable once its process has exited).
    for cell in range(2):
        for row in (run_dir / "logs" / f"cell-{cell}-ranks.jsonl").read_text().splitlines():
            try:
                pidfd = os.pidfd_open(json.loads(row)["pid"])
            except ProcessLookupError:
                continue  # already gone
            try:
                assert select.select([pidfd], [], [], 60)[0] == [pidfd], f"rank {row} outlived its run"
            finally:
                os.close(pidfd)
    assert [(p["worker"], p["ip"]) for p in placement] == [("cell-0", IPS[0]), ("cell-1", IPS[1])]
    assert all(len(p["bundles"]) == 2 for p in placement)
    for cell, (here, there) in enumerate([IPS, IPS[::-1]]):
        (rank,) = [
            json.loads(x) for x in (run_dir / "logs" / f"cell-{cell}-ranks.jsonl").read_text().splitlines()
        ]
        assert (rank["rank"], rank["bundle"], rank["ip"]) == (1, 1, there), rank
        assert placement[cell]["ip"] == here
        # Stage 1 ran in that process, on the other host, and trained every batch its cell did.
        stage1 = [
            json.loads(x)
            for x in (run_dir / "metrics" / "pipeline" / f"cell-{cell}-stage-1.jsonl")
            .read_text()
            .splitlines()
        ]
        assert stage1 and {r["pid"] for r in stage1} == {rank["pid"]}
        trained = [r for r in _steps(run_dir) if r["microsteps_by_cell"].get(str(cell), 0) > 0]
        assert [r["microsteps"] for r in stage1] == [r["microsteps_by_cell"][str(cell)] for r in trained]
    assert any(r["microsteps_by_cell"].get("1", 0) > 0 for r in _steps(run_dir))
