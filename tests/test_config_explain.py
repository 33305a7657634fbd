"""`gyre config` explains itself: each value with where it came from (default, file, --set), and with `--explain`
each field's description above it, from the config models' own field descriptions. Real CLI processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from gyre.config import RunConfig
from gyre.config_view import field_rows

LINE = re.compile(r"^(\w+) = (.*?)\s+# (default|file|--set)$")


def _gyre_config(*args: str) -> list[str]:
    # The timeout only bounds a hang; nothing here measures time.
    proc = subprocess.run(
        [sys.executable, "-m", "gyre.cli", "config", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _values(lines: list[str]) -> dict[str, tuple[str, str]]:
    """dotted key -> (value as printed, source), read back from the sections and value lines."""
    out, section = {}, ""
    for line in lines:
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1] + "."
        elif m := LINE.match(line):
            out[section + m[1]] = (m[2], m[3])
    return out


def test_config_shows_where_each_value_came_from(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        '[train]\nsteps = 3\nlr = 0.002\n\n[launcher]\nkind = "ray"\nproxy_resources = {CPU = 1}\n'
        "[train.loss]\nweight_cap = 4.0\n"
    )
    lines = _gyre_config("--config", str(config), "--set", "scheduler.N=2", "--set", "train.lr=0.005")
    values = _values(lines)
    assert values["train.steps"] == ("3", "file")
    assert values["train.lr"] == ("0.005", "--set")  # the --set wins over the file's value
    assert values["scheduler.N"] == ("2", "--set")
    assert values["train.loss.weight_cap"] == ("4.0", "file")
    assert values["launcher.proxy_resources"] == ('{"CPU": 1.0}', "file")  # a table value set in the file
    assert values["train.loss.eps_low"] == ("0.005", "default")
    assert values["scheduler.B"] == ("4", "default")  # the demo preset, not gyre-sched's own default
    assert values["model.path"] == ("null", "default")
    # Every field of the config is printed once, with its source.
    leaves = [".".join(r.path) for r in field_rows(RunConfig()) if not r.section]
    assert sorted(values) == sorted(leaves)
    assert {s for _, s in values.values()} == {"default", "file", "--set"}
    # --json is the resolved config alone, as before.
    data = json.loads("\n".join(_gyre_config("--config", str(config), "--json")))
    assert data["train"]["steps"] == 3 and data["launcher"]["proxy_resources"] == {"CPU": 1}


def test_explain_prints_every_fields_description_above_it():
    lines = _gyre_config("--explain")
    described, comment = {}, []
    section = ""
    for line in lines[1:]:  # the first line says what the sources mean
        if line.startswith("# "):
            comment.append(line[2:])
            continue
        if line.startswith("["):
            section = line[1:-1] + "."
        elif m := LINE.match(line):
            described[section + m[1]] = " ".join(comment)
        comment = []
    assert described, lines[:5]
    # Every value has a description (none was left without one), and it is the model's own text.
    assert [k for k, d in described.items() if not d] == []
    assert described["train.steps"].startswith("Optimizer steps to run")
    assert described["scheduler.N"] == "Valid rewards per group."  # gyre-sched's PolicyConfig
    assert described["train.loss.eps_low"].startswith("Lower clip bound")  # gyre-train's loss dataclass
    assert described["weights.mooncake.protocol"].startswith("Transport: TCP")  # gyre-cell's Mooncake model
    assert described["assessment.check_sandbox.timeout_s"].startswith("Wall-clock limit")  # gyre-eval
    assert described["judge.max_tokens"] == "max_tokens of each judge call."
    # A section's description is the comment above its header.
    header = lines.index("[train.loss]")
    assert lines[header - 1].startswith("# The GSPO objective")
    # The descriptions are the pydantic field descriptions of the run's own sections.
    assert RunConfig.model_fields["train"].description.startswith("The optimizer")


def test_the_explained_config_loads_no_torch():
    # `gyre config` stays fast: the text view and the descriptions come without torch (tests/test_cli_door.py).
    code = (
        "import contextlib, io, sys\n"
        "from gyre.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    rc = main(['config', '--explain'])\n"
        "print(rc, [m for m in ('torch', 'transformers') if m in sys.modules], '[train.loss]' in out.getvalue())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split("\n")[0] == "0 [] True", proc.stderr
