"""A harness that probes its sandbox (run as `python -c <this file's text> PATHS_JSON`: the file itself is not visible
inside the sandbox). It tries to read each of PATHS_JSON's "read" files, list the host's home, the run's workspaces and each
"list" folder, connect to each "connect" address, make one model call through the proxy (ANTHROPIC_BASE_URL) and spawn 64 processes;
it writes what happened to probe.json in its workspace. Used by tests/test_harness_sandbox.py and test_sandbox_run.py.
"""

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

paths = json.loads(sys.argv[1])
out = {"uid": os.getuid(), "env": sorted(os.environ), "home": os.environ.get("HOME")}


def attempt(name, fn):
    try:
        out[name] = ["succeeded", repr(fn())[:200]]
    except Exception as e:
        out[name] = [
            "failed",
            type(e).__name__,
            getattr(e, "code", None),
            str(getattr(e, "read", lambda: b"")())[:300],
        ]


for key, p in paths["read"].items():
    attempt("read:" + key, lambda p=p: Path(p).read_text())
attempt("list:host_home", lambda: os.listdir(paths["host_home"]))
for key, p in paths.get("list", {}).items():
    attempt("list:" + key, lambda p=p: os.listdir(p))
attempt("list:other_workspaces", lambda: os.listdir(paths["workspaces"]))
for key, (host, port) in paths["connect"].items():
    attempt("connect:" + key, lambda a=(host, port): socket.create_connection(a, timeout=3).close())
req = urllib.request.Request(
    os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages",
    method="POST",
    headers={"x-api-key": os.environ["ANTHROPIC_API_KEY"], "content-type": "application/json"},
    data=json.dumps(
        {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    ).encode(),
)
attempt("proxy_call", lambda: json.load(urllib.request.urlopen(req, timeout=30))["content"][0]["text"])
procs = []


def spawn():
    for _ in range(64):
        procs.append(subprocess.Popen(["/usr/bin/sleep", "30"]))


attempt("spawn_64", spawn)
out["spawned"] = len(procs)
for p in procs:
    p.kill()
Path("probe.json").write_text(json.dumps(out))
