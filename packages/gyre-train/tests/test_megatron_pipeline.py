"""The continuous 1F1B pipeline of a cell and megatron's distributed optimizer, on CPU over gloo under torchrun.

One two-rank torchrun job (module fixture, ~2 min on a shared 2-core box) runs, in the same processes:

1. PP=2, fp32: a batch of 8 micro-steps (pre-pass and train items) released to the queue in three chunks; the
   feeder releases the next chunk only when the leader reports the pipeline idle for lack of data (a gate, not a
   sleep). The pipeline runs continuously (one fill, one drain, pauses kept state); then the same batch again
   with one megatron schedule call per micro-step.
2. PP=1 (so DP=2), fp32: rank 0 alone runs the same micro-steps unpipelined (``CellWorker``, one micro-step per
   schedule call): the reference.
3. PP=1, DP=2, bf16 with megatron's DDP (fp32 main grads) and distributed optimizer: each data-parallel rank runs
   its shard of 3 micro-steps through the pipeline (PP=1), then one optimizer step.

The tests compare (1) with (2) within 1e-6, check the counts, and compare (3) with a one-rank bf16 update computed
here (the same micro-steps, both shards on one rank).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from gyre_train.types import MicroStep

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU/gloo variant; GPU checks are gpu-marked"),
]

CHUNKS = (3, 2, 3)  # the batch's 8 micro-steps, released in three chunks

WORKER = textwrap.dedent(
    """
    import json, sys, threading, torch, torch.distributed as dist
    from gyre_train.backends.base import PackedTensors
    from gyre_train.buffer import TrajectoryBuffer
    from gyre_train.cell import CellWorker
    from gyre_train.loss import LossConfig
    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig, ParallelConfig
    from gyre_train.megatron.pipeline import ControlChannel, QueueSource, StreamingPipeline
    from gyre_train.packing import PackingConfig, StreamPackingBuffer
    from gyre_train.queue import MicroStepQueue
    from gyre_train.testing.synthetic import make_groups

    model_path, out = sys.argv[1], sys.argv[2]
    chunks = [int(c) for c in sys.argv[3].split(",")]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loss_cfg = LossConfig()

    def microsteps(shard, dp, groups, seed):
        buf = TrajectoryBuffer(4)
        for gid, v, ex in make_groups(groups, 4, seed=seed, max_len=60):
            for eid, r, trajs in ex:
                buf.add_execution(gid, v, eid, r, trajs)
        packer = StreamPackingBuffer(PackingConfig(group_size=4, batch_groups=groups, tokens_per_shard=shard,
                                                   dp_size=dp, window_shards=2, temperature=0.8), buf)
        packer.open_batch(0, 0)
        got = []
        while not packer.closed:
            got += packer.next_microsteps(max_microsteps=100)
        return got

    def save(name, obj):
        torch.save(obj, f"{out}.{name}.{rank}")

    # --- 1. PP=2: continuous 1F1B with gated releases, then one schedule call per micro-step ----------------
    batch = microsteps(shard=80, dp=1, groups=3, seed=3)
    assert len(batch) == sum(chunks), len(batch)
    if rank == 0:
        with open(f"{out}.pp_batch.json", "w") as f:
            json.dump([m.model_dump(mode="json") for m in batch], f)
    b = MegatronBackend(MegatronBackendConfig(
        model_path=model_path, parallel=ParallelConfig(pipeline_parallel=2), optimizer=False))
    chan = ControlChannel.create()
    for mode in ("continuous", "per_microstep"):
        b.zero_grad()
        pipe = StreamingPipeline(b, chan, loss_cfg, mode=mode)
        if rank == 0:
            q = MicroStepQueue(prepass=True, single_pass=True)
            q.open(0)
            src = QueueSource(q)
            starved, idles = threading.Event(), []
            def on_idle(reason):
                idles.append(reason)
                if reason == "starved":
                    starved.set()
            def feed():
                it = iter(batch)
                for k, n in enumerate(chunks):
                    if k:
                        assert starved.wait(300), "the pipeline never went idle for data"
                        starved.clear()
                    for _ in range(n):
                        src.put(next(it))
                src.close()
            feeder = threading.Thread(target=feed)
            feeder.start()
            stats = pipe.run_batch(src, on_idle=on_idle)
            feeder.join()
            extra = {"loss": q.token_stats.loss, "idles": idles, "trained": q.trained_by_cell[0],
                     "finished": q.finished}
        else:
            stats = pipe.follow_batch()
            extra = {}
        save(mode, {"stats": stats, "grads": b.export_hf_grads(), **extra})
    b.close()

    # --- 2. the unpipelined reference: rank 0 alone, one schedule call per micro-step -----------------------
    ref = MegatronBackend(MegatronBackendConfig(model_path=model_path, optimizer=False))
    if rank == 0:
        q = MicroStepQueue(prepass=True, single_pass=True)
        q.open(0)
        for m in batch:
            q.put(m)
        q.close()
        worker = CellWorker(0, ref, loss_cfg)
        while not q.finished:
            item = q.claim(0)
            res = worker.run(item)
            (q.report_prepass if item.kind == "prepass" else q.report_train)(res)
        save("reference", {"loss": q.token_stats.loss, "grads": ref.export_hf_grads()})
    dist.barrier()
    ref.close()

    # --- 3. bf16 + distributed optimizer, DP=2 -----------------------------------------------------------------
    dp_batch = microsteps(shard=128, dp=2, groups=3, seed=5)
    if rank == 0:
        with open(f"{out}.dp_batch.json", "w") as f:
            json.dump([m.model_dump(mode="json") for m in dp_batch], f)
    bf = MegatronBackend(MegatronBackendConfig(model_path=model_path, params_dtype="bfloat16", lr=1e-3))
    assert bf.dp_size == 2 and bf.dp_rank == rank
    pipe = StreamingPipeline(bf, chan, loss_cfg)
    if rank == 0:
        q = MicroStepQueue(prepass=True, single_pass=True)
        q.open(0)
        src = QueueSource(q)
        for m in dp_batch:
            src.put(m)
        src.close()
        stats = pipe.run_batch(src)
        extra = {"loss": q.token_stats.loss}
    else:
        stats = pipe.follow_batch()
        extra = {}
    local = bf.flat_grads().clone()
    norm = bf.optimizer_step(max_grad_norm=1.0)
    save("dp", {"stats": stats, "norm": norm, "local_grads": local, "weights": bf.export_hf_weights(),
                "opt_numel": bf.optimizer_state_numel(), "numel": bf.flat_params().numel(), **extra})
    bf.close()
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def job(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    out = str(tmp / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Own session, so a hang kills torchrun and both workers (and nothing else).
    proc = subprocess.Popen(
        [*cmd, str(script), tiny_model, out, ",".join(map(str, CHUNKS))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("torchrun workers did not finish in 540 s")
    assert proc.returncode == 0, stderr[-6000:]

    def load(name: str, rank: int):
        return torch.load(f"{out}.{name}.{rank}", weights_only=False)

    def batch(name: str) -> list[MicroStep]:
        with open(f"{out}.{name}.json") as f:
            return [MicroStep.model_validate(m) for m in json.load(f)]

    return load, batch


def _merged_grads(load, name: str) -> dict[str, torch.Tensor]:
    """Stage 0's and stage 1's gradients (disjoint HF names) as one dict."""
    g0, g1 = load(name, 0)["grads"], load(name, 1)["grads"]
    assert not set(g0) & set(g1)
    return {**g0, **g1}


@pytest.mark.parametrize("mode", ["continuous", "per_microstep"])
def test_pipelined_batch_equals_unpipelined_reference(job, mode) -> None:
    load, _ = job
    ref = load("reference", 0)
    run = load(mode, 0)
    assert run["finished"] and run["trained"] == sum(CHUNKS)
    assert ref["loss"] != 0.0
    assert run["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-9)
    grads = _merged_grads(load, mode)
    assert set(grads) == set(ref["grads"])
    nonzero = 0
    for name, g in ref["grads"].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-6, msg=name)
        nonzero += int(g.abs().sum() > 0)
    assert nonzero >= len(grads) - 1  # a real gradient reaches (nearly) every tensor


def test_continuous_pipeline_fills_and_drains_once_and_pauses_with_state(job) -> None:
    load, _ = job
    for rank in (0, 1):
        stats = load("continuous", rank)["stats"]
        assert stats.microsteps == sum(CHUNKS)
        assert stats.fills == 1 and stats.drains == 1, (rank, stats)
        assert stats.pauses >= 2 and stats.resumes >= 2, (rank, stats)
        # micro-steps needing the pre-pass ran forward-only at consistent points
        assert stats.forward_only >= 1
    lead = load("continuous", 0)
    # Every rank saw the same tokens: same pauses, resumes and forward-only passes.
    one = load("continuous", 1)["stats"]
    assert (lead["stats"].pauses, lead["stats"].resumes, lead["stats"].forward_only) == (
        one.pauses,
        one.resumes,
        one.forward_only,
    )
    # The gate released chunks 2 and 3 only after the pipeline was idle for lack of data: two starved spells.
    assert lead["stats"].starved_waits == len(CHUNKS) - 1
    assert lead["idles"].count("starved") == len(CHUNKS) - 1


def test_one_schedule_call_per_microstep_fills_and_drains_each(job) -> None:
    load, _ = job
    for rank in (0, 1):
        stats = load("per_microstep", rank)["stats"]
        assert stats.fills == stats.drains == stats.microsteps == sum(CHUNKS)


def test_distributed_optimizer_update_equals_one_rank_update_and_state_is_sharded(job, tiny_model) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from gyre_train.cell import CellWorker
    from gyre_train.loss import LossConfig
    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig
    from gyre_train.queue import MicroStepQueue

    load, batch = job
    assert not dist.is_initialized()
    one = MegatronBackend(MegatronBackendConfig(model_path=tiny_model, params_dtype="bfloat16", lr=1e-3))
    try:
        assert one.dp_size == 1
        q = MicroStepQueue(prepass=True, single_pass=True)
        q.open(0)
        for m in batch("dp_batch"):
            assert len(m.shards) == 2
            q.put(m)
        q.close()
        worker = CellWorker(0, one, LossConfig())  # both shards on the one rank
        while not q.finished:
            item = q.claim(0)
            res = worker.run(item)
            (q.report_prepass if item.kind == "prepass" else q.report_train)(res)
        one_local = one.flat_grads().clone()
        before = one.export_hf_weights()
        one_norm = one.optimizer_step(max_grad_norm=1.0)
        one_weights = one.export_hf_weights()
        one_numel = one.optimizer_state_numel()
    finally:
        one.close()
    assert not parallel_state.model_parallel_is_initialized()

    r0, r1 = load("dp", 0), load("dp", 1)
    assert r0["loss"] == pytest.approx(q.token_stats.loss, rel=1e-6)
    # Main grads are fp32 sums: the two ranks' local gradients add up to the one rank's (plain SUM, no 1/DP).
    torch.testing.assert_close(r0["local_grads"] + r1["local_grads"], one_local, rtol=1e-5, atol=1e-7)
    assert r0["norm"] == pytest.approx(one_norm, rel=1e-5) and r1["norm"] == pytest.approx(one_norm, rel=1e-5)
    changed = 0
    for name, w in one_weights.items():
        # Matrices are bf16; megatron's Torch-norm fallback (no Apex/TE on CPU) keeps norm weights in fp32.
        assert w.dtype == (torch.float32 if name.endswith("norm.weight") else torch.bfloat16), name
        torch.testing.assert_close(r0["weights"][name], w, msg=name)  # bf16 tolerance
        assert torch.equal(r0["weights"][name], r1["weights"][name]), name  # parameters all-gathered
        changed += int(not torch.equal(w, before[name]))
    assert changed == len(one_weights)  # the update moved every tensor
    # The optimizer state (fp32 main params + two Adam moments) is sharded: each rank holds half of it.
    assert one_numel == 3 * r0["numel"]
    assert r0["opt_numel"] + r1["opt_numel"] == one_numel
    for r in (r0, r1):
        assert abs(r["opt_numel"] - one_numel / 2) <= 0.02 * one_numel, (r["opt_numel"], one_numel)
