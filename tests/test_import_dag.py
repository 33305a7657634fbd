"""The package DAG, read from the source with `ast` (nothing is imported, so a forbidden import cannot hide behind an
import error or an optional dependency that happens to be installed).

Every `import` and `from ... import` of a Gyre package is collected, at module level and inside functions and classes
alike (a lazy import is still a dependency). The test fails, printing each violation as `file:line`, on:

- a light package (gyre_tito, gyre_eval, gyre_sched) importing torch or a heavy package (gyre_train, gyre_cell, gyre):
  light packages are installed where there is no accelerator;
- a package importing a private module or name (one starting with `_`) of another package: only public surfaces are
  contracts;
- a package importing another that is not among its declared dependencies (its pyproject.toml): an installed wheel
  would fail with ModuleNotFoundError;
- a cycle between packages.

Known violations that are not fixed yet stay in `ALLOWED`, each with its reason, so that any new one still fails.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LIGHT = {"gyre_tito", "gyre_eval", "gyre_sched"}
HEAVY = {"gyre_train", "gyre_cell", "gyre"}


def _packages() -> dict[str, tuple[Path, Path]]:
    """Import name -> (its source folder, its pyproject.toml), for the five packages and the meta-package."""
    found = {"gyre": (ROOT / "src" / "gyre", ROOT / "pyproject.toml")}
    for pyproject in sorted(ROOT.glob("packages/gyre-*/pyproject.toml")):
        name = pyproject.parent.name.replace("-", "_")
        found[name] = (pyproject.parent / "src" / name, pyproject)
    return found


PACKAGES = _packages()

# Known violations: (file relative to the repository root, imported module) -> why it is still there.
# Keyed by module rather than line, so an edit elsewhere in the file does not break the test; remove an entry when
# its import goes (the test fails on a stale entry too, so the list only shrinks).
ALLOWED: dict[tuple[str, str], str] = {}


def _declared(pyproject: Path) -> set[str]:
    """The Gyre packages a pyproject.toml declares as dependencies (distribution gyre-x -> import name gyre_x)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    names = {re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0] for d in project.get("dependencies", [])}
    return {n.lower().replace("-", "_") for n in names if n.lower().startswith("gyre")}


@dataclass(frozen=True)
class Import:
    file: str  # relative to the repository root
    line: int
    package: str  # the importing package
    module: str  # the imported module, absolute
    names: tuple[str, ...]  # for `from module import a, b`: a, b

    @property
    def target(self) -> str:
        return self.module.split(".")[0]

    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.package} imports {self.module}" + (
            f" ({', '.join(self.names)})" if self.names else ""
        )


def _imports(package: str, folder: Path) -> list[Import]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):  # every level, not only the module's
            if isinstance(node, ast.Import):
                found += [Import(rel, node.lineno, package, a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = tuple(a.name for a in node.names)
                found.append(Import(rel, node.lineno, package, node.module, names))
            # relative imports (level > 0) stay inside their own package: nothing to check between packages
    return found


def _all_imports() -> list[Import]:
    return [i for name, (folder, _) in PACKAGES.items() for i in _imports(name, folder)]


def _private(i: Import) -> bool:
    parts = [*i.module.split(".")[1:], *i.names]
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def violations(imports: list[Import]) -> dict[tuple[str, str], str]:
    """(file, module) -> the violation's line (file:line: what and why), for every rule but the cycles."""
    declared = {name: _declared(pyproject) for name, (_, pyproject) in PACKAGES.items()}
    out: dict[tuple[str, str], str] = {}
    for i in imports:
        problems = []
        if i.package in LIGHT and (i.target == "torch" or i.target in HEAVY):
            problems.append(
                f"light package importing {'torch' if i.target == 'torch' else 'a heavy package'}"
            )
        if i.target in PACKAGES and i.target != i.package:
            if _private(i):
                problems.append(f"private module or name of {i.target}")
            if i.target not in declared[i.package]:
                problems.append(f"{i.target} is not a declared dependency of {i.package}")
        if problems:
            out.setdefault((i.file, i.module), f"{i.where()}: {'; '.join(problems)}")
    return out


def cycles(imports: list[Import]) -> list[list[str]]:
    """The package cycles of the import graph (each once, as the path that closes it)."""
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for i in imports:
        if i.target in PACKAGES and i.target != i.package:
            edges[i.package].add(i.target)
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(edges[node]):
            if nxt in path:
                cycle = [*path[path.index(nxt) :], nxt]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    found.append(cycle)
            else:
                visit(nxt, [*path, nxt])

    for start in sorted(PACKAGES):
        visit(start, [start])
    return found


def test_every_package_is_found():
    assert sorted(PACKAGES) == ["gyre", "gyre_cell", "gyre_eval", "gyre_sched", "gyre_tito", "gyre_train"]
    assert all(folder.is_dir() for folder, _ in PACKAGES.values())


def test_no_forbidden_import_between_packages():
    imports = _all_imports()
    found = violations(imports)
    new = [line for key, line in sorted(found.items()) if key not in ALLOWED]
    stale = [f"{f}: {m} ({why})" for (f, m), why in sorted(ALLOWED.items()) if (f, m) not in found]
    assert not new, "forbidden imports:\n" + "\n".join(new)
    assert not stale, "allowed violations that are gone (remove them from ALLOWED):\n" + "\n".join(stale)


def test_the_packages_form_no_cycle():
    found = cycles(_all_imports())
    assert not found, "import cycles between packages:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_checks_catch_each_kind_of_violation():
    """The rules themselves, on imports made up for them: each would be reported."""
    made_up = [
        Import("a.py", 1, "gyre_tito", "torch", ()),
        Import("a.py", 2, "gyre_sched", "gyre_train.loss", ("x",)),
        Import("a.py", 3, "gyre_train", "gyre_tito._memory", ()),
        Import("a.py", 4, "gyre_train", "gyre_tito.proxy", ("_helper",)),
        Import("a.py", 5, "gyre_eval", "gyre_tito.types", ()),
        Import("a.py", 6, "gyre_train", "gyre_tito.types", ("Trajectory",)),  # fine: declared, public, light
    ]
    found = violations(made_up)
    modules = ["gyre_tito._memory", "gyre_tito.proxy", "gyre_tito.types", "gyre_train.loss", "torch"]
    assert sorted(found) == [("a.py", m) for m in modules]  # not line 6
    assert "light package importing torch" in found[("a.py", "torch")]
    assert "a.py:2:" in found[("a.py", "gyre_train.loss")] and "heavy" in found[("a.py", "gyre_train.loss")]
    assert "private module or name of gyre_tito" in found[("a.py", "gyre_tito._memory")]
    assert "private" in found[("a.py", "gyre_tito.proxy")]
    assert "gyre_tito is not a declared dependency of gyre_eval" in found[("a.py", "gyre_tito.types")]
    loop = [
        Import("a.py", 1, "gyre_tito", "gyre_sched.x", ()),
        Import("b.py", 1, "gyre_sched", "gyre_tito.y", ()),
    ]
    assert cycles(loop) == [["gyre_sched", "gyre_tito", "gyre_sched"]]
