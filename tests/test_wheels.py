"""`uv build --all-packages` builds six wheels; each light package installs alone and imports."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIGHT = {"gyre_tito": "gyre_tito", "gyre_eval": "gyre_eval", "gyre_sched": "gyre_sched"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [uv, "build", "--all-packages", "--wheel", "--out-dir", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return {p.name.split("-")[0]: p for p in out.glob("*.whl")}


def test_six_wheels_build(wheels):
    assert sorted(wheels) == ["gyre", "gyre_cell", "gyre_eval", "gyre_sched", "gyre_tito", "gyre_train"]


@pytest.mark.parametrize("dist", sorted(LIGHT))
def test_light_wheel_installs_alone(wheels, dist, tmp_path):
    uv = shutil.which("uv")
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--python", "3.12", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [uv, "pip", "install", "--python", str(python), str(wheels[dist])], check=True, capture_output=True
    )
    code = f"import sys, {LIGHT[dist]}; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
