"""A new generation of the gloo world: after rank 2's process died, a new process takes rank 2 and every cell re-forms
the world on a fresh port (`reform_cell_world`); the prefix groups of the new world sum over all three again."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

RANK = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from gyre_train.multicell import MultiCellConfig, init_cell_process, reform_cell_world

    rank, first, second, restarted = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    cfg = MultiCellConfig(num_cells=3, master_port=first, control_port=1, snapshot_dir=".")
    if not restarted:
        groups = init_cell_process(cfg, rank)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=groups.for_prefix(3))
        print("gen0", x.item(), flush=True)
        if rank == 2:
            os._exit(0)  # dies without leaving the world (as a SIGKILLed cell does)
        sys.stdin.readline()  # the test's gate: the replacement process is started
    groups = reform_cell_world(cfg, rank, second)
    x = torch.tensor([float(10 * (rank + 1))])
    dist.all_reduce(x, group=groups.for_prefix(3))
    y = torch.tensor([1.0])
    dist.all_reduce(y, group=groups.for_prefix(2)) if rank < 2 else None
    print("gen1", x.item(), y.item(), flush=True)
    # As the cell worker does: the abandoned generation's gloo threads can abort interpreter teardown
    # ("terminate called without an active exception"), so the process leaves without it.
    os._exit(0)
    """
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_rank_rejoins_a_new_world_generation():
    first, second = _port(), _port()

    def start(rank: int, restarted: bool) -> subprocess.Popen:
        argv = [sys.executable, "-c", RANK, str(rank), str(first), str(second), "1" if restarted else "0"]
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    old = [start(r, False) for r in range(3)]
    procs = list(old)
    try:
        assert [p.stdout.readline().split() for p in old] == [["gen0", "6.0"]] * 3
        assert old[2].wait(timeout=60) == 0
        new = start(2, True)
        procs.append(new)
        for p in old[:2]:
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = [p.stdout.readline().split() for p in (*old[:2], new)]
        assert lines == [["gen1", "60.0", "2.0"], ["gen1", "60.0", "2.0"], ["gen1", "60.0", "1.0"]]
        assert all(p.wait(timeout=60) == 0 for p in (*old[:2], new))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
