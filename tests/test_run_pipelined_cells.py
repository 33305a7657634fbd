"""`gyre run` with megatron cells of two TP ranks x two pipeline stages (slow: one real 2-step run, K=2, 8 processes
over gloo).

Each cell worker is its cell's rank 0 (TP rank 0 of stage 0) and starts its three other ranks; the core's and the
satellite's leaders claim from the one shared queue and run their items through their cell's continuous 1F1B, each
stage's TP ranks sharding heads, FFN and vocab. The run's dumped batches replay on the single-process float64 torch
backend (loss and summed gradient), and every rank's pipeline counts show one fill and one drain per batch the cell
trained.
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


def test_gyre_run_with_tp2_pp2_cells_matches_the_reference(tmp_path):
    run_dir = tmp_path / "run"
    sets = [
        "train.steps=2",
        "debug.dump_batches=[0,1]",
        "debug.hold_core_for_join=1",
        "train.checkpoint_keep=0",
        "train.tensor_parallel=2",
    ]
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
    # Every rank of both cells existed: each wrote its counts, megatron's TP rank and its own pid.
    pipeline = run_dir / "metrics" / "pipeline"
    ranks = [(s, t) for s in range(2) for t in range(2)]
    stats = {
        c: {
            r: [
                json.loads(x)
                for x in (pipeline / f"cell-{c}-stage-{r[0]}-tp-{r[1]}.jsonl").read_text().splitlines()
            ]
            for r in ranks
        }
        for c in range(2)
        if (pipeline / f"cell-{c}-stage-0-tp-0.jsonl").exists()
    }
    assert 0 in stats, sorted(pipeline.iterdir())
    for c, by_rank in stats.items():
        assert len({rows_[0]["pid"] for rows_ in by_rank.values()}) == 4
        assert all(rows_[0]["tp"] == t and rows_[0]["stage"] == s for (s, t), rows_ in by_rank.items())
        trained = [r for r in rows if r["microsteps_by_cell"].get(str(c), 0) > 0]
        for rank_rows in by_rank.values():
            assert len(rank_rows) == len(trained)
            for a, r in zip(rank_rows, trained, strict=True):
                assert (a["fills"], a["drains"]) == (1, 1)  # one each per batch
                assert a["microsteps"] == r["microsteps_by_cell"][str(c)]
    # The rank processes ended with their workers.
    for rows_ in (rows_ for by_rank in stats.values() for rows_ in by_rank.values()):
        status = Path(f"/proc/{rows_[0]['pid']}/status")
        assert not status.exists() or "zombie" in status.read_text(), status.read_text()
    # Each step equals the single-process float64 reference on the same batch.
    for step, row in enumerate(rows):
        dump = run_dir / "metrics" / "batches" / f"batch-{step}"
        loss, grads = replay_batch(
            dump, str(run_dir / "model"), dtype="float64", loss=LossConfig(), temperature=1.0
        )
        summed = load_dump(dump).summed_grads
        assert loss == pytest.approx(row["loss"], abs=1e-6)
        assert float(summed.abs().max()) > 1e-4
        assert torch.allclose(grads, summed.double(), atol=1e-6, rtol=0)
    # The published policy gathers both stages and both TP halves: every tensor of the HF model, loadable.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = run_dir / "checkpoints" / "policy-v2"
    names = set(load_file(str(final / "model.safetensors")))
    expected = {n for n, _ in AutoModelForCausalLM.from_pretrained(str(run_dir / "model")).named_parameters()}
    assert expected <= names
