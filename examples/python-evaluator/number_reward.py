"""A Python evaluator: gyre-eval builds `NumberCloseness(**options)` from a task's scoring rule

    "scoring": {"kind": "python", "factory": "number_reward:NumberCloseness", "options": {"expected": 12}}

and calls `evaluate` once per execution (retrying on an exception, within the execution's budget). It reads only the
artifact, the agent's final reply in `answer.txt`: 1.0 for the expected number, less the further the reply's first
number is from it, 0.0 for a reply without a number. The workspace is the agent's: untrusted, read only, never
followed through a link, and never more than a few kilobytes of it.
"""

from __future__ import annotations

import os
import re
import stat

from gyre_eval import EvaluationRequest, Verdict

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
MAX_BYTES = 4096


def closeness(reply: str, expected: float) -> float:
    """The reward of `reply`: 1 - |x - expected| / max(1, |expected|), at least 0, for its first number x."""
    match = NUMBER.search(reply)
    if match is None:
        return 0.0
    error = abs(float(match[0]) - expected) / max(1.0, abs(expected))
    return round(max(0.0, 1.0 - error), 6)


def read_reply(path: os.PathLike) -> str:
    """The first MAX_BYTES of a regular file, without following a link or waiting on a FIFO; "" otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.pread(fd, MAX_BYTES, 0).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


class NumberCloseness:
    """The gyre-eval Evaluator protocol: `kind`, `describe`, `evaluate`, `aclose`."""

    kind = "number-closeness"

    def __init__(self, expected: float) -> None:
        self.expected = float(expected)

    def describe(self) -> dict:
        return {"evaluator": "number_reward.NumberCloseness", "expected": self.expected}

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        reply = read_reply(request.workspace / "answer.txt")
        score = closeness(reply, self.expected)
        return Verdict(
            score=score, critique=f"first number vs {self.expected:g}", details={"reply": reply[:80]}
        )

    async def aclose(self) -> None:
        return None
