"""A multi-rank cell's stage processes die with their cell worker (the lifeline pipe of gyre_cell.worker_stages).

A stand-in worker process holds the pipe's only write end and starts a stage-like child that arms the lifeline; the
test SIGKILLs the worker (nothing of its own runs at death) and waits, on a pidfd, for the child to be gone.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    lifeline, keep = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, threading; from gyre_cell.worker_stages import _die_with_worker; "
         "_die_with_worker(int(sys.argv[1])); print('armed', flush=True); threading.Event().wait()",
         str(lifeline)],
        pass_fds=(lifeline,),
    )
    os.close(lifeline)
    print(child.pid, flush=True)
    threading_event = __import__("threading").Event()
    threading_event.wait()  # until killed
    """
)


def test_stage_exits_when_its_worker_is_killed() -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(worker.stdout.readline())
        assert worker.stdout.readline().strip() == "armed"  # the child's watch thread runs (shared stdout)
        pidfd = os.pidfd_open(child_pid)
        try:
            assert select.select([pidfd], [], [], 0)[0] == []  # alive while the worker lives
            worker.send_signal(signal.SIGKILL)
            worker.wait(30)
            ready, _, _ = select.select([pidfd], [], [], 30)  # readable once the child has exited
            assert ready == [pidfd], "the stage outlived its worker"
        finally:
            os.close(pidfd)
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.stdout.close()


LEADER = textwrap.dedent(
    """
    import subprocess, sys, threading
    from gyre_cell.worker_stages import _exit_if_stage_dies
    stage = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    _exit_if_stage_dies(stage, "cell-0-stage-1", threading.Event())
    threading.Event().wait()  # a leader waiting on its stage for good, unless the watch ends it
    """
)


def test_worker_exits_when_a_stage_dies_before_close() -> None:
    worker = subprocess.Popen([sys.executable, "-c", LEADER], stderr=subprocess.PIPE, text=True)
    try:
        assert worker.wait(60) == 1
        assert "cell-0-stage-1 exited with 3" in worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.stderr.close()
