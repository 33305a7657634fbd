"""Paper preset (NL2RepoBench, 8 cells x 4 nodes, N=16, B=32) at E[d] = 1.0 and 1.5: Elastic's end-to-end speedup
over Async and Colocate after 48 steps, against the paper's 1.42-1.53x (Async) and 1.36-1.47x (Colocate); plus the
wall time of simulating 48 steps of the preset on one core (target < 30 s).

Async is reported twice: with the preset's split (2 training cells) and with the best split in 1..4 found in the same
run, because the paper does not say which split its Async baseline used and the answer depends on it.

    uv run python bench/sched_paper.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import time

from gyre_sched.presets import NL2REPO, compare_configs, deep_merge
from gyre_sched.sim import Simulator

PAPER = {"async": (1.42, 1.53), "colocate": (1.36, 1.47)}
ELASTIC_MU = {1.0: 2, 1.5: 3}  # Gyre at E[d]=1.5 uses mu=3, phi=0.5 (DESIGN §9); at 1.0 we use mu=2, phi=0.5


def run(target: float, steps: int, splits: list[int]) -> dict:
    raw = deep_merge(NL2REPO, {"steps": steps, "compare": {"staleness": target,
                                                           "mu": {"elastic": ELASTIC_MU[target], "async": 1}}})  # fmt: skip
    _, cfgs = compare_configs(raw)
    res = {k: Simulator(c).run() for k, c in cfgs.items()}
    el = res["elastic"]
    row = {
        "elastic_h": round(el.end_time_s / 3600, 2),
        "elastic_sim_wall_s": round(el.wall_s, 2),
        "async_h": round(res["async"].end_time_s / 3600, 2),
        "colocate_h": round(res["colocate"].end_time_s / 3600, 2),
        "speedup_vs_async": round(res["async"].end_time_s / el.end_time_s, 3),
        "speedup_vs_colocate": round(res["colocate"].end_time_s / el.end_time_s, 3),
        "staleness": {k: round(r.mean_staleness_steady, 3) for k, r in res.items()},
    }
    best = (cfgs["async"].policy.async_train_cells, res["async"].end_time_s)
    for a in splits:
        cfg = cfgs["async"].model_copy(deep=True)
        cfg.policy.async_train_cells = a
        t = Simulator(cfg).run().end_time_s
        if t < best[1]:
            best = (a, t)
    row["best_async_split"] = best[0]
    row["speedup_vs_best_async"] = round(best[1] / el.end_time_s, 3)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="12 steps, preset Async split only")
    args = ap.parse_args(argv)
    steps = 12 if args.quick else 48
    splits = [] if args.quick else [1, 3, 4]  # the preset's split (2) is the main Async run
    t0 = time.perf_counter()
    rows = {}
    for target in (1.0, 1.5):
        rows[target] = run(target, steps, splits)
        print(f"E[d]={target}: {json.dumps(rows[target])}", flush=True)
    out = {
        "bench": "sched_paper",
        "steps": steps,
        "speedup_vs_async_1.0": rows[1.0]["speedup_vs_async"],
        "speedup_vs_async_1.5": rows[1.5]["speedup_vs_async"],
        "speedup_vs_colocate_1.0": rows[1.0]["speedup_vs_colocate"],
        "speedup_vs_colocate_1.5": rows[1.5]["speedup_vs_colocate"],
        "speedup_vs_best_async_1.0": rows[1.0]["speedup_vs_best_async"],
        "speedup_vs_best_async_1.5": rows[1.5]["speedup_vs_best_async"],
        "paper_speedup_vs_async": list(PAPER["async"]),
        "paper_speedup_vs_colocate": list(PAPER["colocate"]),
        "sim_wall_s": rows[1.5]["elastic_sim_wall_s"],
        "sim_wall_limit_s": 30.0,
        "total_wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
