"""A command harness that plays a workload definition in a real run, so that a real run and the simulator run the same
workload (`WorkloadConfig`, seeded; `StatisticalWorkload` gives both their plans).

The harness reads which execution it is from its workspace's name (``g<group>.e<index>``, the execution id the
runner names it after) and plays that execution's plan:

- ``completed``: model calls through the proxy, each followed by a tool's latency (exponential, mean
  ``tool_latency_s``), until the plan's duration; then it writes ``answer.txt`` and exits 0;
- ``harness_timeout``: the same calls without end: the run's harness timeout (the task's, which must equal the
  workload's) kills it, and its preserved work is assessed;
- ``failed``: at the plan's ``failed_at_s`` its agent cannot be started (a wrapper's ``exec`` of a program that is not
  installed, exit 127): the run's no_work placeholder;
- a hang known by stalling (``stalled``): calls until its stall point, then silence; the run's stall watchdog
  (``[agent] stall_detect_s``, which must equal the workload's) ends it;
- a hang known at the budget (``overall_timeout``): silence from the start. In a real run the harness timeout ends it
  first (assessed, not excluded): the simulator lets it run to the overall budget, so a workload meant for both sets
  ``overall_timeout_rate = 0`` or ``exclusion_known = "stall"``.

Each call extends the conversation (the reply, then a short tool result), so an execution is one trajectory, until
`MAX_TURNS` turns: then it starts again from the task, as an agent that compacts does (a new branch of its tree). The
harness imports only the standard library and gyre-sched.

    python -m gyre_sched.workload_harness --workload WORKLOAD.json --seed S --task TEXT

(``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` set, as the runner sets them.) A run starts it as a script,
``python -I .../gyre_sched/workload_harness.py`` (`gyre.workload_tasks`): it prints a line before it imports
gyre-sched's policy and simulator (a second of CPU), so that a loaded machine's slow start-up is not a silence the
stall watchdog ends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre_sched.config import WorkloadConfig
    from gyre_sched.workload import ExecPlan

__all__ = ["execution_of", "load_workload", "main", "plan_of"]

MAX_TURNS = 16
"""Turns kept before the conversation starts again from the task (keeps a small model's context bounded)."""

NOT_INSTALLED = "gyre-workload-agent-that-is-not-installed"
"""What a planned complete failure tries to start (so the runner reports that the harness could not start)."""


def execution_of(name: str) -> tuple[int, int]:
    """(group sequence, dispatch index) from an execution id ``g<group>.e<index>``; ValueError otherwise."""
    group, sep, index = name.partition(".e")
    if not (sep and group.startswith("g") and group[1:].isdigit() and index.isdigit()):
        raise ValueError(f"{name!r} is not an execution id g<group>.e<index>")
    return int(group[1:]), int(index)


def load_workload(path: str | Path) -> WorkloadConfig:
    """A workload definition: a JSON object of `WorkloadConfig` fields."""
    from gyre_sched.config import WorkloadConfig  # here: the harness says it started before the heavy imports

    return WorkloadConfig.model_validate_json(Path(path).read_text())


def plan_of(workload: WorkloadConfig, seed: int, execution_id: str) -> ExecPlan:
    """The plan of one execution: the same one the simulator gives it for this workload and seed."""
    from gyre_sched.workload import StatisticalWorkload

    group, index = execution_of(execution_id)
    return StatisticalWorkload(workload, seed).plan(group, index)


class _Agent:
    """Model calls through the proxy's OpenAI-compatible endpoint, with a short context."""

    def __init__(self, task: str, max_tokens: int) -> None:
        self.url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
        self.headers = {
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        }
        self.task, self.max_tokens = task, max_tokens
        self.turns: list[dict[str, str]] = []
        self.calls = 0

    def call(self, timeout_s: float) -> str:
        if len(self.turns) >= 2 * MAX_TURNS:
            self.turns = []  # compaction: the next call starts a new branch
        messages = [{"role": "user", "content": self.task}, *self.turns]
        body = {"model": "gyre-policy", "messages": messages, "max_tokens": self.max_tokens}
        request = urllib.request.Request(self.url, json.dumps(body).encode(), self.headers, method="POST")
        with urllib.request.urlopen(request, timeout=max(timeout_s, 0.5)) as response:
            reply = json.loads(response.read())["choices"][0]["message"].get("content") or ""
        self.calls += 1
        self.turns += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"tool result {self.calls}"},
        ]
        print(f"call {self.calls}", flush=True)  # output: the stall watchdog sees a live execution
        return reply


def _work_until(agent: _Agent, rng: random.Random, tool_latency_s: float, until: float | None) -> str:
    """Calls and tool latencies until the monotonic time `until` (None: forever); the last reply."""
    reply = ""
    while until is None or time.monotonic() < until:
        left = None if until is None else until - time.monotonic()
        failed = False
        try:
            reply = agent.call(600.0 if left is None else left)
        except (TimeoutError, urllib.error.URLError) as e:  # a call cut at the plan's end, or a refused one
            print(f"call failed: {e}", flush=True)
            failed = True
        pause = rng.expovariate(1.0 / tool_latency_s) if tool_latency_s > 0 else 0.0
        pause = max(pause, 0.1) if failed else pause  # a call refused again and again is no busy loop
        if until is not None:
            pause = min(pause, max(0.0, until - time.monotonic()))
        time.sleep(pause)  # the tool's latency: this harness's work is wall time by design
    return reply


def _started() -> float:
    """This process's start on the monotonic clock (the plan's durations run from launch, not from after the
    imports, which take a second on a loaded machine)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # no procfs: from now
        return time.monotonic()
    return time.monotonic() - max(0.0, age)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gyre_sched.workload_harness", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, help="the workload definition (WorkloadConfig as JSON)")
    p.add_argument("--seed", type=int, required=True, help="the workload's seed (the simulator's)")
    p.add_argument("--task", required=True)
    args = p.parse_args(argv)
    start = _started()
    print("started", flush=True)  # output at once: the stall watchdog counts a silent start-up
    workload = load_workload(args.workload)
    execution_id = Path.cwd().name
    plan = plan_of(workload, args.seed, execution_id)
    group, index = execution_of(execution_id)
    rng = random.Random(f"{args.seed}/{group}/{index}")  # its tool latencies: the same on every replay
    agent = _Agent(args.task, workload.call_tokens)
    print(f"{execution_id}: {plan.outcome} after {plan.duration_s:.2f} s", flush=True)
    if plan.outcome == "failed":
        time.sleep(max(0.0, start + plan.duration_s - time.monotonic()))
        os.execv("/bin/sh", ["sh", "-c", f"exec {NOT_INSTALLED}"])
    if plan.outcome in ("stalled", "overall_timeout"):
        if plan.stall_at_s is not None:
            _work_until(agent, rng, workload.tool_latency_s, start + plan.stall_at_s)
        signal.pause()  # a hang: no call, no output
    until = None if plan.outcome == "harness_timeout" else start + plan.duration_s
    reply = _work_until(agent, rng, workload.tool_latency_s, until)
    Path("answer.txt").write_text(reply or "(no reply)", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
