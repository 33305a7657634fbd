"""An entry for the zygote tests' children (`zygote_probe:run`): reports what the child sees, then exits or holds.

args: [REPORT_PATH, MODE, ...extra]; MODE "exit" returns 7, "hold" writes its report and waits for a signal. A secret
arrives as `--token FD` at the end of args.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def run(args: list[str]) -> int:
    report, mode = args[0], args[1]
    token = None
    if "--token" in args:
        with os.fdopen(int(args[args.index("--token") + 1]), "rb") as f:
            token = f.read().decode().strip()
    info = {
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "ppid": os.getppid(),
        "args": args,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "token": token,
        "cmdline": Path("/proc/self/cmdline").read_bytes().decode(errors="replace"),
        "proc_environ": Path("/proc/self/environ").read_bytes().decode(errors="replace"),
        "preloaded": "colorsys" in sys.modules,  # the tests preload it; nothing else here imports it
        "stdin": sys.stdin.read(),
    }
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    with open(report + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(report + ".tmp", report)
    if mode == "hold":
        while True:
            signal.pause()
    return 7
