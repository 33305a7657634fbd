"""Stream packing efficiency: non-pad token fraction of gyre-train's stream packing buffer on a long-tailed
(log-normal) trajectory length distribution, vs naive padding (rows in arrival order, fixed rows per micro-batch,
padded to the longest row of the batch) measured on the same rows in the same run.

    uv run python bench/train_packing.py [--quick]

Non-pad fraction of packing = real tokens / sum over micro-steps of dp_size * max(capacity, longest shard): every
rank's shard counted as padded to the capacity (or to an oversized row, which gets a shard of its own).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

from gyre_tito.types import Trajectory, WeightSpan
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.packing import PackingConfig, StreamPackingBuffer, padding_efficiency


def _trajectory(rng: random.Random, eid: str, gid: str, j: int, n: int) -> Trajectory:
    prompt = max(1, n // 5)
    return Trajectory(
        execution_id=eid,
        group_id=gid,
        index=j,
        leaf_call_id=f"{eid}-{j}",
        role_class="main/task",
        token_ids=[rng.randrange(512) for _ in range(n)],
        target_mask=[0] * prompt + [1] * (n - prompt),
        behavior_logprobs=[0.0] * prompt + [-1.0] * (n - prompt),
        weight_versions=[WeightSpan(start=prompt, end=n, engine_id="e", weight_version="0")],
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--capacity", type=int, default=4096, help="tokens per shard")
    ap.add_argument("--dp", type=int, default=2, help="shards per micro-step")
    args = ap.parse_args(argv)
    n, b, batches = (8, 8, 1) if args.quick else (16, 32, 2)
    rng = random.Random(0)
    median, sigma, cap_len = 600, 1.1, 32_768  # long tail: p99 ~ 7.7k tokens, a few rows above the capacity
    buffer = TrajectoryBuffer(n)
    lengths = []
    for g in range(b * batches):
        gid = f"g{g}"
        for i in range(n):
            eid = f"{gid}-{i}"
            trajs = []
            for j in range(rng.randint(1, 5)):
                length = min(cap_len, max(16, int(math.exp(rng.gauss(math.log(median), sigma)))))
                lengths.append(length)
                trajs.append(_trajectory(rng, eid, gid, j, length))
            buffer.add_execution(gid, 0, eid, rng.random(), trajs)
    cfg = PackingConfig(group_size=n, batch_groups=b, tokens_per_shard=args.capacity, dp_size=args.dp)
    packer = StreamPackingBuffer(cfg, buffer)
    microsteps = []
    t0 = time.perf_counter()
    for batch in range(batches):
        packer.open_batch(batch, 0)
        while not packer.closed:
            microsteps += packer.next_microsteps()
    pack_s = time.perf_counter() - t0
    eff = padding_efficiency(microsteps, args.capacity)
    # naive baseline: arrival order, a fixed number of rows per micro-batch chosen to hold ~capacity*dp tokens
    row_lens = [ln - 1 for ln in lengths]  # rows drop the last token in both cases
    per_batch = max(1, round(args.capacity * args.dp / (sum(row_lens) / len(row_lens))))
    padded = sum(
        max(row_lens[k : k + per_batch]) * len(row_lens[k : k + per_batch])
        for k in range(0, len(row_lens), per_batch)
    )
    naive = sum(row_lens) / padded
    out = {
        "bench": "train_packing",
        "non_pad_fraction": round(eff, 4),
        "baseline_non_pad_fraction": round(naive, 4),
        "ratio": round(eff / naive, 2),
        "target": 0.97,
        "rows": len(lengths),
        "tokens": sum(row_lens),
        "microsteps": len(microsteps),
        "capacity": args.capacity,
        "dp": args.dp,
        "p50_len": sorted(lengths)[len(lengths) // 2],
        "p99_len": sorted(lengths)[int(0.99 * len(lengths))],
        "max_len": max(lengths),
        "pack_s": round(pack_s, 2),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
