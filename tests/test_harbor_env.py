"""Harbor's own CLI on Gyre's sandbox (gyre.harbor_env.GyreEnvironment), against the real harbor package (0.25.0) in an
environment of its own (tests/stack_venv.py; Harbor brings litellm and its own pins): one `harbor run` job on the
shipped suite with Harbor's oracle agent (reward 1.0 each) and its nop agent (the starts: 0, 0.75, 0), each scored by
Harbor's own verifier through the environment's exec and downloads; and the environment keeps one sandbox per trial
(a background process outlives the exec that started it and dies at stop), writes only its bound paths and never
follows a link out of the sandbox."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(shutil.which(t) is None for t in ("bwrap", "nsenter", "setpriv")),
        reason="needs bubblewrap, util-linux",
    ),
]


@pytest.fixture(scope="module")
def harbor_python() -> Path:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "stack_venv.py"), "harbor", "harbor==0.25.0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


def _env() -> dict[str, str]:
    # gyre.harbor_env from this checkout; litellm's bundled cost map (no fetch: no network here or in CI)
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def test_harbor_run_scores_the_suite_on_the_gyre_sandbox(harbor_python, tmp_path):
    before = set(Path(tempfile.gettempdir()).glob("gyre-harbor-*"))
    job = {
        "environment": {"import_path": "gyre.harbor_env:GyreEnvironment"},
        "datasets": [{"path": str(ROOT / "tasks" / "harbor")}],
        "agents": [{"name": "oracle"}, {"name": "nop"}],
        "jobs_dir": str(tmp_path / "jobs"),
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    argv = [str(harbor_python.parent / "harbor"), "run", "-c", str(tmp_path / "job.json"), "-y", "-q"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    trials = [json.loads(p.read_text()) for p in (tmp_path / "jobs").glob("*/*/result.json")]
    assert all(t["exception_info"] is None for t in trials) and len(trials) == 6
    rewards = {
        (t["agent_info"]["name"], t["task_name"]): t["verifier_result"]["rewards"]["reward"] for t in trials
    }
    # Harbor's own verifier, through the environment's exec and downloads: the reference solutions, and the starts
    assert rewards == {
        ("oracle", "count-words"): 1.0,
        ("oracle", "fix-clamp"): 1.0,
        ("oracle", "multiply"): 1.0,
        ("nop", "count-words"): 0.0,
        ("nop", "fix-clamp"): 0.75,
        ("nop", "multiply"): 0.0,
    }
    # each trial's folder went at its stop
    assert set(Path(tempfile.gettempdir()).glob("gyre-harbor-*")) <= before


PROBE = r"""
import asyncio, json, os, sys, tempfile
from pathlib import Path
from harbor.models.task.task import Task
from harbor.models.trial.paths import TrialPaths
from gyre.harbor_env import GyreEnvironment

async def main():
    task = Task(Path(sys.argv[1]))
    paths = TrialPaths(Path(tempfile.mkdtemp()))
    paths.mkdir()
    env = GyreEnvironment(environment_dir=task.paths.environment_dir, environment_name="fix-clamp", session_id="s",
                          trial_paths=paths, task_env_config=task.config.environment)
    await env.start(force_build=False)
    out = {}
    bg = await env.exec("nohup sleep 300 > /dev/null 2>&1 & echo $!")
    out["alive_next_exec"] = (await env.exec(f"kill -0 {bg.stdout.strip()} && echo yes")).stdout.strip()
    out["whoami"] = (await env.exec("id -u; pwd; ls", user="root")).stdout.split()
    out["network"] = (await env.exec("cat /proc/net/dev | grep -c :")).stdout.strip()
    await env.exec("ln -s /etc/hostname /logs/verifier/reward.txt; echo 1 > /logs/verifier/real.txt")
    dest = Path(tempfile.mkdtemp())
    await env.download_dir("/logs/verifier", dest)
    out["downloaded"] = sorted(p.name for p in dest.iterdir())
    try:
        await env.upload_file(sys.argv[1] + "/task.toml", "/etc/task.toml")
        out["upload_outside"] = "written"
    except ValueError as e:
        out["upload_outside"] = "refused"
    root = env._root
    def cmdline(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # a process of the machine that just ended
            return b""
    sleepers = lambda: [p for p in os.listdir("/proc") if p.isdigit() and cmdline(p) == b"sleep\x00300\x00"]
    out["sleepers_before_stop"] = len(sleepers())
    await env.stop(delete=True)
    out["sleepers_after_stop"] = len(sleepers())
    out["folder_removed"] = not root.exists()
    print(json.dumps(out))

asyncio.run(main())
"""


def test_one_sandbox_per_trial_that_exec_enters(harbor_python, tmp_path):
    done = subprocess.run(
        [str(harbor_python), "-c", PROBE, str(ROOT / "tasks" / "harbor" / "fix-clamp")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["alive_next_exec"] == "yes"  # Terminus-2's tmux server lives on between commands
    uid = "65534" if os.geteuid() == 0 else str(os.geteuid())
    assert out["whoami"] == [
        uid,
        "/app",
        "clamp.py",
    ]  # the Dockerfile's COPY line, in the workdir; never root
    assert out["network"] == "1"  # the loopback only
    assert out["downloaded"] == ["real.txt"]  # the link to a host file is not followed out of the sandbox
    assert out["upload_outside"] == "refused"
    assert out["sleepers_before_stop"] >= 1 and out["sleepers_after_stop"] == 0 and out["folder_removed"]
