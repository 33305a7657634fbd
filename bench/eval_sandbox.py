"""Cost of gyre-eval's sandbox per executable check, against a bare subprocess measured in the same run.

Runs `true` on a small workspace (20 files) N times: (1) a bare asyncio subprocess (baseline), (2) the sandbox without
namespace isolation (private copy, process group, rlimits), (3) the sandbox with isolation when the platform allows it.
The last line is one JSON object: p50 of the isolated sandbox vs the bare subprocess.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from gyre_eval.sandbox import Sandbox, SandboxConfig


async def _bare(workspace: Path) -> None:
    proc = await asyncio.create_subprocess_exec("true", cwd=workspace)
    await proc.wait()


async def _measure(fn, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - t0) * 1000)
    return times


async def main(runs: int) -> dict:
    workspace = Path(tempfile.mkdtemp(prefix="gyre-bench-ws-"))
    for i in range(20):
        (workspace / f"f{i}.py").write_text("x = 1\n" * 200)
    plain = Sandbox(SandboxConfig(isolation="off"))
    isolated = Sandbox(SandboxConfig(isolation="auto"))
    isolation = isolated.isolated()
    bare = await _measure(lambda: _bare(workspace), runs)
    off = await _measure(lambda: plain.run(["true"], workspace), runs)
    iso = await _measure(lambda: isolated.run(["true"], workspace), runs)
    p50 = statistics.median
    print(f"bare subprocess      p50 {p50(bare):7.2f} ms")
    print(f"sandbox, no isolation p50 {p50(off):7.2f} ms")
    print(f"sandbox, isolation={isolation} p50 {p50(iso):7.2f} ms")
    return {
        "bench": "eval_sandbox",
        "runs": runs,
        "isolation": isolation,
        "p50_ms": round(p50(iso), 2),
        "no_isolation_p50_ms": round(p50(off), 2),
        "baseline_p50_ms": round(p50(bare), 2),
        "ratio": round(p50(iso) / p50(bare), 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="10 runs instead of 50")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(10 if args.quick else 50))))
