"""Top-level test set-up: the pinned Claude Code CLI (package.json / package-lock.json) is installed with `npm ci` when a
selected test drives it and it is missing, so the README's test command works on a fresh machine. Without npm, or
if the install fails, those tests fail with one line saying how to install it."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLAUDE = ROOT / "node_modules" / ".bin" / "claude"
NEEDS_CLI = ("test_claude_code_", "test_harness_contract")


def pytest_collection_modifyitems(session, config, items):
    if CLAUDE.exists() or not (ROOT / "package.json").exists():
        return
    if not any(Path(str(item.fspath)).name.startswith(NEEDS_CLI) for item in items):
        return
    if shutil.which("npm") is None:
        print(
            "\nClaude Code CLI missing and npm not found: install Node.js + npm, then run `npm ci` at the repo root"
        )
        return
    proc = subprocess.run(
        ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"\n`npm ci` failed ({last}): the Claude Code tests need `npm ci` at the repo root")
