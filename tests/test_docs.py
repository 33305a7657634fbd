"""The documentation site: it builds with `mkdocs build --strict` (no broken link or anchor, no page outside the nav),
every docs path cited elsewhere in the repository (code comments, READMEs) names a page and an anchor that exist,
the generated reference matches the code, and no citation of the old, out-of-repository design document is left."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# "docs/design/training.md#objective" in a comment, or "../../docs/guides/model.md" in a README link.
CITED = re.compile(r"(?<![\w/.-])(?:\.\./)*docs/([\w/.-]+?\.md)(?:#([\w-]+))?")


def _repo_files(suffixes: tuple[str, ...]) -> list[Path]:
    """The repository's files, tracked or not yet added (never what git ignores: .venv, runs, node_modules)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    paths = (ROOT / name for name in dict.fromkeys(listed.split("\0")) if name.endswith(suffixes))
    return [p for p in paths if p.is_file()]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _anchors(site: Path, page: str) -> set[str] | None:
    """The ids of a built page (None: no such page). docs/x/y.md is built to x/y/index.html, index.md to index.html."""
    stem = page.removesuffix(".md")
    html = site / ("index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html")
    if not (DOCS / page).is_file() or not html.is_file():
        return None
    return set(re.findall(r'\bid="([^"]+)"', html.read_text()))


def _broken(site: Path, text: str) -> list[str]:
    broken = []
    for m in CITED.finditer(text):
        page, anchor = m.group(1), m.group(2)
        ids = _anchors(site, page)
        if ids is None:
            broken.append(f"docs/{page}: no such page")
        elif anchor and anchor not in ids:
            broken.append(f"docs/{page}#{anchor}: no such anchor")
    return broken


def test_the_site_builds_strict_with_every_page_in_the_nav(site):
    assert (site / "index.html").is_file()
    for page in (
        "getting-started",
        "concepts/cells",
        "guides/reward",
        "reference/config",
        "design/scheduling",
    ):
        assert (site / page / "index.html").is_file(), page
    # Every Markdown page is in the nav (strict turns an omitted one into a failure): each was built.
    for md in DOCS.rglob("*.md"):
        assert _anchors(site, str(md.relative_to(DOCS))) is not None, md


def test_every_docs_path_cited_in_the_repository_resolves(site):
    broken = []
    for path in _repo_files((".py", ".md", ".toml")):
        if (DOCS in path.parents and path.suffix == ".md") or path == Path(__file__):
            continue  # the site's own links (mkdocs --strict checked them), and this file's examples
        broken += [f"{path.relative_to(ROOT)}: {b}" for b in _broken(site, path.read_text(errors="replace"))]
    assert not broken, "\n".join(broken)


def test_every_relative_link_of_the_readmes_resolves():
    """The landing README and the package and example READMEs link into docs/ and examples/ by relative paths."""
    broken = []
    for readme in [p for p in _repo_files((".md",)) if p.name == "README.md" and DOCS not in p.parents]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text()):
            if not re.match(r"[a-z]+://", target) and not (readme.parent / target).exists():
                broken.append(f"{readme.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)


def test_the_configs_shown_in_the_readme_and_the_docs_are_valid(tmp_path):
    """Each TOML block loads: a run config, or a simulator config where it starts from a preset (its [compare]
    table is `gyre-sched compare`'s own)."""
    from gyre.config import load_config  # torch-free
    from gyre_sched.config import SimConfig
    from gyre_sched.presets import resolve

    blocks = [
        (md, block)
        for md in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
        for block in re.findall(r"```toml\n(.*?)```", md.read_text(), re.DOTALL)
    ]
    assert len(blocks) >= 12
    for i, (md, block) in enumerate(blocks):
        try:
            if "preset =" in block:
                raw = tomllib.loads(block)
                raw.pop("compare", None)
                SimConfig.model_validate(resolve(raw))
            else:
                path = tmp_path / f"{i}.toml"
                path.write_text(block)
                load_config(path)
        except ValueError as exc:
            pytest.fail(f"{md.relative_to(ROOT)}: {exc}\n{block}")


def test_a_broken_citation_is_found(site):
    assert _broken(site, "see docs/design/training.md#objective and docs/concepts/cells.md") == []
    assert _broken(site, "docs/design/training.md#no-such-anchor, docs/nowhere.md") == [
        "docs/design/training.md#no-such-anchor: no such anchor",
        "docs/nowhere.md: no such page",
    ]


def test_the_generated_reference_is_current():
    done = subprocess.run(
        [sys.executable, str(DOCS / "gen_reference.py"), "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_stale_reference_page_is_named(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)  # the module imports no Gyre package until it generates
    (tmp_path / "config.md").write_text("# Run config\n")
    (tmp_path / "cli.md").write_text("# Command lines\n")
    pages = {"config.md": "# Run config\n", "cli.md": "# Command lines, changed\n", "new.md": "x"}
    assert gen.stale_pages(pages, tmp_path) == [str(tmp_path / "cli.md"), str(tmp_path / "new.md")]


def test_no_citation_of_the_old_design_document_is_left():
    old = "DESIGN" + " §"  # spelled apart so that this file does not cite it
    left = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in _repo_files((".py", ".md", ".toml"))
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if old in line
    ]
    assert not left, f"cite docs/design/ pages instead: {left}"
