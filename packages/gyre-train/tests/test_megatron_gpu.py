"""The Megatron backend on a GPU (``pytest -m gpu`` on a machine with CUDA and Transformer Engine; deselected by
default): the Transformer Engine layer spec, THD packing, NCCL, bf16 with megatron's DDP and distributed optimizer,
on one GPU with TP=1.

- THD packing keeps rows apart: packed log-probs equal per-row forwards, and changing one row leaves the others.
- The same GSPO loss (and log-probs) as the CPU path (the torch backend, fp32) within bf16 tolerance.
- The continuous pipeline (PP=1) runs over NCCL with the TCPStore control channel and gives the gradient of one
  schedule call per micro-step; then one distributed-optimizer step.

Selected without CUDA (or without Transformer Engine) they fail: a GPU run on a machine that cannot run them is a
broken machine, not a pass.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gyre_train.backends.base import PackedTensors
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.loss import LossConfig
from gyre_train.packing import PackingConfig, StreamPackingBuffer
from gyre_train.queue import MicroStepQueue
from gyre_train.testing.synthetic import make_groups
from gyre_train.types import IGNORE_LABEL, WorkItem

pytestmark = pytest.mark.gpu

TEMPERATURE = 0.8
BF16 = {"rtol": 0.0, "atol": 5e-2}  # log-prob tolerance of a bf16 forward against fp32


@pytest.fixture(scope="module")
def gpu(tiny_model):
    assert torch.cuda.is_available(), "pytest -m gpu ran on a machine without CUDA"
    assert importlib.util.find_spec("transformer_engine") is not None, (
        "Transformer Engine is not installed: the TE layer spec and THD packing are what these tests check"
    )
    import torch.distributed as dist

    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig, ParallelConfig

    backend = MegatronBackend(
        MegatronBackendConfig(
            model_path=tiny_model, parallel=ParallelConfig(layer_spec="te"), params_dtype="bfloat16", lr=1e-3
        )
    )
    assert dist.get_backend() == "nccl"
    assert backend.thd and backend.device.type == "cuda" and backend.mixed
    yield backend
    backend.close()


def _rows(lens: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g) for n in lens]


def _packed(rows: list[torch.Tensor]) -> PackedTensors:
    ids = torch.cat(rows)
    labels = torch.cat([torch.cat([r[1:], torch.tensor([IGNORE_LABEL])]) for r in rows])
    cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(r) for r in rows]), 0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(len(r)) for r in rows])
    return PackedTensors(input_ids=ids, position_ids=pos, cu_seqlens=cu, labels=labels)


def _microsteps(shard: int, groups: int, seed: int):
    buf = TrajectoryBuffer(4)
    for gid, v, ex in make_groups(groups, 4, seed=seed, max_len=120):
        for eid, r, trajs in ex:
            buf.add_execution(gid, v, eid, r, trajs)
    cfg = PackingConfig(
        group_size=4, batch_groups=groups, tokens_per_shard=shard, window_shards=2, temperature=TEMPERATURE
    )
    packer = StreamPackingBuffer(cfg, buf)
    packer.open_batch(0, 0)
    out = []
    while not packer.closed:
        out += packer.next_microsteps(max_microsteps=100)
    return out


def test_thd_packing_keeps_rows_apart(gpu) -> None:
    rows = _rows([37, 64, 19], seed=1)
    packed = gpu.logprobs(_packed(rows), TEMPERATURE)
    alone = torch.cat([gpu.logprobs(_packed([r]), TEMPERATURE) for r in rows])
    torch.testing.assert_close(packed, alone, **BF16)
    changed = [torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(9)), *rows[1:]]
    after = gpu.logprobs(_packed(changed), TEMPERATURE)
    torch.testing.assert_close(after[37:], packed[37:], **BF16)  # rows 1 and 2 never saw row 0
    assert not torch.allclose(after[:36], packed[:36], atol=1e-3)


def test_loss_equals_the_cpu_path_within_bf16_tolerance(gpu, tiny_model) -> None:
    from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig

    cfg = LossConfig(ratio_reference="proximal")  # no gate: a bf16 ratio near a clip bound cannot flip it
    ms = _microsteps(shard=256, groups=2, seed=4)[0]
    item = WorkItem(kind="train", microstep=ms)
    cpu = TorchBackend(
        TorchBackendConfig(model_path=tiny_model, dtype="float32", device="cpu", optimizer=False)
    )
    want = CellWorker(0, cpu, cfg).run(item).stats
    gpu.zero_grad()
    got = CellWorker(0, gpu, cfg).run(item).stats
    gpu.zero_grad()
    assert want.loss != 0.0 and got.num_targets == want.num_targets
    assert got.loss == pytest.approx(want.loss, rel=3e-2)
    shard = PackedTensors.from_shard(ms.shards[0])
    torch.testing.assert_close(
        gpu.logprobs(shard, TEMPERATURE), cpu.logprobs(shard, TEMPERATURE).float(), **BF16
    )


def test_continuous_pipeline_over_nccl_then_distributed_optimizer_step(gpu) -> None:
    from gyre_train.megatron.pipeline import ControlChannel, QueueSource, StreamingPipeline

    cfg = LossConfig()
    batch = _microsteps(shard=128, groups=3, seed=6)
    assert len(batch) >= 3

    def queue_of(items):
        q = MicroStepQueue(prepass=True, single_pass=True)
        q.open(0)
        for m in items:
            q.put(m)
        q.close()
        return q

    gpu.zero_grad()
    q = queue_of(batch)
    worker = CellWorker(0, gpu, cfg)
    while not q.finished:
        it = q.claim(0)
        res = worker.run(it)
        (q.report_prepass if it.kind == "prepass" else q.report_train)(res)
    want_grads, want_loss = gpu.flat_grads().clone(), q.token_stats.loss

    gpu.zero_grad()
    pipe = StreamingPipeline(gpu, ControlChannel.create(), cfg)
    src = QueueSource(MicroStepQueue(prepass=True, single_pass=True))
    src.queue.open(0)
    for m in batch:
        src.put(m)
    src.close()
    stats = pipe.run_batch(src)
    assert stats.fills == 1 and stats.drains == 1 and stats.microsteps == len(batch)
    assert src.queue.finished
    assert src.queue.token_stats.loss == pytest.approx(want_loss, rel=1e-4)
    torch.testing.assert_close(gpu.flat_grads(), want_grads, rtol=1e-3, atol=1e-5)

    before = gpu.flat_params().clone()
    norm = gpu.optimizer_step(max_grad_norm=1.0)
    assert torch.isfinite(torch.tensor(norm)) and norm > 0
    assert not torch.equal(gpu.flat_params(), before)
    assert gpu.optimizer_state_numel() == 3 * before.numel()  # DP=1: the one rank holds all of it
