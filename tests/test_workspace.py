"""Workspace rules: lockstep versions, the dependency DAG, light packages without torch, CI = README."""

from __future__ import annotations

import ast
import builtins
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["gyre-tito", "gyre-sched", "gyre-eval", "gyre-train", "gyre-cell"]
# docs/design/architecture.md#packages: who may depend on whom (direct edges among Gyre packages).
ALLOWED_EDGES = {
    "gyre-tito": {"gyre-sched"},  # the one service-token reader (gyre_sched.secret); gyre-sched is light
    "gyre-eval": {"gyre-sched"},  # the execution outcome type (the runner's) and the group readiness rule
    "gyre-sched": set(),
    "gyre-train": {"gyre-tito", "gyre-eval"},  # trajectory types; the one advantage formula
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


@pytest.mark.parametrize(
    "module", ["gyre", "gyre_cell", "gyre_eval", "gyre_sched", "gyre_tito", "gyre_train"]
)
def test_every_package_declares_its_public_api_and_importing_it_is_light(module):
    """Each package's `__init__` names its API (`__all__`, every name resolves), and importing the package itself loads
    no torch: the heavy packages' names load on first use."""
    code = (
        "import importlib, json, sys\n"
        f"pkg = importlib.import_module({module!r})\n"
        "light = 'torch' not in sys.modules\n"
        "missing = [name for name in pkg.__all__ if getattr(pkg, name, None) is None]\n"
        "print(json.dumps([len(pkg.__all__), light, missing]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, light, missing = json.loads(out.stdout)
    assert count > 0 and light and missing == [], out.stdout


def test_every_exception_a_package_raises_is_defined_in_its_errors_module():
    """One home per package for its exceptions (`gyre_x.errors`): callers catch them by one import path. The
    evaluator's sandbox child runs alone, without its package, and keeps its own."""
    builtin_exceptions = {
        n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
    }
    strays = []
    for path in sorted((ROOT / "packages").glob("*/src/*/**/*.py")):
        if path.name in ("errors.py", "_sandbox_child.py") or "vllm_ext" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            bases = (
                [b.id for b in node.bases if isinstance(b, ast.Name)]
                if isinstance(node, ast.ClassDef)
                else []
            )
            if any(
                b.endswith(("Error", "Exception")) or (b in builtin_exceptions and "Error" in b)
                for b in bases
            ):
                strays.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not strays, strays


# The README's test command: the `dev` group brings what the tests import (SGLang, Megatron-core, Ray, playwright...),
# which the default environment, the one `uv run gyre demo` syncs, leaves out.
TEST_COMMAND = "uv run --group dev pytest -q -n 2"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", readme, re.DOTALL)
    assert m, "README must hold the test command in a fenced block after <!-- test-command -->"
    command = m.group(1).strip()
    assert command == TEST_COMMAND
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f"{command!r} not run by .ci/run"


def _locked_packages(*args: str) -> set[str]:
    """The distributions an environment synced from the lock holds (uv export reads uv.lock, resolves nothing)."""
    out = subprocess.run(
        ["uv", "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-header", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return {
        re.split(r"[=<>;\[ ]", line, maxsplit=1)[0].lower()
        for line in out.stdout.splitlines()
        if line[:1].isalnum()
    }


HEAVY = {
    "sglang",
    "flashinfer-python",
    "sglang-kernel",
    "megatron-core",
    "ray",
    "playwright",
    "pytest",
    "mkdocs-material",
}


def test_default_environment_leaves_out_what_the_demo_does_not_import():
    default = _locked_packages()
    assert {"torch", "transformers", "mooncake-transfer-engine-non-cuda", "tensorboard"} <= default
    assert not default & HEAVY, sorted(default & HEAVY)
    assert _locked_packages("--group", "dev") >= HEAVY  # the test command's environment has them all


def _root_conftest():
    spec = importlib.util.spec_from_file_location("gyre_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_test_file_naming_a_system_tool_is_in_the_system_map():
    listed = _root_conftest().SYSTEM_PACKAGES
    words = {"chromium": r"chromium", "bubblewrap": r"\bbwrap\b|bubblewrap", "runc": r"\brunc\b"}
    files = sorted(ROOT.glob("tests/**/test_*.py")) + sorted(ROOT.glob("packages/*/tests/**/test_*.py"))
    files.remove(Path(__file__).resolve())  # this file names them all
    for package, word in words.items():
        naming = {str(f.relative_to(ROOT)) for f in files if re.search(word, f.read_text())}
        assert naming and naming <= set(listed[package]), (
            f"{package}: {sorted(naming - set(listed[package]))}"
        )


def _collect_without_system_tools(*paths: str) -> subprocess.CompletedProcess:
    """`pytest --collect-only` of `paths` with only the environment's own bin on PATH (no chromium, no apt-get)."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *paths],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def test_test_command_stops_at_once_naming_the_system_package_to_install():
    proc = _collect_without_system_tools("tests/test_report.py")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR: the tests need Debian's chromium"), proc.stderr
    assert "apt-get install -y chromium" in lines[0] and "test_report" not in proc.stdout  # nothing collected


def test_a_selection_needs_only_its_own_system_packages():
    light = _collect_without_system_tools("packages/gyre-tito/tests/test_parse.py")
    assert light.returncode == 0 and "test_parse.py::" in light.stdout, light.stderr
    other = _collect_without_system_tools("tests/test_workspace.py")
    assert "chromium" not in other.stderr and "bubblewrap" not in other.stderr, other.stderr
