"""Checkpoints of the Megatron backend's bf16 path: the bf16 model and this rank's optimizer shard (fp32 main
parameters, Adam moments) of megatron's distributed optimizer, saved to disk and restored.

One bf16 backend in this module (megatron's groups are global state; the fixture checks they are gone after).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from gyre_train.backends.base import PackedTensors
from gyre_train.loss import LossConfig, make_loss_fn, prepass_partials
from gyre_train.types import IGNORE_LABEL, ExecutionInfo, MicroStep, Shard

pytestmark = pytest.mark.slow  # importing megatron-core takes ~20 s here; the test itself a few seconds

LR = 1e-3


@pytest.fixture(scope="module")
def mg(tiny_model):
    from megatron.core import parallel_state

    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig

    assert not dist.is_initialized(), "an earlier test left torch.distributed initialized"
    backend = MegatronBackend(
        MegatronBackendConfig(
            model_path=tiny_model, lr=LR, params_dtype="bfloat16", distributed_optimizer=True
        )
    )
    yield backend
    backend.close()
    assert not dist.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()


def _microstep(backend) -> MicroStep:
    g = torch.Generator().manual_seed(5)
    ids, labels, slots, cu = [], [], [], [0]
    for r, n in enumerate([11, 8]):
        row = torch.randint(0, 512, (n,), generator=g).tolist()
        ids += row
        labels += [*row[1:], IGNORE_LABEL]
        slots += [(-1 if p < 1 or p == n - 1 else r) for p in range(n)]
        cu.append(cu[-1] + n)
    shard = Shard(
        input_ids=ids, cu_seqlens=cu, labels=labels, exec_slot=slots, behavior_logprobs=[0.0] * len(ids)
    )
    l_T = backend.logprobs(PackedTensors.from_shard(shard), 1.0).double()
    b_T = torch.where(torch.tensor(slots) >= 0, l_T + 0.003, torch.zeros_like(l_T))
    shard = shard.model_copy(update={"behavior_logprobs": b_T.tolist()})
    sums, counts = prepass_partials(shard, l_T, 2)
    execs = [
        ExecutionInfo(
            execution_id=f"x{i}",
            group_id="g",
            advantage=adv,
            num_targets=counts[i],
            staleness=0,
            log_ratio_sum=sums[i],
        )
        for i, adv in enumerate([0.9, -0.4])
    ]
    return MicroStep(batch=0, index=0, norm=2, temperature=1.0, executions=execs, shards=[shard])


def test_bf16_checkpoint_restores_model_and_sharded_optimizer_state(mg, tmp_path) -> None:
    ms = _microstep(mg)
    batch = PackedTensors.from_shard(ms.shards[0])

    def one_step() -> None:
        mg.forward_backward(batch, 1.0, make_loss_fn(ms, 0, LossConfig()))
        mg.optimizer_step(max_grad_norm=1.0)

    one_step()
    state = mg.state_dict()
    (shard,) = state["shards"]
    assert {k for s in shard["state"]["state"].values() for k in s} >= {"exp_avg", "exp_avg_sq"}
    assert all(p.dtype == torch.float32 for g in shard["main"] for p in g)  # fp32 main parameters
    assert sum(p.numel() for g in shard["main"] for p in g) == mg.optimizer_state_numel() // 3
    torch.save(state, tmp_path / "ckpt.pt")
    after_one = mg.flat_params()
    one_step()
    expected = mg.flat_params()
    moments = copy.deepcopy(mg.state_dict()["shards"][0]["state"]["state"])
    assert not torch.equal(expected, after_one)

    # A third step moves everything away; loading the checkpoint brings back step 1's state exactly.
    one_step()
    mg.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    assert torch.equal(mg.flat_params(), after_one)
    one_step()
    # same model, same main params, same moments and step count
    assert torch.equal(mg.flat_params(), expected)
    for i, s in mg.state_dict()["shards"][0]["state"]["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(moments[i][k])), (i, k)


def test_bf16_checkpoint_refuses_another_layout_or_precision(mg) -> None:
    state = mg.state_dict()
    other = {**state, "layout": {**state["layout"], "dp": 2}}
    with pytest.raises(ValueError, match="layout"):
        mg.load_state_dict(other)
    with pytest.raises(ValueError, match="fp32 checkpoint"):
        mg.load_state_dict({"model": state["model"], "optimizer": None})
