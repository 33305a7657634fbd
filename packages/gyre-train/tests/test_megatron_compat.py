"""The CPU compatibility layer: patches only megatron's modules, idempotent, revertible, and makes the CUDA-only
paths (current device, RNG tracker, the schedule's token counter, flash_mla) work on CPU.

That forward/backward really runs with it (and fails without it) is tested in test_megatron_backend.py.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from gyre_train.megatron import compat

# slow: the first test pays for importing megatron-core (~20 s on a shared 2-core box).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is a no-op where CUDA exists"),
]


@pytest.fixture(autouse=True)
def _reapply():
    """Whatever a test does, leave the layer applied (model.py applies it at import; other tests rely on it)."""
    yield
    compat.apply()


def test_apply_patches_megatron_modules_and_leaves_torch_alone() -> None:
    real_current_device = torch.cuda.current_device
    real_get_rng_state = torch.cuda.get_rng_state
    assert compat.apply() is True
    assert compat.is_applied()
    for name in compat.PATCHED_MODULES:
        mod = sys.modules[name]
        assert mod.torch is not torch
        assert mod.torch.cuda.current_device() == "cpu"
        assert mod.torch.Tensor is torch.Tensor  # everything else forwards to the real torch
    # torch itself is untouched: code outside megatron still sees the real CUDA API.
    assert torch.cuda.current_device is real_current_device
    assert torch.cuda.get_rng_state is real_get_rng_state
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()
    # The schedule's `torch.zeros([], device="cuda")` token counter lands on the CPU.
    sched = sys.modules["megatron.core.pipeline_parallel.schedules"]
    assert sched.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert sched.torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    if importlib.util.find_spec("flash_mla") is not None:
        assert sys.modules["flash_mla"] is None  # import flash_mla -> ImportError, which megatron handles
        with pytest.raises(ImportError):
            import flash_mla  # noqa: F401


def test_apply_is_idempotent() -> None:
    compat.apply()
    proxy = sys.modules[compat.PATCHED_MODULES[0]].torch
    random_mod = sys.modules["megatron.core.tensor_parallel.random"]
    getter = random_mod._get_cuda_rng_state
    assert compat.apply() is True
    assert sys.modules[compat.PATCHED_MODULES[0]].torch is proxy
    assert random_mod._get_cuda_rng_state is getter


def test_revert_restores_the_original_modules() -> None:
    compat.apply()
    random_mod = sys.modules["megatron.core.tensor_parallel.random"]
    patched_getter = random_mod._get_cuda_rng_state
    compat.revert()
    assert not compat.is_applied()
    for name in compat.PATCHED_MODULES:
        assert sys.modules[name].torch is torch
    assert random_mod._get_cuda_rng_state is not patched_getter
    with pytest.raises((RuntimeError, AssertionError)):
        random_mod._get_cuda_rng_state()  # the real one needs a GPU
    compat.revert()  # reverting twice is harmless
    assert compat.apply() is True
    assert random_mod._get_cuda_rng_state is patched_getter and compat.is_applied()


def test_not_applied_where_cuda_exists(monkeypatch) -> None:
    compat.revert()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # stand-in for a GPU machine
    assert not compat.needed()
    assert compat.apply() is False
    assert not compat.is_applied()
    assert compat.apply(force=True) is True


def test_rng_tracker_forks_the_cpu_generator() -> None:
    compat.apply()
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = mrandom.get_cuda_rng_tracker()
    torch.manual_seed(7)
    outside_expected = torch.rand(3)
    torch.manual_seed(7)
    with tracker.fork():
        a = torch.rand(3)
    # The fork ran on the tracker's own stream and restored the CPU generator afterwards.
    assert torch.equal(torch.rand(3), outside_expected)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the tracked stream advanced
    mrandom.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with mrandom.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), a)  # same seed, same stream


def test_building_model_keeps_tensor_cuda_on_cpu_only_inside_the_block() -> None:
    compat.apply()
    t = torch.ones(2)
    with compat.building_model():
        assert t.cuda() is t  # GPTModel's tied-embedding copy stays where it is
    with pytest.raises((RuntimeError, AssertionError)):
        t.cuda()  # the real method is back
    compat.revert()
    with compat.building_model(), pytest.raises((RuntimeError, AssertionError)):
        t.cuda()  # not applied: nothing is patched


def test_cuda_tensor_types_names_cpu_tensors_as_cuda_only_inside_the_block() -> None:
    compat.apply()
    t = torch.ones(2, dtype=torch.bfloat16)
    with compat.cuda_tensor_types():
        # megatron's optimizers accept only these names for the parameters they wrap.
        assert t.type() == "torch.cuda.BFloat16Tensor"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float32).dtype == torch.float32  # conversions are untouched
    assert t.type() == "torch.BFloat16Tensor"
    compat.revert()
    with compat.cuda_tensor_types():
        assert t.type() == "torch.BFloat16Tensor"  # not applied: nothing is patched


def test_ddp_and_moe_paths_see_cpu_streams_and_host_splits() -> None:
    compat.apply()
    buffers = sys.modules["megatron.core.distributed.param_and_grad_buffer"]
    stream = buffers.torch.cuda.current_stream()
    stream.wait_event(buffers.torch.cuda.Event())  # DDP waits on CUDA-graph events before the grad reduce
    with buffers.torch.cuda.stream(buffers.torch.cuda.Stream()):
        pass
    dispatcher = sys.modules["megatron.core.transformer.moe.token_dispatcher"]
    splits = dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert splits.tolist() == [3, 1] and not torch.is_tensor(splits)  # all_to_all_single takes a sequence
    t = torch.tensor([2])
    assert dispatcher.maybe_move_tensor_to_cpu(t) is t
    compat.revert()
    assert (
        dispatcher.maybe_move_tensor_to_cpu
        is sys.modules["megatron.core.transformer.moe.moe_utils"].maybe_move_tensor_to_cpu
    )
