"""A megatron cell in a new generation of the gloo world: after rank 1's process died, a new process takes rank 1,
every rank re-forms the world (`reform_cell_world`), the live rank re-creates megatron's groups in it
(`MegatronBackend.regroup`) while the new one builds its backend there, and both train together again.

Without the regroup the new rank's backend hangs in megatron's group creation (a collective the live rank never
joins); the test's timeout bounds that. Slow: each of the three processes imports megatron-core (~20 s here).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gyre_train.ports import free_ports

pytestmark = pytest.mark.slow

RANK = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    from megatron.core import parallel_state
    from gyre_train.backends.base import PackedTensors
    from gyre_train.backends.factory import build_backend
    from gyre_train.multicell import MultiCellConfig, init_cell_process, reform_cell_world

    rank, first, second, restarted, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
    cfg = MultiCellConfig(num_cells=2, master_port=first, control_port=1, snapshot_dir=".")
    T = 12  # one row of T tokens, the same on every rank
    batch = PackedTensors(
        input_ids=torch.arange(T) % 50 + 3, position_ids=torch.arange(T),
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32), labels=torch.arange(T) % 50 + 4,
    )

    def summed_grad_norm(groups) -> str:
        backend.zero_grad()
        backend.forward_backward(batch, 1.0, lambda l_T: (l_T.sum(), None))
        g = backend.flat_grads()  # [P]
        dist.all_reduce(g, group=groups.for_prefix(2))
        return f"{float(g.norm()):.6f} dp={parallel_state.get_data_parallel_world_size()}"

    if not restarted:
        groups = init_cell_process(cfg, rank)
        backend = build_backend("megatron", model_path=model, optimizer=rank == 0)
        print("gen0", summed_grad_norm(groups), flush=True)
        if rank == 1:
            os._exit(0)  # dies without leaving the world (as a SIGKILLed cell does)
        sys.stdin.readline()  # the test's gate: the replacement process is started
        groups = reform_cell_world(cfg, rank, second)
        backend.regroup()
    else:
        groups = reform_cell_world(cfg, rank, second)
        backend = build_backend("megatron", model_path=model, optimizer=False)
    print("gen1", summed_grad_norm(groups), flush=True)
    os._exit(0)  # the abandoned generation's gloo threads can abort interpreter teardown
    """
)


@pytest.mark.timeout(300)
def test_a_restarted_megatron_rank_trains_with_a_regrouped_live_rank(tiny_model):
    first, second = free_ports(2)

    def start(rank: int, restarted: bool) -> subprocess.Popen:
        flag = "1" if restarted else "0"
        argv = [sys.executable, "-c", RANK, str(rank), str(first), str(second), flag, tiny_model]
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    old = [start(r, False) for r in range(2)]
    procs = list(old)
    try:
        gen0 = [p.stdout.readline().split() for p in old]
        assert gen0[0] == gen0[1] and gen0[0][0] == "gen0" and gen0[0][2] == "dp=2", gen0
        assert float(gen0[0][1]) > 0
        assert old[1].wait(timeout=60) == 0
        new = start(1, True)
        procs.append(new)
        old[0].stdin.write("go\n")
        old[0].stdin.flush()
        gen1 = [p.stdout.readline().split() for p in (old[0], new)]
        # Same weights, same batch: the summed gradient of the new generation is the first one's.
        assert gen1 == [["gen1", *gen0[0][1:]]] * 2, (gen0, gen1)
        assert all(p.wait(timeout=60) == 0 for p in (old[0], new))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
