"""Trajectory-tree build time and memory on a long Claude Code-like execution, against storing every call's context.

Workload (gyre_tito.testing.synthetic.long_session): 300 calls; main-agent contexts growing to ~128k tokens; two compactions
(three main epochs); three sub-agent conversations; ~19M lifecycle tokens (sum over calls of input + output, the
paper's way of counting) and ~0.6M distinct tokens.

- tree: for each call, what the proxy does: ``match(context)``, build the ``CallRecord`` with the incremental input,
  ``tree.add``. Timed without tracing; memory = bytes still allocated by the tree afterwards (tracemalloc).
- baseline (same run, same token representation ``array('i')``): store each call's full context + output + log-probs.

Also: p50 time to match the longest context in the full tree, in a one-node tree of the same length, and naively
against every stored context (the cost grows with the tree for the naive scan only).

Run: ``uv run python bench/tito_tree.py [--quick]``. The last line is one JSON object; ``ratio`` = baseline bytes /
tree bytes (target >= 20), ``build_s`` = tree build time (target < 1 s).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc
from array import array

from gyre_tito.testing.synthetic import LongSessionConfig, ScriptedCall, long_session, make_record
from gyre_tito.tree import ExecutionTree


def build_tree(script: list[ScriptedCall]) -> tuple[ExecutionTree, list[float]]:
    tree = ExecutionTree("bench")
    per_call: list[float] = []
    for i, call in enumerate(script):
        t0 = time.perf_counter()
        parent, matched = tree.match(call.context)
        record = make_record(
            execution_id="bench",
            call_id=f"c{i}",
            seq=i,
            parent_id=parent,
            input_ids=call.context[matched:].tolist(),
            output_ids=call.output.tolist(),
            role_class=call.role_class,
            agent_id=call.agent_id,
        )
        tree.add(record)
        per_call.append(time.perf_counter() - t0)
    return tree, per_call


def build_baseline(script: list[ScriptedCall]) -> list[tuple[array, array, array]]:
    stored = []
    for call in script:
        out = call.output.tolist()
        logprobs = array("d", [-((t % 97) + 1) / 100.0 for t in out])
        stored.append((array("i", call.context), array("i", call.output), logprobs))
    return stored


def _p50_ms(fn, repeat: int = 15) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def match_costs(tree: ExecutionTree, script: list[ScriptedCall]) -> tuple[float, float, float]:
    """p50 ms to match the longest context: in the full tree, in a tree holding only that path (same length, one
    node), and naively against every call's stored full context (cost ~ calls x context length)."""
    longest = max(range(len(script)), key=lambda i: len(script[i].context))
    probe = script[longest].context + script[longest].output + array("i", [7])
    full = _p50_ms(lambda: tree.match(probe))
    single = ExecutionTree("single")
    single.add(make_record(execution_id="single", call_id="all", input_ids=probe[:-1].tolist()))
    one = _p50_ms(lambda: single.match(probe))
    stored = [c.context + c.output for c in script]

    def naive():
        best = 0
        for s in stored:
            if len(s) <= len(probe) and len(s) > best and probe[: len(s)] == s:
                best = len(s)
        return best

    assert naive() == tree.match(probe)[1] == len(probe) - 1
    return full, one, _p50_ms(naive)


def traced_bytes(fn, *args):
    gc.collect()
    tracemalloc.start()
    result = fn(*args)
    gc.collect()
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, current


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workload (CI smoke run)")
    args = parser.parse_args(argv)
    config = (
        LongSessionConfig(
            calls=60, max_context=16_000, sub_calls=5, system_tokens=3_000, sub_system_tokens=2_000
        )
        if args.quick
        else LongSessionConfig()
    )
    script = long_session(config)
    lifecycle = sum(len(c.context) + len(c.output) for c in script)

    tree, per_call = build_tree(script)  # timed, untraced
    build_s = sum(per_call)
    t0 = time.perf_counter()
    build_baseline(script)
    baseline_build_s = time.perf_counter() - t0

    # Check the tree is right before reporting on it.
    unique = sum(len(n.tokens) for n in tree.nodes)
    last = script[-1]
    assert tree.path_tokens(f"c{len(script) - 1}") == last.context + last.output
    epochs = config.compactions + 1
    assert len(tree.children(None)) == epochs + config.subagents, tree.children(None)
    summaries = [n for n in tree.nodes if n.role_class == "main/summary"]
    assert len(summaries) == config.compactions and all(not n.children for n in summaries)

    match_ms, single_ms, naive_ms = match_costs(tree, script)
    del tree
    (_tree, _), tree_bytes = traced_bytes(build_tree, script)
    del _tree
    _baseline, baseline_bytes = traced_bytes(build_baseline, script)
    del _baseline

    result = {
        "bench": "tito_tree",
        "quick": args.quick,
        "calls": len(script),
        "max_context": max(len(c.context) for c in script),
        "lifecycle_tokens": lifecycle,
        "unique_tokens": unique,
        "tree_bytes": tree_bytes,
        "baseline_bytes": baseline_bytes,
        "ratio": round(baseline_bytes / tree_bytes, 1),
        "build_s": round(build_s, 4),
        "call_p50_ms": round(statistics.median(per_call) * 1e3, 3),
        "call_max_ms": round(max(per_call) * 1e3, 3),
        "baseline_build_s": round(baseline_build_s, 4),
        "match_longest_ms": round(match_ms, 3),
        "match_longest_single_path_ms": round(single_ms, 3),
        "naive_match_longest_ms": round(naive_ms, 3),
    }
    print(
        f"{len(script)} calls, lifecycle {lifecycle:,} tokens, {unique:,} distinct; "
        f"tree {tree_bytes / 2**20:.1f} MiB vs baseline {baseline_bytes / 2**20:.1f} MiB; build {build_s:.3f} s"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
