"""The CLI: `check` runs one evaluator once; bad configs and paths are named, never a traceback."""

import json

from gyre_eval.cli import main


def _config(tmp_path, evaluators) -> str:
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"evaluators": evaluators}))
    return str(path)


def test_check_prints_the_verdict(tmp_path, workspace, capsys):
    cfg = _config(tmp_path, {"task": {"kind": "exec", "command": ["bash", "-c", "grep -q hello main.py"]}})
    assert main(["check", "--config", cfg, "--workspace", str(workspace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["status"], out["score"]) == ("valid", 1.0)


def test_check_reports_an_evaluator_failure_as_unresolved(tmp_path, workspace, capsys):
    cfg = _config(tmp_path, {"task": {"kind": "exec", "command": ["bash", "-c", "exit 9"]}})
    assert main(["check", "--config", cfg, "--workspace", str(workspace)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "unresolved" and "exited 9" in out["error"]


def test_bad_inputs_are_named(tmp_path, workspace, capsys):
    assert main(["check", "--config", str(tmp_path / "none.json"), "--workspace", str(workspace)]) == 2
    assert "not found" in capsys.readouterr().err
    bad = _config(tmp_path, {"task": {"kind": "exec"}})
    assert main(["check", "--config", bad, "--workspace", str(workspace)]) == 2
    err = capsys.readouterr().err
    assert "invalid config" in err and "command" in err
    cfg = _config(tmp_path, {"task": {"kind": "exec", "command": ["true"]}})
    assert main(["check", "--config", cfg, "--evaluator", "other", "--workspace", str(workspace)]) == 2
    assert "no evaluator 'other'" in capsys.readouterr().err
    assert main(["check", "--config", cfg, "--workspace", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    plugin = _config(tmp_path, {"task": {"kind": "plugin", "factory": "nowhere_xyz:Eval"}})
    assert main(["serve", "--store", str(tmp_path / "run"), "--port", "0", "--config", plugin]) == 2
    assert "cannot import nowhere_xyz" in capsys.readouterr().err
    with open(cfg) as not_a_socket:  # --listen-fd names an inherited bound socket; a file is refused
        fd = str(not_a_socket.fileno())
        assert main(["serve", "--store", str(tmp_path / "run"), "--port", "0", "--listen-fd", fd]) == 2
    assert capsys.readouterr().err == f"gyre-eval: --listen-fd {fd}: Socket operation on non-socket\n"


def test_written_config_masks_the_judge_key():
    from gyre_eval.config import ServiceConfig

    config = ServiceConfig.model_validate(
        {
            "evaluators": {
                "judge": {
                    "kind": "judge",
                    "base_url": "http://j/v1",
                    "model": "m",
                    "rubric": "r",
                    "api_key": "sk-judge-secret",
                }
            }
        }
    )
    written = json.dumps(config.redacted())
    assert "sk-judge-secret" not in written and '"model": "m"' in written
