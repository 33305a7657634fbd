"""`uv build --all-packages` builds six wheels with complete metadata; each light package installs alone and imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
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
    assert sorted(wheels) == ["gyre_cell", "gyre_eval", "gyre_rl", "gyre_sched", "gyre_tito", "gyre_train"]


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(zf.read(name).decode())


@pytest.mark.parametrize(
    "dist", ["gyre_cell", "gyre_eval", "gyre_rl", "gyre_sched", "gyre_tito", "gyre_train"]
)
def test_wheel_metadata_is_complete(wheels, dist):
    meta = _metadata(wheels[dist])
    assert meta["Name"] == dist.replace("_", "-") and meta["Version"]
    assert len(meta["Summary"]) > 40  # a sentence, not a placeholder
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.12"
    assert meta["Author"]
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3.12" in classifiers
    assert any(c.startswith("Development Status ::") for c in classifiers)
    assert any(c.startswith("Topic ::") for c in classifiers)
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().lstrip().startswith("# ")  # the package's README as its long description


def test_meta_package_installs_the_gyre_module_and_command(wheels):
    # Its distribution name is free on the index (`gyre` there is another project); the import and the command are gyre.
    with zipfile.ZipFile(wheels["gyre_rl"]) as zf:
        names = zf.namelist()
        assert "gyre/__init__.py" in names and "gyre/cli.py" in names
        entry_points = zf.read("gyre_rl-0.1.0.dist-info/entry_points.txt").decode()
    assert "gyre = gyre.cli:main" in entry_points


def test_twine_check_passes(wheels):
    out = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(wheels.values()))],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASSED") == 6, out.stdout


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
    # gyre-sched comes without its `plot` extra: the token reader and the outcome vocabulary, no matplotlib
    expected = {"gyre_eval": ["gyre-eval", "gyre-sched"], "gyre_tito": ["gyre-sched", "gyre-tito"]}.get(
        dist, [dist.replace("_", "-")]
    )
    assert out.stdout.strip() == str(expected)  # only the Gyre packages it needs
    plots = subprocess.run([str(python), "-c", "import matplotlib"], capture_output=True, text=True)
    assert plots.returncode != 0  # a light package brings no plotting library
