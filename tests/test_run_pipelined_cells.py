"""`gyre run` with megatron cells of two pipeline stages (slow: one real 2-step run, K=2, PP=2 over gloo).

Each cell worker is its cell's stage 0 and starts its stage-1 process; the core's and the satellite's leaders claim
from the one shared queue and run their items through their cell's continuous 1F1B. The run's dumped batches
replay on the single-process float64 torch backend (loss and summed gradient), and every stage's pipeline counts
show one fill and one drain per batch the cell trained.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre_train.loss import LossConfig
from gyre_train.replay import load_dump, replay_batch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_gyre_run_with_two_stage_cells_matches_the_reference(tmp_path):
    run_dir = tmp_path / "run"
    sets = [
        "train.steps=2", "train.dump_batches=[0,1]",
        "train.hold_core_for_join=1", "train.checkpoint_keep=0",
    ]  # fmt: skip
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(ROOT / "configs" / "megatron-pp2.toml"),
        "--run-dir",
        str(run_dir),
    ]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = [json.loads(x) for x in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2]
    # Both stage processes of both cells existed: each wrote its counts with its own pid.
    pipeline = run_dir / "metrics" / "pipeline"
    stats = {
        (c, s): [json.loads(x) for x in (pipeline / f"cell-{c}-stage-{s}.jsonl").read_text().splitlines()]
        for c in range(2)
        for s in range(2)
        if (pipeline / f"cell-{c}-stage-{s}.jsonl").exists()
    }
    assert {(0, 0), (0, 1)} <= set(stats), sorted(stats)
    for c in {c for c, _ in stats}:
        lead, follower = stats[(c, 0)], stats[(c, 1)]
        assert lead[0]["pid"] != follower[0]["pid"]
        trained = [r for r in rows if r["microsteps_by_cell"].get(str(c), 0) > 0]
        assert len(lead) == len(follower) == len(trained)
        for a, b, r in zip(lead, follower, trained, strict=True):
            assert (a["fills"], a["drains"]) == (b["fills"], b["drains"]) == (1, 1)  # one each per batch
            assert a["microsteps"] == b["microsteps"] == r["microsteps_by_cell"][str(c)]
    # The stage processes ended with their workers.
    for rows_ in stats.values():
        status = Path(f"/proc/{rows_[0]['pid']}/status")
        assert not status.exists() or "zombie" in status.read_text(), status.read_text()
    # Each step equals the single-process float64 reference on the same batch.
    for step, row in enumerate(rows):
        dump = run_dir / "metrics" / "batches" / f"batch-{step}"
        loss, grads = replay_batch(dump, str(run_dir / "model"), dtype="float64", loss=LossConfig(),
                                   temperature=1.0)  # fmt: skip
        summed = load_dump(dump).summed_grads
        assert loss == pytest.approx(row["loss"], abs=1e-6)
        assert float(summed.abs().max()) > 1e-4
        assert torch.allclose(grads, summed.double(), atol=1e-6, rtol=0)
    # The published policy gathers both stages: every tensor of the HF model, loadable.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = run_dir / "checkpoints" / "policy-v2"
    names = set(load_file(str(final / "model.safetensors")))
    expected = {n for n, _ in AutoModelForCausalLM.from_pretrained(str(run_dir / "model")).named_parameters()}
    assert expected <= names
