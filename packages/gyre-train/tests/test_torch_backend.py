"""Torch backend: packed rows equal per-row forwards (no cross-row attention), temperature, grad accumulation."""

from __future__ import annotations

import random

import torch

from gyre_train.backends.base import PackedTensors, TrainBackend
from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
from gyre_train.types import TokenStats


def _packed(rows, continuous_positions=False):
    ids = [t for r in rows for t in r]
    pos = list(range(len(ids))) if continuous_positions else [p for r in rows for p in range(len(r))]
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + len(r))
    labels = [t for r in rows for t in [*r[1:], -100]]
    return PackedTensors(
        torch.tensor(ids), torch.tensor(pos), torch.tensor(cu, dtype=torch.int32), torch.tensor(labels)
    )


def test_packed_rows_equal_separate_rows(tiny_model):
    backend = TorchBackend(TorchBackendConfig(model_path=tiny_model, dtype="float64", optimizer=False))
    assert isinstance(backend, TrainBackend)
    rng = random.Random(0)
    rows = [[rng.randrange(512) for _ in range(n)] for n in (9, 1, 14, 5)]
    packed = backend.logprobs(_packed(rows), 0.7)
    separate = torch.cat([backend.logprobs(_packed([r]), 0.7) for r in rows])
    assert packed.dtype == torch.float64 and packed.shape == (29,)
    assert torch.allclose(packed, separate, atol=1e-12)
    leaky = backend.logprobs(_packed(rows, continuous_positions=True), 0.7)
    # the comparison can fail: attention across rows changes values
    assert (leaky - separate).abs().max() > 1e-3
    assert packed[8] == 0.0 and packed[9] == 0.0  # label -100 -> 0
    # temperature: l = log_softmax(logits / T)
    hot = backend.logprobs(_packed(rows), 2.0)
    assert not torch.allclose(hot, packed)


def test_gradients_accumulate_as_a_plain_sum(tiny_model):
    backend = TorchBackend(TorchBackendConfig(model_path=tiny_model, dtype="float64", optimizer=False))
    rng = random.Random(1)
    a, b = (
        _packed([[rng.randrange(512) for _ in range(12)]]),
        _packed([[rng.randrange(512) for _ in range(7)]]),
    )

    def loss_fn(l_T):
        return -l_T.sum(), TokenStats(num_targets=int((l_T != 0).sum()))

    backend.forward_backward(a, 1.0, loss_fn)
    ga = backend.flat_grads()
    backend.zero_grad()
    backend.forward_backward(b, 1.0, loss_fn)
    gb = backend.flat_grads()
    backend.zero_grad()
    backend.forward_backward(a, 1.0, loss_fn)
    stats = backend.forward_backward(b, 1.0, loss_fn)
    assert stats.num_targets == 6
    assert torch.allclose(backend.flat_grads(), ga + gb, atol=1e-12)
    flat = backend.flat_params()
    backend.load_flat_params(flat + 1.0)
    assert torch.allclose(backend.flat_params(), flat + 1.0)


def test_core_update_clips_once_and_uses_adam(tiny_model):
    backend = TorchBackend(TorchBackendConfig(model_path=tiny_model, dtype="float64", lr=1e-3))
    before = backend.flat_params()
    g = torch.zeros_like(before)
    g[0], g[1] = 30.0, 40.0  # norm 50 -> clipped to 1.0
    backend.set_flat_grads(g)
    norm = backend.optimizer_step(max_grad_norm=1.0)
    assert norm == 50.0
    delta = backend.flat_params() - before
    # Adam's first step moves every parameter with a non-zero gradient by ~lr, others by 0
    assert torch.allclose(delta[:2], torch.tensor([-1e-3, -1e-3], dtype=torch.float64), atol=1e-8)
    assert torch.count_nonzero(delta[2:]) == 0
    assert backend.flat_grads().abs().sum() == 0  # grads are consumed by the update
