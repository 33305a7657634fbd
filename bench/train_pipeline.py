"""Pipelined cell step time on CPU (PP=2 over gloo): one continuous 1F1B per batch vs one megatron schedule call
per micro-step, at 4, 8 and 16 micro-steps per batch. Baseline = the per-micro-step runs, measured in the same
invocation, interleaved with the continuous runs (ABAB) on the same batches.

    uv run python bench/train_pipeline.py [--quick]

Two stage processes (torchrun, one torch thread each) hold a 4-layer tiny Qwen3 (hidden 128) split 2+2 over
megatron's pipeline; every batch's micro-steps (~256 tokens each, proximal ratios so every item is a train item)
are in the queue when the batch starts. Step time = accumulation wall time of one batch (the part the schedule
changes; the optimizer step is the same in both). Also reported: fills and drains per batch (continuous: 1 and 1;
per micro-step: one each per micro-step), and the ratio per_microstep_s / continuous_s (> 1: continuous is faster).
On a 2-core machine shared with other work the two stages compete for the cores: the same run measures how much
faster two processes do independent matmuls than one (``two_process_ceiling``, ideal 2.0), the ceiling of any
two-stage overlap here. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = (4, 8, 16)


def _worker(model: str, out: str, sizes: list[int], reps: int) -> None:
    import torch
    import torch.distributed as dist

    from gyre_train.buffer import TrajectoryBuffer
    from gyre_train.loss import LossConfig
    from gyre_train.megatron import MegatronBackend, MegatronBackendConfig, ParallelConfig
    from gyre_train.megatron.pipeline import ControlChannel, QueueSource, StreamingPipeline
    from gyre_train.packing import PackingConfig, StreamPackingBuffer
    from gyre_train.queue import MicroStepQueue
    from gyre_train.testing.synthetic import make_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loss = LossConfig(ratio_reference="proximal")  # no pre-pass: every item is a train item
    pool = []
    buf = TrajectoryBuffer(8)
    for gid, v, ex in make_groups(12, 8, seed=11, max_len=200):
        for eid, r, trajs in ex:
            buf.add_execution(gid, v, eid, r, trajs)
    packer = StreamPackingBuffer(
        PackingConfig(group_size=8, batch_groups=12, tokens_per_shard=256, window_shards=4, temperature=1.0),
        buf,
    )
    packer.open_batch(0, 0)
    while not packer.closed and len(pool) < max(sizes):
        pool += packer.next_microsteps(max_microsteps=64)
    if len(pool) < max(sizes):
        raise SystemExit(f"only {len(pool)} micro-steps in the pool")
    backend = MegatronBackend(
        MegatronBackendConfig(model_path=model, parallel=ParallelConfig(pipeline_parallel=2), optimizer=False)
    )
    channel = ControlChannel.create()
    pipes = {m: StreamingPipeline(backend, channel, loss, mode=m) for m in ("continuous", "per_microstep")}
    results: list[dict] = []
    batch = 0
    for size in sizes:
        for rep in range(reps + 1):  # rep 0 warms up
            for mode in ("continuous", "per_microstep") if rep % 2 else ("per_microstep", "continuous"):
                backend.zero_grad()
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    q = MicroStepQueue(prepass=False)
                    q.open(batch)
                    source = QueueSource(q)
                    for k, ms in enumerate(pool[:size]):
                        source.put(ms.model_copy(update={"batch": batch, "index": k}))
                    source.close()
                    stats = pipes[mode].run_batch(source)
                else:
                    stats = pipes[mode].follow_batch()
                dist.barrier()
                seconds = time.perf_counter() - t0
                batch += 1
                if rank == 0 and rep > 0:
                    results.append(
                        {
                            "size": size,
                            "mode": mode,
                            "seconds": seconds,
                            "fills": stats.fills,
                            "drains": stats.drains,
                            "microsteps": stats.microsteps,
                        }
                    )
    if rank == 0:
        tokens = [sum(len(s.input_ids) for s in ms.shards) for ms in pool[: max(sizes)]]
        Path(out).write_text(json.dumps({"runs": results, "tokens_per_microstep": statistics.mean(tokens)}))
    backend.close()
    dist.destroy_process_group()


def _matmuls(n: int, barrier=None, times=None) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    if barrier is not None:
        barrier.wait()
    t0 = time.time()
    for _ in range(n):
        a = torch.tanh(a @ a)
    if times is not None:
        times.put((t0, time.time()))


def _cpu_parallel_ratio(n: int = 1500) -> float:
    """How much faster two processes do 2n matmuls than one process, on this machine right now (ideal: 2.0): the
    ceiling of any two-stage overlap here."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    _matmuls(2 * n)
    one = time.perf_counter() - t0
    ctx = mp.get_context("spawn")
    barrier, times = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_matmuls, args=(n, barrier, times)) for _ in range(2)]
    for p in procs:
        p.start()
    spans = [times.get() for _ in procs]
    for p in procs:
        p.join()
    return one / (max(e for _, e in spans) - min(s for s, _ in spans))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker:
        _worker(*args.worker, sizes, args.reps)
        return
    from gyre_train.testing.synthetic import build_tiny_model

    reps = args.reps or (2 if args.quick else 4)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", hidden=128, layers=4)
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            __file__,
            "--worker",
            model,
            str(out),
            "--sizes",
            ",".join(map(str, sizes)),
            "--reps",
            str(reps),
        ]
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _, err = proc.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit("the stage processes did not finish in 1800 s") from None
        if proc.returncode != 0:
            raise SystemExit(f"stage processes failed:\n{err[-4000:]}")
        data = json.loads(out.read_text())
    ceiling = _cpu_parallel_ratio(600 if args.quick else 1500)
    by: dict[tuple[int, str], list[dict]] = {}
    for r in data["runs"]:
        by.setdefault((r["size"], r["mode"]), []).append(r)
    summary = {}
    for size in sizes:
        cont, per = by[(size, "continuous")], by[(size, "per_microstep")]
        c_s = statistics.median(r["seconds"] for r in cont)
        p_s = statistics.median(r["seconds"] for r in per)
        summary[str(size)] = {
            "continuous_s": round(c_s, 4),
            "per_microstep_s": round(p_s, 4),
            "ratio": round(p_s / c_s, 3),
            "fills_per_batch": {"continuous": cont[0]["fills"], "per_microstep": per[0]["fills"]},
            "drains_per_batch": {"continuous": cont[0]["drains"], "per_microstep": per[0]["drains"]},
        }
        print(
            f"{size:>3} micro-steps: continuous {c_s:.3f} s (fills {cont[0]['fills']}, drains {cont[0]['drains']}),"
            f" per micro-step {p_s:.3f} s (fills {per[0]['fills']}, drains {per[0]['drains']}): x{p_s / c_s:.2f}",
            file=sys.stderr,
        )
    print(f"two-process ceiling on this machine now: x{ceiling:.2f}", file=sys.stderr)
    print(
        json.dumps(
            {
                "bench": "train_pipeline",
                "pp": 2,
                "device": "cpu/gloo",
                "reps": reps,
                "tokens_per_microstep": round(data["tokens_per_microstep"], 1),
                "sizes": summary,
                "ratio": {k: v["ratio"] for k, v in summary.items()},
                "two_process_ceiling": round(ceiling, 2),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
