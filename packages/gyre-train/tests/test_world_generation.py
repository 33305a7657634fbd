"""A new generation of the gloo world: after rank 2's process died, a new process takes rank 2 and every cell re-forms
the world on a fresh port (`reform_cell_world`); the prefix groups of the new world sum over all three again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from gyre_train.ports import free_ports

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


def test_a_restarted_rank_rejoins_a_new_world_generation():
    first, second = free_ports(2)

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


BOUNDED = textwrap.dedent(
    """
    import os, sys, time
    import torch, torch.distributed as dist
    from gyre_train.multicell import MultiCellConfig, RendezvousTimeout, reform_cell_world

    rank, first, second, wait = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    cfg = MultiCellConfig(num_cells=3, master_port=first, control_port=1, snapshot_dir=".")
    if rank < 2:  # rank 2 is dead (or hangs) when the first re-form is asked: it never arrives (or dies there)
        t0 = time.monotonic()
        try:
            reform_cell_world(cfg, rank, first, rendezvous_timeout_s=wait)
        except RendezvousTimeout as exc:
            print("timeout", round(time.monotonic() - t0), dist.is_initialized(), "arrived" in str(exc), flush=True)
        sys.stdin.readline()  # the test's gate: the replacement rank 2 is started
    groups = reform_cell_world(cfg, rank, second, rendezvous_timeout_s=60.0)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=groups.for_prefix(3))
    print("formed", x.item(), flush=True)
    os._exit(0)
    """
)


def _times_out_then_a_fresh_rank_2_forms(
    wait: int, arrival: str, seconds: range, beside: str | None = None
) -> None:
    """Ranks 0 and 1 run BOUNDED (first re-form with a `wait` s rendezvous) while rank 2 is missing, or while
    `beside` (a script given the first port) checks in for it and dies. Each must raise RendezvousTimeout after
    `seconds` with no world held, `arrival` ("True" when the arrival count timed out, "False" when gloo's init did);
    then a fresh rank 2 forms the second generation with them."""
    first, second = free_ports(2)

    def start(rank: int) -> subprocess.Popen:
        argv = [sys.executable, "-c", BOUNDED, str(rank), str(first), str(second), str(wait)]
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    procs = [start(0), start(1)]
    dying = subprocess.Popen([sys.executable, "-c", beside, str(first)]) if beside else None
    try:
        if dying is not None:
            assert dying.wait(timeout=120) == 0
        outcomes = [p.stdout.readline().split() for p in procs]
        for word, took, initialized, named in outcomes:
            assert (word, initialized, named) == ("timeout", "False", arrival), outcomes
            assert int(took) in seconds, outcomes  # bounded by the rendezvous timeout, not gloo's default
        procs.append(start(2))
        for p in procs[:2]:
            p.stdin.write("go\n")
            p.stdin.flush()
        assert [p.stdout.readline().split() for p in procs] == [["formed", "6.0"]] * 3
        assert all(p.wait(timeout=60) == 0 for p in procs)
    finally:
        for p in [*procs, *([dying] if dying else [])]:
            if p.poll() is None:
                p.kill()


def test_a_rank_missing_from_the_rendezvous_fails_every_waiting_rank_in_bounded_time_and_a_retry_forms():
    """A cell that died or hangs after the re-form was asked must not hold the others for gloo's 30 minutes: the
    core and the other live rank give up after the rendezvous timeout, hold no world, and form the next
    generation once the replacement arrives."""
    _times_out_then_a_fresh_rank_2_forms(3, arrival="True", seconds=range(3, 30))


CHECKS_IN_THEN_DIES = textwrap.dedent(
    """
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist

    # Rank 2 checks in at the rendezvous as reform_cell_world does, then dies before the world is built.
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 3, is_master=False, timeout=timedelta(seconds=30))
    store.add("arrived", 1)
    os._exit(0)
    """
)


def test_a_rank_that_dies_after_checking_in_fails_the_others_in_bounded_time_and_a_retry_forms():
    """The narrowest part of the re-form window: a cell arrives at the rendezvous, then dies before the gloo world
    is built. The live ranks must not wait in gloo's own rendezvous past the timeout nor fail with another error:
    the same RendezvousTimeout, no world held, and the next generation forms once a fresh rank 2 arrives (the
    failed init advanced torch's group-name count in the live ranks only)."""
    # 20 s: all three surely check in before rank 2 dies, so the timeout is gloo's init, not the arrival count.
    _times_out_then_a_fresh_rank_2_forms(
        20, arrival="False", seconds=range(20, 60), beside=CHECKS_IN_THEN_DIES
    )


GONE = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from gyre_train.multicell import MultiCellConfig, init_cell_process, reform_cell_world

    cell, first, second = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cfg = MultiCellConfig(num_cells=4, master_port=first, control_port=1, snapshot_dir=".")
    groups = init_cell_process(cfg, cell)
    if cell == 2:
        os._exit(0)  # cell 2 dies and never comes back (its restarts are spent)
    sys.stdin.readline()  # the test's gate: cell 2 is gone
    groups = reform_cell_world(cfg, cell, second, rendezvous_timeout_s=60.0, members=[0, 1, 3])
    x = torch.tensor([float(cell + 1)])
    dist.all_reduce(x, group=groups.for_members([0, 1, 3]))  # the three live cells: ranks 0, 1, 2
    y = torch.tensor([float(cell + 1)])
    group = groups.for_members([0, 3])  # not a prefix of ranks: a fresh group of ranks 0 and 2, made by them only
    dist.all_reduce(y, group=group) if cell != 1 else None
    print("formed", dist.get_world_size(), dist.get_rank(), groups.rank_of(cell), x.item(), y.item(), flush=True)
    os._exit(0)
    """
)


def test_a_cell_gone_for_good_is_left_out_of_the_next_generation():
    """K=4, cell 2 dead for good: the next generation has the three others (rank = position, core first), and
    collectives over cells map to their ranks, so the gone cell blocks no later re-form."""
    first, second = free_ports(2)

    def start(cell: int) -> subprocess.Popen:
        argv = [sys.executable, "-c", GONE, str(cell), str(first), str(second)]
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    procs = [start(c) for c in range(4)]
    try:
        assert procs[2].wait(timeout=120) == 0
        live = [procs[c] for c in (0, 1, 3)]
        for p in live:
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = [p.stdout.readline().split() for p in live]
        # world of 3; cell 3 is rank 2; 1+2+4 = 7 over the three; cells 0 and 3: 1+4 = 5 (cell 1 keeps its 2)
        assert lines == [
            ["formed", "3", "0", "0", "7.0", "5.0"],
            ["formed", "3", "1", "1", "7.0", "2.0"],
            ["formed", "3", "2", "2", "7.0", "5.0"],
        ], lines
        assert all(p.wait(timeout=60) == 0 for p in live)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
