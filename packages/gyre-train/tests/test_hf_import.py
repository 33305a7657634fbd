"""`gyre_train.hf_import`: transformers imported with the installed-distribution mapping from a per-environment cache."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

from gyre_train.hf_import import distributions_key, package_distributions


def test_the_cached_mapping_is_the_computed_one_and_is_read_back(tmp_path):
    first = package_distributions(tmp_path)
    assert first == importlib.metadata.packages_distributions()
    (cache,) = tmp_path.glob("packages-distributions-*.json")
    assert cache.name == f"packages-distributions-{distributions_key()}.json"
    # the second call reads the file (a marker written into it comes back), it does not scan again
    cache.write_text(json.dumps({"marker": ["from-the-cache"]}))
    assert package_distributions(tmp_path) == {"marker": ["from-the-cache"]}


def test_an_installed_distribution_changes_the_key(tmp_path, monkeypatch):
    before = distributions_key()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert distributions_key() == before  # a directory without distributions (a script's own) leaves it alone
    (tmp_path / "extra_pkg-1.0.dist-info").mkdir()
    installed = distributions_key()
    assert installed != before
    (tmp_path / "extra_pkg-1.0.dist-info").rename(tmp_path / "extra_pkg-1.1.dist-info")
    assert distributions_key() not in (before, installed)  # an upgrade


def test_transformers_imports_with_the_cached_mapping_without_scanning(tmp_path):
    """In a fresh process whose cache is filled, transformers gets its mapping without the scan: the stdlib's
    `packages_distributions` raises there, yet the import succeeds, and the stdlib function is the original after.
    The cache is filled by a fresh process too: this one's `sys.path` may hold what earlier tests of its worker put
    there, and the key would differ (a CI run met that)."""
    env = {**os.environ, "GYRE_CACHE_DIR": str(tmp_path)}
    fill = "import json; from gyre_train.hf_import import package_distributions as p; print(json.dumps(p()))"
    filled = subprocess.run(
        [sys.executable, "-c", fill], env=env, capture_output=True, text=True, timeout=300
    )
    assert filled.returncode == 0, filled.stderr[-2000:]
    probe = (
        "import importlib.metadata as md, json, sys\n"
        "def scan():\n"
        "    raise AssertionError('scanned the installed files')\n"
        "md.packages_distributions = scan\n"
        "from gyre_train.hf_import import import_transformers\n"
        "import_transformers()\n"
        "from transformers.utils import import_utils\n"
        "assert md.packages_distributions is scan\n"
        "print(json.dumps(import_utils.PACKAGE_DISTRIBUTION_MAPPING))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == json.loads(filled.stdout.splitlines()[-1])
