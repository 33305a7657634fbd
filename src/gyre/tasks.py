"""The demo's task set: toy queries with a verifiable scoring rule, run by gyre-eval's executable check.

Each query asks the agent for text with a property that can be checked from the artifact alone (the workspace's
answer.txt). The score is the fraction of the answer's characters that are the query's target letter: it varies
between samples of even a random tiny model, so GRPO advantages are non-zero and GSPO has something to learn, and it
never depends on elapsed time, trajectory length or termination status.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Query", "demo_queries", "scoring_command"]

# Runs inside the evaluator's sandbox, in a private copy of the workspace; writes the score to $GYRE_SCORE_FILE.
_SCORER = """
import os, sys
letter = sys.argv[1]
try:
    text = open('answer.txt', encoding='utf-8', errors='replace').read()
except FileNotFoundError:
    text = ''
score = text.count(letter) / len(text) if text else 0.0
open(os.environ['GYRE_SCORE_FILE'], 'w').write(repr(score))
"""


@dataclass(frozen=True, slots=True)
class Query:
    query_id: str
    prompt: str
    letter: str


def demo_queries() -> list[Query]:
    letters = "etaoinsr"
    return [
        Query(f"letter-{c}", f"Write a short answer that uses the letter '{c}' as often as you can.", c)
        for c in letters
    ]


def scoring_command(query: Query) -> list[str]:
    # The sandbox drops root checks to an unprivileged uid, which cannot read a Python under /root (pyenv):
    # prefer the system interpreter; the scorer needs only the standard library.
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    return [python, "-I", "-c", _SCORER, query.letter]
