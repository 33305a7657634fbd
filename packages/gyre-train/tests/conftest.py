"""Shared fixtures: a tiny seeded Qwen3 causal LM saved once per session (helpers live in gyre_train.synthetic)."""

from __future__ import annotations

import pytest

from gyre_train.synthetic import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # Tiny matmuls on a shared 2-core box run ~10x faster on one intra-op thread than on two contended ones.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
