"""The question-answer check: scores the agent's reply in answer.txt against the expected answer (argv[1]).

gyre-eval runs it in a private copy of the execution's workspace (the current directory) and reads the score it
writes to $GYRE_SCORE_FILE. Reward: 1.0 when the expected answer appears as a word of the reply; otherwise partial
credit, a quarter of the share of the expected answer's letters that the reply contains (a small model gets a signal
before it answers right). No reply scores 0.0: a valid zero, not a failure.
"""

import os
import re
import sys


def score(reply: str, expected: str) -> float:
    words = re.findall(r"[a-z0-9]+", reply.lower())
    expected = expected.lower()
    if expected in words:
        return 1.0
    letters = set(reply.lower())
    return round(0.25 * sum(c in letters for c in expected) / len(expected), 6)


if __name__ == "__main__":
    try:
        with open("answer.txt", encoding="utf-8", errors="replace") as f:
            reply = f.read()
    except FileNotFoundError:
        reply = ""
    with open(os.environ["GYRE_SCORE_FILE"], "w") as f:
        f.write(str(score(reply, sys.argv[1]) if reply.strip() else 0.0))
