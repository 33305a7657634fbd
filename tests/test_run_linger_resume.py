"""The end of a run as the operator sees it: a SIGINT while the dashboard lingers (`[dashboard] linger_s`) ends the
wait and the run's JSON summary is still printed (exit 0: the run was complete), and the progress of a resumed run
counts the whole run's steps (it counted only the resumed part's: 0/2, then 1/2 at its end).

One 1-step demo run and its resume to 2 steps, each stopped by SIGINT at the moment it reports its linger on stderr.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _until_linger(argv: list[str]) -> tuple[int, str, list[dict]]:
    """Run `argv` (JSON logs), SIGINT it when it says the dashboard stays up (the gate), and return its exit
    status, stdout and progress events."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events, said = [], []
    try:
        for line in proc.stderr:
            said.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "progress":
                events.append(event)
            if str(event.get("msg", "")).startswith("dashboard stays up"):
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode is not None, "".join(said)[-3000:]
    return proc.returncode, out, events + [json.loads(x) for x in err.splitlines() if '"progress"' in x]


def test_sigint_while_lingering_prints_the_summary_and_a_resume_counts_the_whole_run(tmp_path):
    run_dir = tmp_path / "run"
    first = _until_linger(
        [
            sys.executable,
            "-m",
            "gyre.cli",
            "demo",
            "--run-dir",
            str(run_dir),
            "--steps",
            "1",
            "--log-format",
            "json",
            "--set",
            "dashboard.linger_s=3600",
        ]
    )
    resumed = _until_linger(
        [
            sys.executable,
            "-m",
            "gyre.cli",
            "run",
            "--resume",
            str(run_dir),
            "--steps",
            "2",
            "--log-format",
            "json",
        ]
    )
    for code, out, _ in (first, resumed):  # each prints its summary as its last line and exits 0
        assert code == 0 and out.strip(), (code, out)
    assert json.loads(first[1].strip().splitlines()[-1])["steps"] == 1
    assert json.loads(resumed[1].strip().splitlines()[-1])["steps"] == 1  # the resumed part's own step
    progress = resumed[2]
    assert progress and {e["steps"] for e in progress} == {2}, progress
    # step 1 was done before the resume
    assert progress[0]["step"] >= 1 and progress[-1]["step"] == 2, progress
