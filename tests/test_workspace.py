"""Workspace rules: lockstep versions, the dependency DAG, light packages without torch, CI = README."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["gyre-tito", "gyre-sched", "gyre-eval", "gyre-train", "gyre-cell"]
# DESIGN §3.1: who may depend on whom (direct edges among Gyre packages).
ALLOWED_EDGES = {
    "gyre-tito": set(),
    "gyre-eval": {"gyre-sched"},  # the execution outcome type only: the runner produces it
    "gyre-sched": set(),
    "gyre-train": {"gyre-tito"},
    "gyre-cell": {
        "gyre-train",
        "gyre-sched",
        "gyre-tito",
    },  # gyre-tito is reachable through gyre-train anyway
    "gyre": set(PACKAGES),
}


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def _project_files() -> dict[str, Path]:
    files = {"gyre": ROOT / "pyproject.toml"}
    files.update({name: ROOT / "packages" / name / "pyproject.toml" for name in PACKAGES})
    return files


def _gyre_requirements(project: dict) -> dict[str, str]:
    reqs = {}
    for req in project["project"].get("dependencies", []):
        m = re.match(r"^(gyre-[a-z]+)(\[[^\]]*\])?(.*)$", req)
        if m:
            reqs[m.group(1)] = m.group(3).strip()
    return reqs


def test_versions_are_lockstep_and_pins_exact():
    projects = {name: _pyproject(path) for name, path in _project_files().items()}
    versions = {name: p["project"]["version"] for name, p in projects.items()}
    assert len(set(versions.values())) == 1, versions
    (version,) = set(versions.values())
    for name, project in projects.items():
        for dep, spec in _gyre_requirements(project).items():
            assert spec == f"=={version}", f"{name} pins {dep} as {spec!r}"


def test_dependency_dag_matches_design():
    for name, path in _project_files().items():
        deps = set(_gyre_requirements(_pyproject(path)))
        assert deps <= ALLOWED_EDGES[name], f"{name} depends on {deps - ALLOWED_EDGES[name]}"


def test_every_package_has_its_layout():
    for name in PACKAGES:
        pkg = ROOT / "packages" / name
        module = name.replace("-", "_")
        assert (pkg / "README.md").is_file()
        assert (pkg / "src" / module / "__init__.py").is_file()
        assert (pkg / "tests").is_dir()
    assert (ROOT / ".python-version").read_text().strip() == "3.12.1"
    assert (ROOT / "uv.lock").is_file()


def test_no_package_imports_another_packages_private_module():
    offenders = []
    pattern = re.compile(r"^\s*(?:from|import)\s+(gyre(?:_[a-z]+)?)\.(_[a-z]\w*)", re.MULTILINE)
    sources = list((ROOT / "packages").glob("*/src/**/*.py")) + list((ROOT / "src").glob("**/*.py"))
    for source in sources:
        own = source.relative_to(ROOT).parts
        own_module = own[3] if own[0] == "packages" else "gyre"
        for module, private in pattern.findall(source.read_text()):
            if module != own_module:
                offenders.append(f"{source.relative_to(ROOT)} imports {module}.{private}")
    assert not offenders, offenders


@pytest.mark.parametrize("module", ["gyre_tito", "gyre_eval", "gyre_sched"])
def test_light_package_does_not_import_torch(module):
    code = (
        "import importlib, pkgutil, sys\n"
        f"pkg = importlib.import_module({module!r})\n"
        "for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        "heavy = sorted(m for m in ('torch', 'megatron', 'sglang') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, re.DOTALL)
    assert m, "README must hold the test command in a fenced block after <!-- test-command -->"
    command = m.group(1).strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f"{command!r} not run by .ci/run"
