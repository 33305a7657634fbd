"""Makes eval_helpers and the example plug-in importable (tests run with --import-mode=importlib)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_helpers import make_workspace


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws", {"main.py": "print('hello')\n", "README.md": "a tiny artifact\n"})
