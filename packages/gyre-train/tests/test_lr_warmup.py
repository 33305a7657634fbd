"""The torch backend's linear lr warm-up: step k uses lr * min(1, k / W), counted from the optimizer's own state."""

from __future__ import annotations

import copy

import pytest
import torch

from gyre_train.backends import check_backend
from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig

LR, WARMUP = 1e-2, 4


def _backend(model: str, warmup: int = WARMUP) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model_path=model, dtype="float64", lr=LR, lr_warmup_steps=warmup))


def _grads(backend: TorchBackend, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in backend.params]


def test_each_step_uses_the_warmed_up_lr_and_matches_adam_stepped_by_hand(tiny_model):
    backend = _backend(tiny_model)
    reference = [p.detach().clone().requires_grad_(True) for p in backend.params]
    adam = torch.optim.Adam(reference, lr=LR)
    used = []
    for k in range(1, 7):
        used.append(backend.current_lr())
        for p, r, g in zip(backend.params, reference, _grads(backend, k), strict=True):
            p.grad, r.grad = g.clone(), g.clone()
        backend.optimizer_step(max_grad_norm=1e12)  # no clipping: only the lr differs from plain Adam
        for group in adam.param_groups:
            group["lr"] = LR * min(1.0, k / WARMUP)
        adam.step()
        for p, r in zip(backend.params, reference, strict=True):
            assert torch.equal(p.detach(), r.detach()), k
    assert used == pytest.approx([LR * x for x in (0.25, 0.5, 0.75, 1.0, 1.0, 1.0)])


def test_a_restored_optimizer_continues_the_schedule(tiny_model):
    first = _backend(tiny_model)
    for k in range(1, 3):
        for p, g in zip(first.params, _grads(first, k), strict=True):
            p.grad = g
        first.optimizer_step(max_grad_norm=1e12)
    resumed = _backend(tiny_model)
    assert resumed.current_lr() == pytest.approx(LR / WARMUP)  # fresh: step 1
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    assert resumed.current_lr() == pytest.approx(LR * 3 / WARMUP) == first.current_lr()
    assert _backend(tiny_model, warmup=0).current_lr() == LR  # no warm-up: constant


def test_bad_warmups_are_refused_by_name():
    with pytest.raises(
        ValueError, match=r"train\.lr_warmup_steps = 5: the megatron backend has no lr schedule"
    ):
        check_backend("megatron", lr_warmup_steps=5, one_process_cells=True, prefix="train.")
    with pytest.raises(ValueError, match="lr_warmup_steps must be >= 0"):
        check_backend("torch", lr_warmup_steps=-1)
    with pytest.raises(ValueError, match="lr_warmup_steps must be >= 0"):
        TorchBackendConfig(model_path="x", lr_warmup_steps=-1)


def test_each_step_report_records_the_lr_its_update_used(tiny_model):
    """StepReport.metrics["lr"] is the lr of that step's update (what RUN/metrics/steps.jsonl and the report chart)."""
    from gyre_train.buffer import TrajectoryBuffer
    from gyre_train.cell import CellWorker
    from gyre_train.loss import LossConfig
    from gyre_train.packing import PackingConfig
    from gyre_train.testing.synthetic import make_groups
    from gyre_train.trainer import Trainer, TrainerConfig

    n, b = 2, 1
    packing = PackingConfig(group_size=n, batch_groups=b, tokens_per_shard=64, window_shards=1)
    trainer = Trainer(
        TrainerConfig(packing=packing),
        CellWorker(0, _backend(tiny_model, warmup=3), LossConfig()),
        TrajectoryBuffer(n),
    )
    recorded = []
    for step in range(4):
        for gid, v, execs in make_groups(b, n, seed=30 + step, max_len=30, version=step):
            for eid, reward, trajs in execs:
                trainer.buffer.add_execution(gid, v, eid, reward, trajs)
        recorded.append(trainer.step().metrics["lr"])
    assert recorded == pytest.approx([LR / 3, 2 * LR / 3, LR, LR])
