"""The SWE suite's executable check (gyre-eval `exec`, `score_from = "score_file"`); standard library only.

Runs in the evaluator's sandbox with a private copy of the workspace as its working directory:
``python3 -I check.py CHECK_FILES`` (``CHECK_FILES`` = the task's ``checks/<name>`` folder, outside the workspace).

1. Tampering scores 0: a test the repository ships (``CHECK_FILES/protected/...``) changed or removed, or a file in
   the workspace where the hidden tests go (``_hidden_tests/``).
2. Otherwise the hidden tests (``CHECK_FILES/test_hidden.py``) are copied to ``_hidden_tests/`` and run with
   ``unittest`` in a child interpreter (60 s); the score is the fraction of them that pass (a crash or a hang: 0).

The score goes to ``$GYRE_SCORE_FILE`` (outside the copy: the artifact cannot plant its own score).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HIDDEN_DIR = "_hidden_tests"

# The child: import the hidden tests with the workspace on sys.path, run them, print one JSON line at the end.
CHILD = r"""
import json, sys, unittest
sys.path[:0] = [sys.argv[1], sys.argv[2]]
suite = unittest.defaultTestLoader.loadTestsFromName("test_hidden")
result = unittest.TestResult()
suite.run(result)
bad = len(result.failures) + len(result.errors) + len(result.skipped) + len(result.unexpectedSuccesses)
sys.stdout.write("\n" + sys.argv[3] + json.dumps({"total": result.testsRun, "failed": bad}) + "\n")
"""


def tampered(files: Path, work: Path) -> str | None:
    protected = files / "protected"
    for src in sorted(p for p in protected.rglob("*") if p.is_file()):
        rel = src.relative_to(protected)
        dst = work / rel
        if not dst.is_file() or dst.read_bytes() != src.read_bytes():
            return f"{rel} was changed or removed"
    if (work / HIDDEN_DIR).exists():
        return f"{HIDDEN_DIR}/ exists in the workspace"
    return None


def score(files: Path, work: Path) -> tuple[float, str]:
    why = tampered(files, work)
    if why is not None:
        return 0.0, f"tampering: {why}"
    hidden = work / HIDDEN_DIR
    hidden.mkdir()
    shutil.copy(files / "test_hidden.py", hidden / "test_hidden.py")
    marker = "GYRE-SWE-RESULT:" + os.urandom(8).hex() + ":"
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-c", CHILD, str(work), str(hidden), marker],
            cwd=work, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return 0.0, "the hidden tests did not finish in 60 s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        return 0.0, f"the hidden tests did not run (exit {proc.returncode}): {proc.stderr[-300:]}"
    res = json.loads(lines[-1][len(marker) :])
    if res["total"] == 0:
        return 0.0, "no hidden test ran"
    return (res["total"] - res["failed"]) / res[
        "total"
    ], f"{res['total'] - res['failed']}/{res['total']} passed"


def main() -> int:
    files = Path(sys.argv[1]).resolve()
    value, why = score(files, Path.cwd())
    print(why)
    Path(os.environ["GYRE_SCORE_FILE"]).write_text(repr(value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
