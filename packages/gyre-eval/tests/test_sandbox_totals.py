"""Total limits per check (issue 15, #12): one cgroup per check bounds the memory and processes of all its processes,
and a tmpfs bounds what it writes over any number of files. Breaking one fails the attempt (never a score) and never
touches a concurrent check."""

import asyncio
import errno
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from eval_helpers import make_workspace, run

from gyre_eval.cgroup import CheckCgroup
from gyre_eval.errors import CgroupUnavailable, EvaluatorError
from gyre_eval.evaluator import EvaluationRequest
from gyre_eval.exec_check import ExecCheckConfig, ExecutableCheck
from gyre_eval.sandbox import Sandbox, SandboxConfig

PYTHON = "/usr/bin/python3"  # readable by the per-run uids (the venv's interpreter may live under /root)


def _cgroups_writable() -> bool:
    try:
        CheckCgroup.create("probe", 64 << 20, 16).remove()
    except CgroupUnavailable:
        return False
    return True


ISOLATED = Sandbox().isolated()
needs_cgroup = pytest.mark.skipif(not _cgroups_writable(), reason="no writable cgroup (not root?)")
needs_isolation = pytest.mark.skipif(not ISOLATED, reason="no namespace isolation on this platform")
needs_python = pytest.mark.skipif(not os.access(PYTHON, os.X_OK), reason=f"no {PYTHON}")

MB = 1 << 20

# Forks workers that each hold 150 MB (under the 512 MB RLIMIT_AS of each); the first holds its memory until the
# test opens the gate FIFO, then the second allocates: 300 MB in all, past the check's 250 MB total. A worker that
# dies before reporting makes the check exit 1, a fail code: without the cgroup's OOM record that would be a 0.0.
HOG = """
import os, sys
hold_r, hold_w = os.pipe()
for i in range(2):
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(hold_w)
        data = b"a" * (150 << 20)
        os.write(w, b"1")
        os.read(hold_r, 1)
        os._exit(0)
    os.close(w)
    if os.read(r, 1) != b"1":
        print("worker", i, "died", flush=True)
        sys.exit(1)
    if i == 0:
        with open(sys.argv[1]) as gate:
            gate.read(1)
print("all workers hold their memory", flush=True)
"""

# 150 MB held, under its own 250 MB total, while the hog is killed beside it; then a score.
INNOCENT = """
import os, sys
data = b"b" * (150 << 20)
with open(sys.argv[1]) as gate:
    gate.read(1)
with open(os.environ["GYRE_SCORE_FILE"], "w") as f:
    f.write(str(0.75 if data.count(b"b") == len(data) else 0.0))
"""


def _request(workspace: Path) -> EvaluationRequest:
    return EvaluationRequest("e1", workspace, "v1", "main", deadline=time.time() + 120)


def _check(command: list[str], score_from: str = "exit_code", **sandbox) -> ExecutableCheck:
    limits = {
        "timeout_s": 60,
        "memory_bytes": 512 * MB,
        "memory_total_bytes": 250 * MB,
        "disk_bytes": 16 * MB,
    }
    config = SandboxConfig(**{**limits, **sandbox})
    return ExecutableCheck(ExecCheckConfig(command=command, score_from=score_from, sandbox=config))


async def _open_gate(fifo: Path, check: asyncio.Future) -> int:
    """Gate: returns once the check has opened the FIFO for reading (it reached the gate), or fails if it ended."""
    while not check.done():
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        await asyncio.sleep(0.01)
    raise AssertionError(f"the check ended before its gate: {check.exception() or check.result()}")


@pytest.fixture
def gates():
    """FIFOs outside the copy that checks of any uid can open (the read-only mounts do not stop a FIFO)."""
    d = Path(tempfile.mkdtemp(prefix="gyre-gates-"))
    os.chmod(d, 0o755)
    for name in ("hog", "innocent"):
        os.mkfifo(d / name, 0o666)
        os.chmod(d / name, 0o666)
    yield d
    shutil.rmtree(d)


@needs_cgroup
@needs_isolation
@needs_python
def test_processes_past_the_total_memory_fail_the_check_and_spare_a_concurrent_one(tmp_path, gates):
    """Before: 1.63 GB resident under a 512 MB per-process limit. Now the hog's second worker takes its total past
    250 MB, the kernel kills in its cgroup only, and the attempt fails; the innocent check, holding 150 MB beside it
    all along, scores 0.75."""
    ws = make_workspace(tmp_path / "ws", {"hog.py": HOG, "innocent.py": INNOCENT})
    hog = _check([PYTHON, "hog.py", str(gates / "hog")], score_from="exit_code")
    innocent = _check([PYTHON, "innocent.py", str(gates / "innocent")], score_from="score_file")

    async def scenario():
        hog_task = asyncio.ensure_future(hog.evaluate(_request(ws)))
        innocent_task = asyncio.ensure_future(innocent.evaluate(_request(ws)))
        hog_gate = await _open_gate(gates / "hog", hog_task)  # the hog's first worker holds 150 MB
        innocent_gate = await _open_gate(gates / "innocent", innocent_task)  # the innocent holds 150 MB
        os.write(hog_gate, b"g")
        os.close(hog_gate)
        with pytest.raises(EvaluatorError) as failed:
            await hog_task
        assert not innocent_task.done(), "the innocent check ended while the hog was being killed"
        os.write(innocent_gate, b"g")
        os.close(innocent_gate)
        return failed.value, await innocent_task

    error, verdict = run(scenario())
    assert "exceeded its total memory (memory_total_bytes=262144000)" in str(error)
    assert "out of memory" in str(error)
    assert verdict.score == 0.75
    assert verdict.details["memory_peak_bytes"] >= 150 * MB
    assert verdict.details["sandbox"]["total_memory"].startswith("cgroup")


@needs_isolation
def test_many_small_files_past_the_disk_cap_fail_the_check(workspace):
    """Before: RLIMIT_FSIZE bounded each file, not their sum. Now the copy is a tmpfs of disk_bytes: the 4 MB cap
    fills after about a thousand one-byte files (a page each), the write fails with ENOSPC and the attempt fails,
    although the check exits 1, a fail code that would otherwise be a valid 0.0."""
    script = "for i in $(seq 3000); do printf x > f$i || exit 1; done; echo all-written"
    check = _check(["bash", "-c", script], disk_bytes=4 * MB)
    with pytest.raises(EvaluatorError) as failed:
        run(check.evaluate(_request(workspace)))
    assert "filled its disk (disk_bytes=4194304)" in str(failed.value)
    assert "No space left on device" in str(failed.value)  # the check's own stderr tail


@needs_isolation
def test_a_workspace_larger_than_the_disk_cap_is_an_error_not_a_score(tmp_path):
    ws = make_workspace(tmp_path / "ws", {"big.bin": "x" * (3 * MB)})
    with pytest.raises(EvaluatorError, match=r"does not fit the disk cap \(disk_bytes=2097152\)"):
        run(_check(["true"], disk_bytes=2 * MB).evaluate(_request(ws)))


@needs_cgroup
@needs_isolation
@needs_python
def test_forks_past_pids_total_fail_the_check_even_as_uid_0(workspace):
    """RLIMIT_NPROC counts per uid and is not applied when the check keeps uid 0 (run_as=None): before, such a
    check could fork without bound. The cgroup's pids.max bounds it whatever its uid."""
    prog = (
        "import os\nr, w = os.pipe()\nn = 0\n"
        "try:\n"
        "    for _ in range(40):\n"
        "        if os.fork() == 0:\n"
        "            os.close(w); os.read(r, 1); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('fork refused after', n, e.strerror)\n"
    )
    check = _check([PYTHON, "-c", prog], run_as=None, pids_total=16)
    with pytest.raises(EvaluatorError, match=r"reached its process limit \(pids_total=16\)"):
        run(check.evaluate(_request(workspace)))


@needs_cgroup
def test_the_check_cgroup_holds_every_process_and_is_removed_after(workspace):
    """Every process of the check is in its cgroup (also one that leaves the process group: without isolation only
    the cgroup finds it); the cgroup is gone when the run returns."""
    token = "4747.125"
    script = f"setsid sleep {token} & cat /proc/self/cgroup; echo started"
    sb = Sandbox(SandboxConfig(timeout_s=10, isolation="off"))
    result = run(sb.run(["bash", "-c", script], workspace))
    assert result.returncode == 0 and "started" in result.stdout_tail
    assert result.cgroups and all(f"{os.getpid()}-gyre-sbx-" in p for p in result.cgroups)  # v1: 2, v2: 1
    leaf = Path(result.cgroups[0]).name
    assert f"/gyre-eval/{leaf}" in result.stdout_tail
    assert not any(Path(p).exists() for p in result.cgroups)
    assert not _running(token), "a process that left the check's group outlived the check"
    held = str(result.guarantees["total_processes"])
    assert held.startswith("cgroup v") and held.endswith("pids.max=512")


def test_without_a_cgroup_the_results_say_the_totals_do_not_hold(workspace):
    result = run(Sandbox(SandboxConfig(timeout_s=10, cgroup="off")).run(["true"], workspace))
    assert result.returncode == 0 and result.cgroups == ()
    assert result.guarantees["total_memory"] is False and result.guarantees["total_processes"] is False


def test_the_tmpfs_copy_must_fit_the_total_memory():
    with pytest.raises(ValueError, match=r"disk_bytes .* must be below memory_total_bytes"):
        SandboxConfig(memory_total_bytes=64 * MB, disk_bytes=64 * MB)


def _running(arg: str) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read() == b"sleep\x00" + arg.encode() + b"\x00":
                        return True
            except OSError:
                pass
    return False


@needs_cgroup
def test_groups_a_dead_service_left_behind_are_swept(workspace):
    """A service killed mid-check leaves its (then empty) groups; the next check's service removes them, never a live
    service's."""
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names a service that is gone
    live = CheckCgroup.create("gyre-sbx-live", 64 * MB, 16)  # this service's own, still in use
    bases = [p.parent for p in live.paths]
    left = [base / f"{dead.pid}-gyre-sbx-crashed" for base in bases]
    for d in left:
        d.mkdir()
    try:
        result = run(Sandbox(SandboxConfig(timeout_s=10)).run(["true"], workspace))
        assert result.returncode == 0 and result.cgroups
        assert not any(d.exists() for d in left)
        assert all(p.exists() for p in live.paths)
    finally:
        live.remove()
        for d in left:
            if d.exists():
                d.rmdir()


def test_cgroup_v2_file_protocol_on_a_stand_in_tree(tmp_path, monkeypatch):
    """This machine has no v2 memory controller to run checks under, so the v2 writes and reads are checked on a
    stand-in directory tree: which files get which values, and which events count."""
    import gyre_eval.cgroup as cgroup

    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(cgroup, "CGROUP_ROOT", root)
    monkeypatch.setattr(cgroup, "_own_path", lambda match: "/")
    cg = CheckCgroup.create("gyre-sbx-v2", 300 * MB, 64)
    (leaf,) = cg.paths
    assert cg.version == 2 and leaf == root / "gyre-eval" / f"{os.getpid()}-gyre-sbx-v2"
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (root / "gyre-eval" / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (leaf / "memory.max").read_text() == str(300 * MB) and (leaf / "pids.max").read_text() == "64"
    assert not (leaf / "memory.swap.max").exists() and "swap not accounted" in cg.limits["memory"]
    assert cg.procs_files() == [str(leaf / "cgroup.procs")]
    (leaf / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    (leaf / "pids.events").write_text("max 3\n")
    (leaf / "memory.peak").write_text(str(301 * MB))
    assert cg.usage() == cgroup.CgroupUsage(oom_kills=2, pids_limit_hits=3, memory_peak_bytes=301 * MB)
    (leaf / "cgroup.procs").write_text("")
    cg.remove(wait_s=0)  # a stand-in directory is not removable while it holds files: left for the sweep
    assert (leaf / "cgroup.kill").read_text() == "1"
    (root / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(CgroupUnavailable, match="not memory and pids"):
        CheckCgroup.create("gyre-sbx-v2b", 300 * MB, 64)
