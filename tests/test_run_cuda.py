"""`gyre run` with `[cluster] device = "cuda"`: each cell's torch engine and trainer on the GPUs the launcher gives it.

On a machine without CUDA the run must refuse in one line naming the cell, not fall back to the CPU; the `gpu` test
runs the default demo's two cells sharing one GPU (`launcher.gpus_per_cell = 0.5`) for a burst.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre_sched.trace import iter_trace

ROOT = Path(__file__).resolve().parents[1]


def _demo(run_dir: Path, *sets: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "demo",
        "--run-dir",
        str(run_dir),
        "--quiet",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "cluster.device=cuda",
    ]
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_run_without_gpus_ends_with_one_line_naming_the_cell(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = _demo(tmp_path / "run", "train.steps=1", "launcher.gpus_per_cell=1", env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("gyre demo:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.search(
        r"cell-([01]): .*exited during start-up \(its log ends: gyre-cell worker: cell \1: device cuda, but this "
        r"process sees no CUDA device \(CUDA_VISIBLE_DEVICES=\1\)\); see .*logs/cell-\1\.log",
        lines[0],
    ), lines[0]
    assert not (tmp_path / "run" / "metrics" / "steps.jsonl").exists()  # nothing ran on the CPU instead


@pytest.mark.gpu
def test_the_demo_trains_and_serves_on_cuda_two_cells_sharing_one_gpu(tmp_path):
    run_dir = tmp_path / "run"
    done = _demo(
        run_dir,
        "train.steps=2",
        "launcher.gpus_per_cell=0.5",
        "debug.hold_core_for_join=1",
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["steps"] == 2
    for cell in (0, 1):  # what each worker actually built on, logged when it became ready
        log = (run_dir / "logs" / f"cell-{cell}.log").read_text()
        assert f"cell {cell}: ready; rollout on cuda, training on cuda (CUDA_VISIBLE_DEVICES=0)" in log, log[
            -2000:
        ]
    steps = [json.loads(ln) for ln in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps), steps
    # The satellite trained too: its gradients crossed to the core over gloo, from CUDA through host memory.
    assert any(sum(n > 0 for n in s["microsteps_by_cell"].values()) >= 2 for s in steps), steps
    claims = {x["cell"] for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] == "microstep_claim"}
    assert claims == {0, 1}, claims
