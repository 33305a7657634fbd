"""A command harness that plays one of the paper's tails by its place in the group (the `.e<k>` of its workspace's
name, which is the execution id), so that every group of a run holds all of them, whichever groups a step trains:

- e0 answers "unscorable": its evaluator (`tails_evaluators.TailsEvaluator`) fails on every attempt, so the
  execution is excluded when its overall budget runs out;
- e1 answers "mint", starts a child process (its pid in `child.pid`) and makes a model call the engines never answer
  (its prompt holds the `--stall` marker, which the run's script holds): the harness timeout ends it and its process tree, and
  its preserved answer is assessed;
- e2 cannot start its agent: a wrapper shell's `exec` of a program that is not installed (exit 127), the paper's
  complete failure with no assessable work;
- every other index (the group's spares) answers "mint" after one model call and exits.

Standard library only: `python -I tails_harness.py --task TEXT --stall MARKER` (OPENAI_BASE_URL, OPENAI_API_KEY set).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import urllib.request


def _call_model(task: str) -> str:
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"}
    body = {"model": "gyre-policy", "messages": [{"role": "user", "content": task}], "max_tokens": 8}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["message"].get("content") or ""


def _answer(text: str) -> None:
    with open("answer.txt", "w", encoding="utf-8") as out:
        out.write(text)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--task", required=True)
    p.add_argument(
        "--stall", required=True, help="e1 puts this in its prompt: the run's engines never answer it"
    )
    args = p.parse_args()
    index = int(os.path.basename(os.getcwd()).rpartition(".e")[2])
    if index == 0:
        _answer("unscorable")
        return 0
    if index == 2:
        os.execv("/bin/sh", ["sh", "-c", "exec gyre-tails-agent-that-is-not-installed"])
    _answer("mint")  # before the call: the preserved work does not depend on how fast the engine is
    if index == 1:
        child = subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL)
        with open("child.pid", "w", encoding="utf-8") as out:
            out.write(str(child.pid))
        _call_model(f"{args.task} {args.stall}")  # never answered: only the harness timeout ends it
        signal.pause()
    _call_model(args.task)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
