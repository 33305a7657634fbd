"""Choosing the backend by name: ``check_backend`` refuses what cannot run (naming the fields), ``build_backend``
returns a torch or a Megatron backend with the same publication interface (HF names)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gyre_train.backends import BACKENDS, build_backend, check_backend
from gyre_train.backends.torch_backend import TorchBackend


def test_check_backend_accepts_what_runs() -> None:
    assert BACKENDS == ("torch", "megatron")
    check_backend("torch")
    check_backend("megatron", dtype="bfloat16", pipeline_parallel=2, tensor_parallel=2, expert_parallel=2)
    check_backend("megatron", dtype="bfloat16", context_parallel=2)
    check_backend("megatron", one_process_cells=True)
    check_backend("megatron", pipeline_parallel=2, one_process_cells=True)  # stage processes per cell
    check_backend("megatron", tensor_parallel=2, pipeline_parallel=2, one_process_cells=True)  # TP ranks too


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"kind": "jax"}, ["train.backend"]),
        ({"kind": "torch", "pipeline_parallel": 2}, ["train.pipeline_parallel"]),
        (
            {"kind": "torch", "tensor_parallel": 2, "expert_parallel": 4},
            ["train.tensor_parallel", "train.expert_parallel"],
        ),
        ({"kind": "megatron", "tensor_parallel": 0}, ["train.tensor_parallel"]),
        ({"kind": "megatron", "dtype": "float64"}, ["train.dtype"]),
        ({"kind": "megatron", "context_parallel": 2}, ["train.context_parallel", "train.dtype"]),
        ({"kind": "megatron", "expert_parallel": 2, "one_process_cells": True}, ["train.expert_parallel"]),
        ({"kind": "megatron", "dtype": "bfloat16", "one_process_cells": True}, ["train.dtype"]),
    ],
)
def test_check_backend_refuses_naming_the_fields(kwargs, names) -> None:
    kind = kwargs.pop("kind")
    with pytest.raises(ValueError) as err:
        check_backend(kind, prefix="train.", **kwargs)
    msg = str(err.value)
    assert "\n" not in msg
    for name in names:
        assert name in msg, msg


def test_build_torch_backend(tiny_model) -> None:
    from transformers import AutoModelForCausalLM  # slow to import: not at collection

    b = build_backend("torch", model_path=tiny_model, lr=1e-3, optimizer=False)
    assert isinstance(b, TorchBackend) and b.optimizer is None
    ref = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    got = b.hf_state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="pipeline_parallel"):
        build_backend("torch", model_path=tiny_model, pipeline_parallel=2)


@pytest.mark.slow  # imports megatron-core (~20 s here)
def test_build_megatron_backend_publishes_hf_names(tiny_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from gyre_train.megatron import MegatronBackend

    assert not dist.is_initialized()
    b = build_backend("megatron", model_path=tiny_model, lr=1e-3)
    try:
        assert isinstance(b, MegatronBackend) and b.optimizer is not None and not b.mixed
        ref = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
        got = b.hf_state_dict()
        assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
        b.save_hf_pretrained(tmp_path / "out")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
        assert all(torch.equal(back[k], ref[k]) for k in ref)
    finally:
        b.close()
    assert not dist.is_initialized()
