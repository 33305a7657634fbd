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
    # Its Gyre requirements (gyre-eval's gyre-sched: the outcome type) come from the same build, never an index.
    proc = subprocess.run(
        [
            uv,
            "pip",
            "install",
            "--python",
            str(python),
            "--find-links",
            str(wheels[dist].parent),
            str(wheels[dist]),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    code = (
        f"import sys, importlib.metadata as md, {LIGHT[dist]}; assert 'torch' not in sys.modules; "
        "print(sorted(d.metadata['Name'] for d in md.distributions() if d.metadata['Name'].startswith('gyre')))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    expected = {"gyre_eval": ["gyre-eval", "gyre-sched"]}.get(dist, [dist.replace("_", "-")])
    assert out.stdout.strip() == str(expected)  # only the Gyre packages it needs
