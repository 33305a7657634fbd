"""A virtual environment of its own for another RL stack's package, with gyre-tito installed from this checkout.

    python stack_venv.py NAME REQUIREMENT...   # prints the environment's python on stdout

SkyRL and verl pin what the workspace cannot share (SkyRL: transformers<=5.16.1; the workspace has a newer one), so
the tests of gyre-tito's adapters for them (tests/test_tito_stacks.py) run their real packages in an environment of
their own. It is made with uv (`uv venv`, `uv pip install`: the requirements and an editable gyre-tito, resolved
together) under `$GYRE_STACK_VENVS` (default `~/.cache/gyre/stack-venvs`), named by a hash of the requirements, this
checkout's gyre-tito (its path, since the install is editable, and its pyproject.toml) and the interpreter, and kept:
a later run with the same inputs reuses it at once, and the editable install means gyre-tito's current source is
what runs. Environments whose inputs changed are left for the user to delete (they hard-link uv's cache, so each
costs little disk). The interpreter is the one running this script (no Python download). A lock makes concurrent
test sessions wait for one build; a build that fails leaves no environment behind. uv is the one on PATH, else
pyenv's."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TITO = ROOT / "packages" / "gyre-tito"


def uv() -> str:
    found = shutil.which("uv") or "/root/.pyenv/versions/3.12.1/bin/uv"
    if not Path(found).exists():
        raise SystemExit("stack_venv: no uv on PATH (pip install uv)")
    return found


def ensure(name: str, requirements: list[str]) -> Path:
    base = Path(os.environ.get("GYRE_STACK_VENVS") or Path.home() / ".cache" / "gyre" / "stack-venvs")
    key = hashlib.sha256(
        "\n".join(
            [sys.executable, sys.version, str(TITO), *requirements, (TITO / "pyproject.toml").read_text()]
        ).encode()
    ).hexdigest()[:16]
    venv = base / f"{name}-{key}"
    python = venv / "bin" / "python"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building the same environment: wait for it
        if (venv / ".complete").exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)  # a build that died half-way
        start = time.monotonic()
        env = {**os.environ, "VIRTUAL_ENV": str(venv), "UV_PYTHON_DOWNLOADS": "never"}
        try:
            for cmd in (
                [uv(), "venv", "--quiet", "--python", sys.executable, str(venv)],
                [uv(), "pip", "install", "--quiet", *requirements, "--editable", str(TITO)],
            ):
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"stack_venv {name}: {' '.join(cmd[:3])} failed:\n{done.stderr[-3000:]}")
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        (venv / ".complete").write_text(f"{time.monotonic() - start:.1f}\n")
        print(f"stack_venv {name}: built {venv} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    return python


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    print(ensure(sys.argv[1], sys.argv[2:]))
