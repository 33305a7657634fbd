"""`gyre run` where Mooncake cannot load: weights and snapshots go over HTTP from the core, and the run says so.

The library is hidden from the run for real: the run starts in its own mount namespace in which `/dev/null` is
bind-mounted over every `libibverbs.so.1` the loader could find (so `import mooncake.engine` fails there, which the
test asserts first), while the rest of the machine is untouched. The same run with the library, where it is
installed (`.ci/run` installs it), uses Mooncake. The satellite's part of a batch it joined mid-way is compared with
the single-cell reference of that batch: it trained on exactly the weights the core published.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre_cell.transfer.choice import mooncake_problem
from gyre_sched.trace import iter_trace
from gyre_train.loss import LossConfig
from gyre_train.replay import replay_batch

ROOT = Path(__file__).resolve().parents[1]
PROBE = [sys.executable, "-c", "import mooncake.engine"]

pytestmark = pytest.mark.slow


def _libibverbs() -> list[str]:
    """Every libibverbs.so.1 the dynamic loader could open: the cache's and those on LD_LIBRARY_PATH."""
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    found = [line.split("=>")[-1].strip() for line in out.splitlines() if "libibverbs.so.1 " in line]
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        if (Path(folder) / "libibverbs.so.1").exists():
            found.append(str(Path(folder) / "libibverbs.so.1"))
    return sorted(set(found))


def _hidden(argv: list[str]) -> list[str]:
    """`argv` in a new mount namespace where each libibverbs.so.1 reads as an empty file."""
    paths = _libibverbs()
    script = 'n=$1; shift; while [ "$n" -gt 0 ]; do mount --bind /dev/null "$1" || exit 97; shift; n=$((n-1)); done; exec "$@"'
    return [
        "unshare",
        "--mount",
        "--map-root-user",
        "--",
        "sh",
        "-c",
        script,
        "sh",
        str(len(paths)),
        *paths,
        *argv,
    ]


def _run(run_dir: Path, hide: bool) -> tuple[subprocess.CompletedProcess, dict]:
    """Two elastic cells, one step per burst (the satellite goes back to rollout after each step and loads the
    published weights); the satellite joins the first batch mid-way (the core holds its second micro-step for it)."""
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(ROOT / "configs" / "elastic-k3.toml"),
        "--run-dir",
        str(run_dir),
        "--steps",
        "2",
        "--set",
        "cluster.cells=2",
        "--set",
        "scheduler.mu=1",
        "--set",
        "train.dtype=float64",
        "--set",
        "debug.dump_batches=[0,1]",
        "--set",
        "debug.hold_core_for_join=1",
    ]
    proc = subprocess.run(
        _hidden(argv) if hide else argv, capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def _check_hidden() -> None:
    probe = subprocess.run(_hidden(PROBE), capture_output=True, text=True, check=False)
    if "unshare" in probe.stderr and "Operation not permitted" in probe.stderr:
        pytest.skip(f"no mount namespace here: {probe.stderr.strip()}")
    assert probe.returncode != 0 and "libibverbs.so.1" in probe.stderr, probe.stderr[-2000:]


@pytest.mark.parametrize("hide", [True, False], ids=["no-libibverbs", "with-libibverbs"])
def test_a_run_publishes_over_http_where_mooncake_cannot_load(tmp_path: Path, hide: bool) -> None:
    if hide:
        _check_hidden()
    elif (problem := mooncake_problem()) is not None:
        pytest.skip(f"Mooncake does not load on this machine ({problem}); .ci/run installs libibverbs1")
    expected = "http" if hide else "mooncake"
    run_dir = tmp_path / "run"
    proc, summary = _run(run_dir, hide)

    # One line at start says so, with what to install; the summary and config.json name the transport used.
    notes = [line for line in proc.stderr.splitlines() if "Mooncake cannot load" in line]
    assert len(notes) == (1 if hide else 0), proc.stderr[-3000:]
    if hide:
        assert "apt-get install libibverbs1" in notes[0] and "over HTTP" in notes[0]
    assert summary["transport"] == {"weights": expected, "snapshot": expected}
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["weights"]["transport"], config["weights"]["snapshot"]) == (expected, expected)
    publishes = [json.loads(x) for x in (run_dir / "metrics" / "publish.jsonl").read_text().splitlines()]
    assert [p["version"] for p in publishes] == [1, 2] and {p["transport"] for p in publishes} == {expected}
    # After step 1 the satellite is back in rollout and pulls version 1 from the core (the worker refuses a pull
    # whose version is not the published one, which would fail the run).
    assert publishes[0]["engines"] == 1 and len(publishes[0]["load_s"]) == 1, publishes

    # The satellite joined a batch mid-way: its micro-steps were computed on the snapshot it pulled, so the batch's
    # loss and summed gradient equal the single-cell reference only if it pulled exactly the core's weights.
    claims = [x for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] == "microstep_claim"]
    joined = sorted({c["batch"] for c in claims if c["cell"] == 1})
    assert joined, claims
    rows = [json.loads(x) for x in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    for batch in joined:
        dump = run_dir / "metrics" / "batches" / f"batch-{batch}"
        loss, grads = replay_batch(
            dump, str(run_dir / "model"), dtype="float64", loss=LossConfig(), temperature=1.0
        )
        assert loss == pytest.approx(rows[batch]["loss"], abs=1e-6)
        assert torch.allclose(grads, torch.load(dump / "summed_grads.pt"), atol=1e-6, rtol=0)


def test_mooncake_asked_for_by_name_where_it_cannot_load_is_one_line(tmp_path: Path) -> None:
    _check_hidden()
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(ROOT / "configs" / "elastic-k3.toml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        "weights.transport=mooncake",
    ]
    proc = subprocess.run(_hidden(argv), capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert (
        "Mooncake is asked for but cannot load here" in lines[0] and "apt-get install libibverbs1" in lines[0]
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written or started
