"""The CLI's door: `gyre --help`, `gyre --version` and `gyre config` answer without loading torch, and `gyre run` /
`gyre demo` refuse a model path they cannot load in one line before any process starts.

Each CLI call runs in a fresh interpreter: what a command imports is only visible in a process that has imported
nothing else (this one has torch from other test modules), and a broken check must not start a run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pytest

from gyre.config import ConfigError, RunConfig, check_model_path

HEAVY = ("torch", "transformers")


def _gyre(*args: str, cwd=None) -> subprocess.CompletedProcess:
    # The timeout only bounds a regression that would start a real run; nothing here measures time.
    return subprocess.run(
        [sys.executable, "-m", "gyre.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_help_and_config_do_not_import_torch():
    code = (
        "import contextlib, io, json, sys\n"
        "from gyre.cli import main\n"
        "config, help_text = io.StringIO(), io.StringIO()\n"
        "with contextlib.redirect_stdout(config):\n"
        "    rc = main(['config', '--json'])\n"
        "try:\n"
        "    with contextlib.redirect_stdout(help_text):\n"
        "        main(['--help'])\n"
        "except SystemExit as exc:\n"
        "    help_rc = exc.code\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps({'rc': rc, 'config': json.loads(config.getvalue()), 'help_rc': help_rc,\n"
        "                  'help': help_text.getvalue(), 'heavy': heavy}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["heavy"] == [], f"gyre config / gyre --help imported {out['heavy']}"
    # Both commands did their work: the resolved config (with the sections whose models moved) and the usage.
    assert out["rc"] == 0 and out["config"]["train"]["loss"]["weight_cap"] == 5.0
    assert (
        out["config"]["weights"]["mooncake"]["protocol"] == "tcp"
        and out["config"]["debug"]["stop_gate"] is None
    )
    assert out["help_rc"] == 0 and "usage: gyre" in out["help"] and "--version" in out["help"]


def test_version_prints_the_installed_distribution_version():
    proc = _gyre("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"gyre {version('gyre-rl')}\n"


@pytest.mark.parametrize(
    "command",
    [
        ["run", "{config}", "--run-dir", "{run_dir}"],
        ["demo", "--run-dir", "{run_dir}", "--set", "model.path=/nonexistent/model"],
    ],
    ids=["run", "demo"],
)
def test_a_missing_model_path_is_one_line_before_anything_starts(tmp_path, command):
    config = tmp_path / "bogus.toml"
    config.write_text('[model]\npath = "/nonexistent/model"\n')
    run_dir = tmp_path / "run"
    args = [a.format(config=config, run_dir=run_dir) for a in command]
    proc = _gyre(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "/nonexistent/model" in lines[0] and "no such folder" in lines[0], proc.stderr
    assert lines[0].startswith(f"gyre {command[0]}: ")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not run_dir.exists()  # refused before the run directory, let alone a process


def test_a_folder_that_is_not_a_checkpoint_is_refused_too(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    proc = _gyre("demo", "--run-dir", str(tmp_path / "run"), "--set", f"model.path={tmp_path / 'model'}")
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.count("\n") == 1 and "no tokenizer.json" in proc.stderr and str(tmp_path) in proc.stderr
    )
    assert not (tmp_path / "run").exists()


def test_the_model_path_check_accepts_a_checkpoint_folder_and_the_builtin_models(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    check_model_path(RunConfig.model_validate({"model": {"path": str(tmp_path)}}))
    check_model_path(RunConfig())  # unset: the demo policy is built on first use
    check_model_path(RunConfig.model_validate({"model": {"builtin": "long-context"}}))
    # On Ray with a placed proxy nothing on this machine reads the model: its path may be node-local.
    placed = {"launcher": {"kind": "ray", "proxy_resources": {}}, "model": {"path": "/nonexistent/model"}}
    check_model_path(RunConfig.model_validate(placed))
    with pytest.raises(ConfigError, match="/nonexistent/model"):
        check_model_path(RunConfig.model_validate({"model": {"path": "/nonexistent/model"}}))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not a folder"):
        check_model_path(RunConfig.model_validate({"model": {"path": str(tmp_path / "file")}}))


def test_the_light_modules_keep_every_name_where_it_was():
    # The config models moved to torch-free modules and the package roots load lazily; every old import still works
    # and gives the same object.
    import gyre_cell
    import gyre_cell.transfer
    from gyre_cell import client, stop_gate, types, worker_types
    from gyre_cell.transfer import WeightManifest, manifest, mooncake
    from gyre_train import loss, loss_config

    assert loss.LossConfig is loss_config.LossConfig
    assert worker_types.StopGate is stop_gate.StopGate
    assert (
        gyre_cell.TorchEngineClient is client.TorchEngineClient
        and gyre_cell.FinishReason is types.FinishReason
    )
    assert WeightManifest is manifest.WeightManifest
    assert gyre_cell.transfer.MooncakeConfig is mooncake.MooncakeConfig
    for package in (gyre_cell, gyre_cell.transfer):
        assert all(getattr(package, name) is not None for name in package.__all__)
        assert set(package.__all__) <= set(dir(package))
        with pytest.raises(AttributeError, match="no_such_name"):
            _ = package.no_such_name


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("train.lr=inf", "train.lr"),
        ("train.lr=nan", "train.lr"),
        ("agent.harness_timeout_s=inf", "harness_timeout_s"),
    ],
)
def test_an_infinite_setting_is_a_config_error(setting, needle, capsys):
    """`lr = inf` passed validation and failed late, inside the trainer."""
    from gyre.cli import main

    assert main(["config", "--set", setting]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_json_config_whose_top_level_is_a_list_is_one_line(tmp_path, capsys):
    from gyre.cli import main

    config = tmp_path / "run.json"
    config.write_text("[1, 2]")
    assert main(["config", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "top level must be an object" in err[0]
