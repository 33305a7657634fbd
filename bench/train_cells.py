"""Multi-cell step time on CPU: the same batches trained by 1 cell vs 2 cells (core + a satellite process over gloo,
claiming micro-steps from the core's shared queue). Baseline = the 1-cell run, measured in the same invocation.

    uv run python bench/train_cells.py [--quick]

Each run takes ``steps`` steps in one burst (the satellite stays between steps: parameters are broadcast after each
non-final update); step 0 includes the satellite's start-up and join, so the reported time is the mean of the later
steps. Each cell process uses one torch thread. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

from gyre_train.localrun import LocalRunSpec, launch
from gyre_train.testing.synthetic import build_tiny_model


def _run(model: str, out: Path, cells: int, steps: int, quick: bool) -> dict:
    spec = LocalRunSpec(
        model_path=model,
        out_dir=str(out),
        num_cells=cells,
        steps=steps,
        steps_per_burst=steps,
        dtype="float32",
        group_size=8,
        batch_groups=4 if quick else 8,
        tokens_per_shard=512,
        max_len=400,
    )
    codes = launch(spec, timeout=900)
    if codes != [0] * cells:
        raise SystemExit(f"cell processes exited with {codes}")
    reports = [json.loads(line) for line in (out / "reports.jsonl").read_text().splitlines()]
    later = reports[1:]
    by_cell: dict[str, int] = {}
    for r in later:
        for k, v in r["microsteps_by_cell"].items():
            by_cell[k] = by_cell.get(k, 0) + v
    return {
        "step_s": sum(r["seconds"] for r in later) / len(later),
        "by_cell": by_cell,
        "loss": [r["loss"] for r in reports],
    }


def _matmuls(n: int, barrier=None, times=None) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    if barrier is not None:
        barrier.wait()  # both processes start computing together, after their imports
    t0 = time.time()
    for _ in range(n):
        a = torch.tanh(a @ a)
    if times is not None:
        times.put((t0, time.time()))


def _cpu_parallel_ratio(n: int = 1500) -> float:
    """How much faster two processes do 2n matmuls than one process, on this machine right now (ideal: 2.0)."""
    t0 = time.perf_counter()
    _matmuls(2 * n)
    one = time.perf_counter() - t0
    ctx = mp.get_context("spawn")
    barrier, times = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_matmuls, args=(n, barrier, times)) for _ in range(2)]
    for p in procs:
        p.start()
    spans = [times.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return one / (max(e for _, e in spans) - min(s for s, _ in spans))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps = 2 if args.quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", hidden=128, layers=4)
        one = _run(model, Path(tmp) / "one", 1, steps, args.quick)
        two = _run(model, Path(tmp) / "two", 2, steps, args.quick)
    parallel = _cpu_parallel_ratio()
    same = all(abs(a - b) < 1e-4 * max(1.0, abs(a)) for a, b in zip(one["loss"], two["loss"], strict=True))
    out = {
        "bench": "train_cells",
        "step_s_2cells": round(two["step_s"], 3),
        "baseline_step_s_1cell": round(one["step_s"], 3),
        "ratio": round(one["step_s"] / two["step_s"], 2),
        "microsteps_by_cell_2cells": two["by_cell"],
        "same_losses": same,
        "steps_timed": steps - 1,
        # pure-compute 2-process speedup measured in the same run (includes process start-up): the ceiling here
        "cpu_parallel_ratio": round(parallel, 2),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
