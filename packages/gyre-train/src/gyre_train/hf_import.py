"""Import transformers without its scan of every installed distribution's file list (seconds, on every start).

At import, `transformers.utils.import_utils` calls `importlib.metadata.packages_distributions()`, which reads the
RECORD of every installed distribution without a `top_level.txt` and stats each file it lists: on this workspace's
environment (270 distributions, ~50k files) that is 2.3 s of a cell worker's start, paid again by every process that
loads a model or a tokenizer. The mapping depends only on what is installed, so `import_transformers()` computes it
once per environment, keeps it in the cache directory (`$GYRE_CACHE_DIR`, else `$XDG_CACHE_HOME/gyre`, else
`~/.cache/gyre`) under a key made of the interpreter and the names of the distributions on `sys.path` (an install,
an upgrade or a removal changes a name, so the key), and hands transformers that mapping while it imports.

Call it before the first `import transformers` of a process; a process that already imported transformers, a
cache that cannot be read or written, or anything unexpected falls back to the plain computation.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = ["distributions_key", "import_transformers", "package_distributions"]

_SUFFIXES = (".dist-info", ".egg-info", ".egg-link")


def _cache_dir() -> Path:
    if os.environ.get("GYRE_CACHE_DIR"):
        return Path(os.environ["GYRE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gyre"


def distributions_key() -> str:
    """A hash of the interpreter and of the distributions' metadata directories on `sys.path` (name and version)."""
    h = hashlib.sha256(sys.version.encode())
    for entry in sys.path:
        try:
            names = sorted(n for n in os.listdir(entry or ".") if n.endswith(_SUFFIXES))
        except OSError:  # not a directory (a zip, a missing path entry)
            continue
        if names:  # a script's own directory holds none: where it runs from leaves the key alone
            h.update(f"\0{entry}\0".encode() + "\0".join(names).encode())
    return h.hexdigest()[:16]


def package_distributions(cache_dir: Path | None = None) -> dict[str, list[str]]:
    """`importlib.metadata.packages_distributions()`, read from the cache when this environment's entry is there
    (computed and stored first otherwise)."""
    path = (cache_dir or _cache_dir()) / f"packages-distributions-{distributions_key()}.json"
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(path.read_text())
        if isinstance(cached, dict):
            return cached
    mapping = importlib.metadata.packages_distributions()
    with contextlib.suppress(OSError):  # a read-only home: computed each time, as transformers would
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".packages-distributions-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(mapping, f)
            os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the whole new one
        except OSError:
            os.unlink(tmp)
            raise
    return mapping


def import_transformers() -> ModuleType:
    """`import transformers`, with the distribution mapping from the cache (see the module's docstring)."""
    if "transformers.utils.import_utils" in sys.modules:
        return importlib.import_module("transformers")
    mapping = package_distributions()
    original = importlib.metadata.packages_distributions
    importlib.metadata.packages_distributions = lambda: {k: list(v) for k, v in mapping.items()}
    try:
        return importlib.import_module("transformers")
    finally:
        importlib.metadata.packages_distributions = original
