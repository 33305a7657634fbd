"""What an agent leaves in its workspace is untrusted data for everyone who reads it after the run: the report and the
dashboard (gyre.observe.rundata.read_artifact; the report's own case is in test_report) and gyre-eval's checks. A FIFO, a
directory, a symlink to a sibling's answer or to a root-only file, and a huge sparse file."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from gyre.observe.rundata import read_artifact


def test_read_artifact_reads_regular_files_only_and_never_blocks(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    secret = tmp_path / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(secret)
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(3 << 30)  # 3 GiB, no blocks
    (tmp_path / "dir").mkdir()
    plain = tmp_path / "plain"
    plain.write_bytes(b"x" * 100)
    # the FIFO has no writer: a plain open would wait forever. Run it in a thread so a regression hangs only that
    # thread, and the test fails on the join's bound instead of hanging the suite.
    result: dict = {}
    reader = threading.Thread(target=lambda: result.update(fifo=read_artifact(fifo, 10)), daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive() and result == {"fifo": None}
    assert read_artifact(link, 10) is None  # a symlink's target is never read
    assert read_artifact(tmp_path / "dir", 10) is None
    assert read_artifact(tmp_path / "missing", 10) is None
    assert read_artifact(sparse, 4096) == b"\0" * 4096  # bounded by the cap, not the file
    assert read_artifact(plain, 10) == b"x" * 10


@pytest.mark.parametrize("kind", ["absolute", "relative", "chain"])
def test_a_check_never_scores_a_file_outside_its_workspace(tmp_path, kind):
    """Reward theft: an answer.txt symlinked to a sibling execution's answer was scored as its own (6 of 6 such
    executions got 1.0). The check's private copy keeps only links that resolve inside the workspace."""
    from gyre_eval.sandbox import Sandbox, SandboxConfig

    sibling = tmp_path / "ws" / "e1"
    sibling.mkdir(parents=True)
    (sibling / "answer.txt").write_text("mint")
    own = tmp_path / "ws" / "e0"
    (own / "sub").mkdir(parents=True)
    (own / "sub" / "notes.txt").write_text("inside")
    (own / "inner.txt").symlink_to("sub/notes.txt")  # a link inside the workspace stays
    if kind == "absolute":
        (own / "answer.txt").symlink_to(sibling / "answer.txt")
    elif kind == "relative":
        (own / "answer.txt").symlink_to("../e1/answer.txt")
    else:
        (own / "hop").symlink_to("..")
        (own / "answer.txt").symlink_to("hop/e1/answer.txt")
    script = (
        "import os; print(open('inner.txt').read()); "
        "print(os.path.exists('answer.txt') and open('answer.txt').read() or 'no answer')"
    )
    for up in (tmp_path, *tmp_path.parents):  # readable by the check's own uid, as a 755 run directory was
        if up == Path("/"):
            break
        up.chmod(up.stat().st_mode | 0o755)
    (sibling / "answer.txt").chmod(0o644)
    sandbox = Sandbox(SandboxConfig(timeout_s=60, cgroup="off"))
    result = asyncio.run(sandbox.run(["python3", "-c", script], own))
    assert result.returncode == 0, result.stderr_tail
    assert result.stdout_tail.split() == ["inside", "no", "answer"]
    assert (own / "answer.txt").is_symlink()  # the preserved workspace is never touched


def test_the_run_directory_is_private(tmp_path):
    from gyre.config import RunConfig
    from gyre.run.pipeline import prepare_run_dir

    old_umask = os.umask(0o022)
    try:
        _, run_dir = prepare_run_dir(RunConfig(run_dir=str(tmp_path / "runs" / "r1")))
        (tmp_path / "mine").mkdir(mode=0o755)
        _, given = prepare_run_dir(RunConfig(run_dir=str(tmp_path / "mine")))
    finally:
        os.umask(old_umask)
    assert run_dir.stat().st_mode & 0o777 == 0o700
    assert given.stat().st_mode & 0o777 == 0o700  # a folder the user made is closed too
    assert (run_dir / "config.json").exists()
