"""Test helpers (imported by name: conftest puts this directory on sys.path; the name is unique in the repo)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gyre_eval.types import Submission


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > end:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)


def make_workspace(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def submission(workspace: Path | None, execution_id: str = "e0", **kw) -> Submission:
    base = dict(
        execution_id=execution_id,
        group_id="g0",
        group_size=1,
        dispatch_index=0,
        artifact_ref=str(workspace) if workspace is not None else None,
        launched_at=time.time(),
        budget_s=60.0,
    )
    base.update(kw)
    return Submission(**base)


def run(coro):
    return asyncio.run(coro)


JUDGE_KEY = "judge-key-123"


def judge_app(replies: list | None = None) -> FastAPI:
    """A minimal OpenAI-compatible judge: scores 0.75 when the artifact mentions hello, else 0.25."""
    app = FastAPI()
    app.state.requests = []
    app.state.replies = list(replies or [])

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.requests.append({"auth": request.headers.get("authorization"), "body": body})
        if app.state.replies:
            status, content = app.state.replies.pop(0)
            if status != 200:
                return JSONResponse(status_code=status, content={"error": {"message": "overloaded"}})
        else:
            prompt = body["messages"][-1]["content"]
            score = 0.75 if "hello" in prompt else 0.25
            content = f'```json\n{{"score": {score}, "critique": "prints hello; no tests"}}\n```'
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    return app
