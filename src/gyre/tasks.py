"""The demo's task family: follow links between workspace files with tools; a graded, verifiable reward.

A query's workspace holds five small files (``a.txt`` ... ``e.txt``): a few filler lines, then, in all files but
one, a ``next: "X.txt"`` line, and last a ``code: WORD`` line (five different words out of 16). The prompt names
where to start: "Start at c.txt, follow each next link and reply with the last code." From the start file the links
form a chain of two or three files, the last of which has no link; the files off the chain link to each other, so
a wrong turn never reaches an end. The demo policy is pre-trained on chains of two and three; the demo run's queries
are chains of three (four model calls to solve one), where it starts weaker and RL has more to gain.

Nothing in the prompt tells the codes or the links: the agent has to read the start file, read the file each link
names, and answer with the code of the file without a link, i.e. three or four model calls per execution. A code
or a link can be copied from the end of the latest tool result, which a small model learns quickly.

Reward (graded): among the codes the answer names, the best earns 1 if it is the last file's code and a quarter as
much for each link left unfollowed (the code of the file one link before the end earns 1/4, two links before 1/16); any
other code earns 0. The best credit is divided by the number of different codes named, so listing every code scores
low; words that are not codes do not count ("The code is pink." names one). The score is
computed by gyre-eval's executable check from the artifact alone (`answer.txt`, the agent's final reply; see
`scoring_command`); it never depends on elapsed time, trajectory length or termination status.

Everything is seeded: `demo_queries(seed)` returns the same queries on every machine, and `random_query(rng)` is
what the demo policy's synthetic pre-training transcripts are drawn from (same family, independent draws).
"""

from __future__ import annotations

import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CODE_WORDS",
    "FILE_NAMES",
    "Query",
    "demo_queries",
    "random_query",
    "score_answer",
    "scoring_command",
]

CODE_WORDS: tuple[str, ...] = (
    "red",
    "blue",
    "green",
    "gold",
    "pink",
    "gray",
    "lime",
    "teal",
    "rose",
    "jade",
    "navy",
    "plum",
    "sand",
    "snow",
    "mint",
    "ruby",
)
"""The codes a file can hold (a guess is right 1 time in 16)."""
FILE_NAMES: tuple[str, ...] = ("a.txt", "b.txt", "c.txt", "d.txt", "e.txt")
"""Every workspace holds these files."""
_FILLER_KEYS = ("size", "day", "row")


@dataclass(frozen=True, slots=True)
class Query:
    """One task instance: prompt, initial workspace and scoring rule (the chain's codes)."""

    query_id: str
    prompt: str
    files: tuple[tuple[str, str], ...]
    """(name, content) of every file in the initial workspace."""
    chain: tuple[str, ...]
    """The files from the start file to the one without a link."""
    codes: tuple[str, ...]
    """The code of each file of the chain, in order: the last one is the answer."""

    def setup(self, workspace: Path) -> None:
        """Write the initial workspace (before the harness starts)."""
        workspace.mkdir(parents=True, exist_ok=True)
        for name, content in self.files:
            (workspace / name).write_text(content)

    def launch_options(self) -> dict:
        """Keyword arguments for `gyre_sched.runner.ExecutionRunner.run`: the workspace is filled before launch."""
        return {"setup": self.setup}

    def field(self, name: str, key: str) -> str | None:
        """The value of `key:` in file `name` (None: no such line)."""
        for line in dict(self.files)[name].splitlines():
            if line.startswith(f"{key}: "):
                return line.split(": ", 1)[1].strip('"')
        return None


def random_query(
    rng: random.Random, query_id: str = "chain", chain_lengths: tuple[int, ...] = (2, 3)
) -> Query:
    """One query of the family, drawn with `rng`; its chain has one of `chain_lengths` files (2 or 3)."""
    if not chain_lengths or not set(chain_lengths) <= {2, 3}:
        raise ValueError(
            f"chain_lengths must be 2s and 3s (five files leave an off-chain loop), got {chain_lengths}"
        )
    chain = tuple(rng.sample(FILE_NAMES, rng.choice(chain_lengths)))
    codes = dict(zip(FILE_NAMES, rng.sample(CODE_WORDS, len(FILE_NAMES)), strict=True))
    off_chain = [f for f in FILE_NAMES if f not in chain]
    files = []
    for name in FILE_NAMES:
        lines = [f"{key}: {rng.randint(1, 99)}" for key in rng.sample(_FILLER_KEYS, rng.randint(0, 2))]
        if name in chain[:-1]:
            lines.append(f'next: "{chain[chain.index(name) + 1]}"')
        elif name != chain[-1]:  # off the chain: a link to another file off the chain (a loop without an end)
            lines.append(f'next: "{rng.choice([f for f in off_chain if f != name])}"')
        lines.append(f"code: {codes[name]}")
        files.append((name, "\n".join(lines) + "\n"))
    prompt = f'Start at "{chain[0]}", follow each next link and reply with the last code.'
    return Query(query_id, prompt, tuple(files), chain, tuple(codes[name] for name in chain))


def demo_queries(seed: int = 0, count: int = 256, chain_lengths: tuple[int, ...] = (3,)) -> list[Query]:
    """The run's queries (groups take them in order): `count` independent draws seeded by `seed`, chains of three."""
    rng = random.Random(f"gyre-demo-queries-{seed}")
    return [random_query(rng, f"chain-{seed}-{i:03d}", chain_lengths) for i in range(count)]


def score_answer(answer: str, codes: tuple[str, ...] | list[str]) -> float:
    """Best credit among the codes the answer names (1 for the last, quartered per link before it) / how many
    different codes it names; 0 when it names none. Other words do not count ("The code is pink." names one)."""
    named = {w for w in re.findall(r"[a-z]+", answer.lower()) if w in CODE_WORDS}
    if not named or not codes:
        return 0.0
    credit = {code: 0.25 ** (len(codes) - 1 - j) for j, code in enumerate(codes)}
    return max(credit.get(w, 0.0) for w in named) / len(named)


# Runs inside the evaluator's sandbox, in a private copy of the workspace; writes the score to $GYRE_SCORE_FILE.
# The same rule as score_answer (standard library only: it runs under the system interpreter).
_SCORER = """
import os, re, sys
codes = sys.argv[1:]
CODE_WORDS = CODE_WORDS_HERE
try:
    text = open('answer.txt', encoding='utf-8', errors='replace').read()
except FileNotFoundError:
    text = ''
named = {w for w in re.findall(r'[a-z]+', text.lower()) if w in CODE_WORDS}
credit = {code: 0.25 ** (len(codes) - 1 - j) for j, code in enumerate(codes)}
score = max(credit.get(w, 0.0) for w in named) / len(named) if named and codes else 0.0
open(os.environ['GYRE_SCORE_FILE'], 'w').write(repr(score))
"""


def scoring_command(query: Query) -> list[str]:
    # The sandbox drops root checks to an unprivileged uid, which cannot read a Python under /root (pyenv):
    # prefer the system interpreter; the scorer needs only the standard library.
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    return [python, "-I", "-c", _SCORER.replace("CODE_WORDS_HERE", repr(CODE_WORDS)), *query.codes]
