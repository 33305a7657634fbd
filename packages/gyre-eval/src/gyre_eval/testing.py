"""Test double for gyre-eval's judge: a scripted OpenAI-compatible chat completions endpoint on loopback.

No capable judge model runs on a CPU test machine, so tests (and demos of the wiring) point a `JudgeConfig` (or a
run's `[judge] base_url`) at `ScriptedJudge` instead. It parses the prompt `gyre_eval.judge.Judge` sends back into
its task, rubric and artifact files, and answers with whatever `reply(request)` returns (usually `judgement(...)`:
the exact JSON object the judge parses; any other text exercises the judge's failure path). Every request is kept in
`requests`, so a test can check what the judge was shown::

    def reply(req: JudgeRequest) -> str:
        return judgement(1.0 if "blue" in req.files().get("answer.txt", "") else 0.0, "colour named")

    with ScriptedJudge(reply, api_key="k") as judge:
        JudgeConfig(base_url=judge.base_url, model="m", rubric="...", api_key_env=...)

`reply` runs in the server's request thread (one per request), so it may block on a test's gate.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["JudgeRequest", "ScriptedJudge", "judgement"]

# The prompt layout of gyre_eval.judge.Judge._prompt and the file headers of render_workspace.
_PROMPT = re.compile(
    r"\A# Task\n(?P<task>.*)\n\n# Rubric\n(?P<rubric>.*?)\n\n# Artifact\n(?P<artifact>.*)\Z", re.S
)
_FILE_HEADER = re.compile(r"(?:\A|\n\n)## (?P<path>\S[^\n]*)\n")


@dataclass(frozen=True)
class JudgeRequest:
    """One request as the judge sent it: the model asked for, the system text and the user prompt's three parts."""

    model: str
    system: str
    task: str
    rubric: str
    artifact: str
    temperature: float | None
    max_tokens: int | None

    def files(self) -> dict[str, str]:
        """The artifact's text files by workspace path. A file ends where a blank line is followed by the next
        `## path` header, so only a file holding such a line itself is split wrongly (a test double's limit)."""
        heads = list(_FILE_HEADER.finditer(self.artifact))
        out = {}
        for head, nxt in zip(heads, [*heads[1:], None], strict=True):
            end = nxt.start() if nxt is not None else len(self.artifact)
            text = self.artifact[head.end() : end]
            out[head["path"]] = text if nxt is not None else text.removesuffix("\n")
        return out


def judgement(score: float, critique: str = "") -> str:
    """A reply in the shape gyre-eval's judge parses: `{"score": <0..1>, "critique": "..."}`."""
    return json.dumps({"score": score, "critique": critique})


class ScriptedJudge:
    """`POST /v1/chat/completions` answered by `reply(JudgeRequest)`; a wrong key is a 401, a body that is not
    the judge's request a 400, any other path a 404 (OpenAI's error shape)."""

    def __init__(
        self, reply: Callable[[JudgeRequest], str], api_key: str | None = None, model: str = "scripted-judge"
    ):
        self.reply = reply
        self.api_key = api_key
        self.model = model
        self.requests: list[JudgeRequest] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The endpoint root for `JudgeConfig.base_url` (`/chat/completions` is appended by the judge)."""
        if self._server is None:
            raise RuntimeError("the scripted judge is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def start(self) -> str:
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: tests read `requests`
                pass

            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, _error(f"no route {self.path}", "not_found_error"))
                if (
                    judge.api_key is not None
                    and self.headers.get("Authorization") != f"Bearer {judge.api_key}"
                ):
                    return self._send(401, _error("invalid api key", "authentication_error"))
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    request = _parse(json.loads(self.rfile.read(length)))
                except (ValueError, KeyError, TypeError, IndexError) as e:
                    return self._send(400, _error(f"not a judge request: {e}", "invalid_request_error"))
                with judge._lock:
                    judge.requests.append(request)
                content = judge.reply(request)
                self._send(200, _completion(request.model or judge.model, content))

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="scripted-judge", daemon=True)
        self._thread.start()
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> ScriptedJudge:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _parse(body: dict) -> JudgeRequest:
    messages = {m["role"]: m["content"] for m in body["messages"]}
    match = _PROMPT.match(messages["user"])
    if match is None:
        raise ValueError("the user message is not the judge's '# Task / # Rubric / # Artifact' prompt")
    return JudgeRequest(
        model=str(body.get("model") or ""),
        system=messages.get("system", ""),
        task=match["task"],
        rubric=match["rubric"],
        artifact=match["artifact"],
        temperature=body.get("temperature"),
        max_tokens=body.get("max_tokens"),
    )


def _completion(model: str, content: str) -> dict:
    return {
        "id": f"chatcmpl-{secrets.token_hex(8)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
        ],
    }


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind}}
