"""Loss and gradients of the streaming path equal the literal float64 reference of docs/design/training.md#objective, whatever the split:
one micro-step, many micro-steps, two data-parallel shards, two cells with the second joining mid-batch."""

from __future__ import annotations

import random

import pytest
import torch

from gyre_eval.groups import group_advantages
from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.loss import LossConfig, execution_gate, execution_ratio
from gyre_train.packing import PackingConfig
from gyre_train.testing.loss_reference import RefExecution, reference_loss, trajectory_target_logprobs
from gyre_train.testing.synthetic import make_trajectory, placeholder
from gyre_train.trainer import Trainer, TrainerConfig

N, B, TEMP = 4, 3, 0.8


def _near_behaviour(model, traj, rng: random.Random, noise: float):
    """Behaviour log-probs = the model's own (small engine mismatch), so s_i lands near the clip bounds."""
    with torch.no_grad():
        lp = trajectory_target_logprobs(model, traj, TEMP).tolist()
    it = iter(lp)
    blp = [next(it) + rng.gauss(0.0, noise) if m else 0.0 for m in traj.target_mask]
    return traj.model_copy(update={"behavior_logprobs": blp})


def build_batch(model, seed: int = 0):
    """B groups of N executions: mixed near/far behaviour, one placeholder, one all-equal-reward group."""
    rng = random.Random(seed)
    groups = []
    for g in range(B):
        gid = f"g{g}"
        execs = []
        for i in range(N):
            eid = f"{gid}-x{i}"
            if g == 0 and i == N - 1:
                execs.append((eid, 0.0, [placeholder(eid, gid)]))
                continue
            trajs = [make_trajectory(rng, eid, gid, j, rng.randint(10, 70)) for j in range(rng.randint(1, 3))]
            if (g + i) % 3 != 2:
                trajs = [_near_behaviour(model, t, rng, noise=0.004) for t in trajs]
            reward = 0.5 if g == 2 else float(rng.randint(0, 4)) / 4
            execs.append((eid, reward, trajs))
        groups.append((gid, g % 2, execs))  # versions 0 and 1 -> staleness 1 and 0 at v_t = 1
    return groups


def reference(model_path: str, groups, cfg: LossConfig):
    from transformers import AutoModelForCausalLM  # slow to import: not at collection

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    model.eval()
    execs = []
    for _, _, ex in groups:
        advs = group_advantages([r for _, r, _ in ex])
        for (_, _, trajs), a in zip(ex, advs, strict=True):
            lps = [trajectory_target_logprobs(model, t, TEMP) for t in trajs]
            bs = [
                torch.tensor(
                    [b for b, m in zip(t.behavior_logprobs, t.target_mask, strict=True) if m],
                    dtype=torch.float64,
                )
                for t in trajs
            ]
            execs.append(RefExecution(a, torch.cat(lps), torch.cat(bs)))
    loss = reference_loss(execs, N * B, cfg)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return float(loss.detach()), grads, execs


def streaming(
    model_path: str,
    groups,
    cfg: LossConfig,
    *,
    shard: int,
    dp: int = 1,
    cells: int = 1,
    join_after=0,
    single_pass: bool = True,
):
    buffer = TrajectoryBuffer(N)
    for gid, v, ex in groups:
        for eid, r, trajs in ex:
            buffer.add_execution(gid, v, eid, r, trajs)
    backend_cfg = TorchBackendConfig(model_path=model_path, dtype="float64")
    core = CellWorker(0, TorchBackend(backend_cfg), cfg)
    packing = PackingConfig(
        group_size=N, batch_groups=B, tokens_per_shard=shard, dp_size=dp, window_shards=2, temperature=TEMP
    )
    trainer = Trainer(TrainerConfig(packing=packing, loss=cfg, single_pass=single_pass), core, buffer)
    trainer.version = 1
    sats = [
        CellWorker(
            c, TorchBackend(TorchBackendConfig(model_path=model_path, dtype="float64", optimizer=False)), cfg
        )
        for c in range(1, cells)
    ]
    other = trainer.accumulate(sats, join_after=join_after)
    grads = core.backend.flat_grads() + sum(other, torch.zeros(1, dtype=torch.float64))
    return trainer, grads


@pytest.fixture(scope="module")
def batch(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    model.eval()
    return build_batch(model)


@pytest.mark.parametrize("cap_mode", ["truncate", "mask"])
@pytest.mark.parametrize(
    ("shard", "dp", "cells", "join_after", "single_pass"),
    [
        (100_000, 1, 1, 0, True),
        (100_000, 1, 1, 0, False),
        (64, 1, 1, 0, True),
        (80, 2, 1, 0, True),
        (48, 1, 2, 3, True),
    ],
    ids=[
        "one-microstep-single-pass",
        "one-microstep-prepass",
        "many-microsteps",
        "two-dp-shards",
        "two-cells-join-mid-batch",
    ],
)
def test_streaming_equals_float64_reference(
    tiny_model, batch, cap_mode, shard, dp, cells, join_after, single_pass
):
    cfg = LossConfig(cap_mode=cap_mode)
    ref_loss, ref_grads, ref_execs = reference(tiny_model, batch, cfg)
    trainer, grads = streaming(
        tiny_model,
        batch,
        cfg,
        shard=shard,
        dp=dp,
        cells=cells,
        join_after=join_after,
        single_pass=single_pass,
    )
    claims = trainer.queue.train_claims
    all_claims = sum(trainer.queue.claims.values())
    if shard == 100_000:
        assert sum(claims.values()) == 1
        assert all_claims == (1 if single_pass else 2)  # the single-pass path skips the pre-pass forward
    else:
        assert sum(claims.values()) >= 4
    if cells == 2:
        assert claims[1] >= 1 and claims[0] >= join_after  # the satellite joined late and still trained
    stats = trainer.queue.token_stats
    assert stats.num_targets == sum(e.logprobs.numel() for e in ref_execs)
    assert stats.loss == pytest.approx(ref_loss, abs=1e-9)
    assert abs(ref_loss) > 1e-4  # a real signal, not 0 == 0
    assert torch.allclose(grads, ref_grads, atol=1e-6, rtol=0)
    assert float(ref_grads.abs().max()) > 1e-4
    # the batch exercises both gate outcomes and capping
    tallies = trainer.queue.tallies().values()
    gates = [
        execution_gate(t.info.advantage, execution_ratio(t.log_ratio_sum, t.count), cfg) for t in tallies
    ]
    assert 0 < sum(gates) < len(gates)
    assert stats.num_capped > 0


def test_proximal_reference_never_gates(tiny_model, batch):
    cfg = LossConfig(ratio_reference="proximal")
    ref_loss, _, _ = reference(tiny_model, batch, cfg)
    trainer, _ = streaming(tiny_model, batch, cfg, shard=64)
    report = trainer.finish()
    assert report.loss == pytest.approx(ref_loss, abs=1e-9)
    assert report.metrics["clip_frac_all"] == 0.0
    assert report.metrics["weight_max"] == 1.0
    assert report.metrics["capped_frac"] == 0.0
    assert report.num_executions == N * B
