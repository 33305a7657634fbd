"""A command harness for runs whose executions must keep calling the model: a fixed number of chat turns.

Each turn sends the whole conversation so far (the task, every reply, a fixed follow-up) to the proxy's
OpenAI-compatible endpoint, so every call extends the previous call's context: an execution moved between two of
its calls finds its context in the KV blocks that moved with it. The last reply is written to `answer.txt` (the
artifact the demo tasks score). Standard library only:

    python -I turns_harness.py --turns N --max-tokens M --task TEXT   (OPENAI_BASE_URL, OPENAI_API_KEY set)

`--hang-in NAME`: in the workspace named NAME the harness hangs instead (no call, no output after one line), the
case a stall watchdog must end. `--long-in PREFIX --long-turns N`: in workspaces whose name starts with PREFIX (a
group, `g3.`) the harness makes N turns instead, so that group is still running when the others are done.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--task", required=True)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--hang-in", default=None)
    p.add_argument("--long-in", default=None)
    p.add_argument("--long-turns", type=int, default=None)
    args = p.parse_args()
    workspace = os.path.basename(os.getcwd())
    turns = args.turns
    if args.long_in is not None and workspace.startswith(args.long_in):
        turns = args.long_turns
    if args.hang_in is not None and workspace == args.hang_in:
        print("hanging", flush=True)
        signal.pause()  # stuck for good: only the watchdog (or the harness timeout) ends it
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"}
    messages = [{"role": "user", "content": args.task}]
    reply = ""
    for _ in range(turns):
        body = {"model": "gyre-policy", "messages": messages, "max_tokens": args.max_tokens}
        request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
        with urllib.request.urlopen(request, timeout=300) as response:
            reply = json.loads(response.read())["choices"][0]["message"].get("content") or ""
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    with open("answer.txt", "w", encoding="utf-8") as out:
        out.write(reply)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
