"""Shared fixtures: a tiny seeded Qwen3 causal LM saved once per session (helpers live in gyre_train.testing.synthetic)."""

from __future__ import annotations

import pytest

from gyre_train.testing.synthetic import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))
