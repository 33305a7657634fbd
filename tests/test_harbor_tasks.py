"""Harbor task folders as Gyre tasks (gyre.harbor_tasks) and their verifier as a gyre-eval check (gyre.harbor_verify):
the loader and its refusals, the reward file read as untrusted data, and the shipped suite's verifiers run for real
(bubblewrap, gyre-eval's exec check) on the starting workspaces and on the reference solutions."""

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from gyre.datasets import task_queries, validate_main
from gyre.harbor_tasks import HarborTaskError, load_harbor_task, load_harbor_tasks, verifier_config
from gyre.harbor_verify import MAX_REWARD_BYTES, NoReward, read_reward
from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest
from gyre_eval.exec_check import ExecCheckConfig, ExecutableCheck

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tasks" / "harbor"
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None or (os.geteuid() == 0 and shutil.which("setpriv") is None),
    reason="Harbor verifiers run under bubblewrap (and setpriv, run by root)",
)


def _task(
    tmp_path: Path, toml: str = "", test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", **files: str
):
    task = tmp_path / "t1"
    (task / "tests").mkdir(parents=True)
    (task / "task.toml").write_text(toml)
    (task / "instruction.md").write_text("Do the thing.\n")
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    for name, text in files.items():
        path = task / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return task


def _score(task, workspace: Path) -> float:
    check = ExecutableCheck(ExecCheckConfig.model_validate(verifier_config(task)))
    request = EvaluationRequest("e1", workspace, "v1", "main", time.time() + 120)
    return asyncio.run(check.evaluate(request)).score


# ---- the loader ---------------------------------------------------------------------------------------------------


def test_the_shipped_suite_loads_as_harbor_writes_it():
    tasks = load_harbor_tasks(SUITE)
    assert [t.query_id for t in tasks] == ["count-words", "fix-clamp", "multiply"]
    assert all(t.workdir == "/app" and t.tests == SUITE / t.query_id / "tests" for t in tasks)
    assert tasks[0].prompt == (SUITE / "count-words" / "instruction.md").read_text().strip()
    assert [t.verifier_timeout_s for t in tasks] == [60.0, 60.0, 30.0]  # task.toml's [verifier] timeout_sec
    queries = task_queries(SUITE, limit=2)  # what `gyre run` takes from [tasks] file
    assert [q.query_id for q in queries] == ["count-words", "fix-clamp"]
    assert queries[1].launch_options()["harness_timeout_s"] == 600.0  # [agent] timeout_sec


def test_the_dockerfiles_copy_lines_make_the_initial_workspace_inside_it(tmp_path):
    ws = tmp_path / "ws"
    load_harbor_task(SUITE / "fix-clamp").setup(ws)  # COPY clamp.py /app/
    assert sorted(p.name for p in ws.iterdir()) == ["clamp.py"]
    task = _task(
        tmp_path,
        **{
            "environment__Dockerfile": "FROM debian:12\nWORKDIR /app\nCOPY data /app/in/\n",
            "environment__data__x.txt": "x",
        },
    )
    load_harbor_task(task).setup(tmp_path / "ws2")
    assert (tmp_path / "ws2" / "in" / "x.txt").read_text() == "x"


@pytest.mark.parametrize(
    ("toml", "files", "says"),
    [
        ("[verifier\ntimeout_sec = 1", {}, "not valid TOML"),
        ('[verifier]\ntimeout_sec = "soon"', {}, "verifier.timeout_sec"),
        ('[environment]\ndocker_image = "ghcr.io/x/y:1"', {}, "needs a container runtime with its image"),
        ("", {"environment__Dockerfile": "FROM ubuntu:24.04\nRUN apt-get install -y jq\n"}, "RUN apt-get"),
        (
            "",
            {"environment__Dockerfile": "FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\n"},
            "FROM ghcr",
        ),
        ("", {"environment__docker-compose.yaml": "services: {}\n"}, "docker-compose.yaml"),
        (
            "",
            {"environment__Dockerfile": "FROM python:3.12\nCOPY ../secret /app/\n"},
            "not a file of environment/",
        ),
        ('[environment]\nworkdir = "/usr/lib"', {}, "workdir '/usr/lib'"),
        ('[[steps]]\nname = "one"', {}, "multi-step"),
    ],
)
def test_a_task_gyre_cannot_run_is_refused_with_one_line(tmp_path, toml, files, says):
    task = _task(tmp_path, toml, **files)
    with pytest.raises(HarborTaskError) as err:
        load_harbor_task(task)
    assert says in str(err.value) and "\n" not in str(err.value) and str(task) in str(err.value)


def test_gyre_tasks_validate_names_the_refused_task(tmp_path, capsys):
    _task(tmp_path, '[environment]\ndocker_image = "ubuntu:24.04"')
    assert validate_main(str(tmp_path)) == 1
    line = capsys.readouterr().err.strip()
    assert "t1: needs a container runtime with its image" in line and "\n" not in line
    assert validate_main(str(SUITE)) == 0
    assert "3 Harbor tasks OK" in capsys.readouterr().out


def test_a_task_without_its_verifier_is_refused(tmp_path):
    task = _task(tmp_path)
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(HarborTaskError, match=r"tests/test\.sh is missing"):
        load_harbor_task(task)


# ---- the reward file, untrusted -----------------------------------------------------------------------------------


def _logs(tmp_path: Path, **files: str | bytes) -> str:
    (tmp_path / "logs" / "verifier").mkdir(parents=True)
    for name, data in files.items():
        path = tmp_path / "logs" / "verifier" / name.replace("_", ".")
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(tmp_path / "logs")


@pytest.mark.parametrize(
    ("files", "reward"),
    [
        ({"reward_txt": "0.5\n"}, 0.5),
        ({"reward_json": '{"reward": 1}'}, 1.0),
        ({"reward_json": '{"tests_passed": 0.25}'}, 0.25),
        ({"reward_json": "0", "reward_txt": "1"}, 0.0),  # reward.json first, as Harbor reads them
    ],
)
def test_a_reward_file_is_read_strictly(tmp_path, files, reward):
    assert read_reward(_logs(tmp_path, **files)) == reward


@pytest.mark.parametrize(
    "files",
    [
        {},
        {"reward_txt": ""},
        {"reward_txt": "ok"},
        {"reward_txt": "nan"},
        {"reward_txt": "inf"},
        {"reward_json": "true"},
        {"reward_json": '{"a": 1, "b": 0}'},
        {"reward_json": '{"reward": "1"}'},
        {"reward_json": "1e999"},
        {"reward_txt": "1" + " " * MAX_REWARD_BYTES},
    ],
)
def test_a_missing_or_garbled_reward_is_no_score(tmp_path, files):
    with pytest.raises(NoReward):
        read_reward(_logs(tmp_path, **files))


def test_a_reward_file_is_never_read_through_a_link_nor_from_a_fifo(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("1\n")
    logs = _logs(tmp_path)
    (Path(logs) / "verifier" / "reward.txt").symlink_to(secret)
    with pytest.raises(NoReward, match="link"):
        read_reward(logs)
    (Path(logs) / "verifier" / "reward.txt").unlink()
    os.mkfifo(Path(logs) / "verifier" / "reward.txt")  # a FIFO would block a plain read: refused at once
    with pytest.raises(NoReward, match="regular file"):
        read_reward(logs)
    shutil.rmtree(Path(logs) / "verifier")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "reward.txt").write_text("1\n")
    (Path(logs) / "verifier").symlink_to(tmp_path / "elsewhere")  # the folder swapped for a link
    with pytest.raises(NoReward):
        read_reward(logs)


# ---- the verifier, run for real -----------------------------------------------------------------------------------


def _solve(task, workspace: Path) -> None:
    """Harbor's oracle step, without /app on the host: the shipped solve.sh scripts name /app only as a path."""
    script = (task.path / "solution" / "solve.sh").read_text().replace("/app", str(workspace))
    subprocess.run(["bash", "-c", script], check=True)


@needs_bwrap
def test_the_suites_verifiers_score_the_start_below_the_reference_solution(tmp_path):
    scores = {}
    for task in load_harbor_tasks(SUITE):
        ws = tmp_path / task.query_id
        task.setup(ws)
        start = _score(task, ws)
        _solve(task, ws)
        scores[task.query_id] = (start, _score(task, ws))
    assert scores == {"count-words": (0.0, 1.0), "fix-clamp": (0.75, 1.0), "multiply": (0.0, 1.0)}


@needs_bwrap
def test_the_verifier_sees_app_tests_and_logs_where_harbor_puts_them(tmp_path):
    probe = (
        'cd /app && test -w . && test ! -w /tests/test.sh && test ! -e /etc/shadow && test "$PWD" = /app '
        '&& [ "$(cat note.txt)" = hi ] && echo 1 > /logs/verifier/reward.txt\n'
    )
    task = load_harbor_task(_task(tmp_path, test_sh=probe))
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "note.txt").write_text("hi")
    assert _score(task, tmp_path / "ws") == 1.0


@needs_bwrap
@pytest.mark.parametrize(
    "test_sh",
    [
        "exit 0\n",  # no reward file
        "echo maybe > /logs/verifier/reward.txt\n",
        "ln -s /etc/hostname /logs/verifier/reward.txt\n",
        f"head -c {MAX_REWARD_BYTES * 4} /dev/zero | tr '\\0' 1 > /logs/verifier/reward.txt\n",
    ],
)
def test_a_verifier_that_leaves_no_usable_reward_gives_no_score_never_a_zero(tmp_path, test_sh):
    task = load_harbor_task(_task(tmp_path, test_sh=test_sh))
    (tmp_path / "ws").mkdir()
    with pytest.raises(EvaluatorError, match="exited 3"):
        _score(task, tmp_path / "ws")


def test_the_check_has_no_fail_code(tmp_path):
    """Any exit but the reward's 0 is a failed attempt (a crash of the script must never read as a zero)."""
    config = verifier_config(load_harbor_task(_task(tmp_path)))
    assert config["fail_codes"] == [] and json.loads(config["command"][-1])["workdir"] == "/app"
