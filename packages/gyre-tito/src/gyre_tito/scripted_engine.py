"""A scripted engine: a real HTTP server speaking SGLang's `/generate` subset that plays back a script of replies.

For deterministic tests and benchmarks of the proxy (the test double for an SGLang server, which cannot run on CPU).
Replies are raw model text in the Qwen3 format (e.g. `<tool_call>\\n{"name": ...}\\n</tool_call>`), tokenized with
the real tokenizer and ended with `<|im_end|>`. The log-prob of the i-th reply token is a fixed function of
`(i, token id)`, so a reply continued on another engine after a failure carries the same log-probs as one served
whole. A request whose input already ends with the first k tokens of its reply (a retry that continues a partial
output) gets the remaining tokens.

Rules are tried in order against the prompt text (decoded, special tokens kept); the first whose `contains` strings
all occur in the prompt, whose `absent` strings all do not, and whose `last_contains` strings all occur in the latest
turn (the text after the last assistant turn) wins; otherwise `default_reply`. A Python callable can replace the rules.

Run standalone: `python -m gyre_tito.scripted_engine --tokenizer DIR --script script.json --port N`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

__all__ = [
    "ScriptRule",
    "ScriptedEngine",
    "ScriptedEngineConfig",
    "latest_turn",
    "match_reply",
    "scripted_logprob",
]


class ScriptRule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    contains: list[str] = Field(default_factory=list, description="all must occur in the prompt")
    absent: list[str] = Field(default_factory=list, description="none may occur in the prompt")
    last_contains: list[str] = Field(default_factory=list, description="all must occur in the latest turn")
    reply: str = Field(description="raw model output text (Qwen3 format), without the end token")


class ScriptedEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokenizer: str = Field(description="tokenizer directory (tokenizer.json)")
    rules: list[ScriptRule] = Field(default_factory=list, description="tried in order")
    default_reply: str = Field("OK.", description="reply when no rule matches")
    token_delay_s: float = Field(0.0, description="sleep per generated token (to make requests take time)")
    weight_version: str = Field("default", description="reported as meta_info.weight_version")
    context_length: int | None = Field(None, description="reject longer inputs with 400, as SGLang does")
    hold_after: int | None = Field(
        None,
        description="gate for tests: a fresh request (not a continuation) stops after this many tokens until "
        "`release` is set or it is aborted; `holding` is set when one reaches that point",
    )
    fail_after: int | None = Field(
        None, description="end every stream after this many tokens without a finish reason (a dying engine)"
    )


def latest_turn(prompt: str) -> str:
    """The prompt's latest turn: the text after its last assistant turn (before the generation prompt)."""
    head = prompt[: prompt.rfind("<|im_start|>assistant\n")] if prompt.endswith("assistant\n") else prompt
    cut = head.rfind("<|im_start|>assistant\n")
    return head[cut:] if cut >= 0 else head


def match_reply(rules: list[ScriptRule], default_reply: str, prompt: str) -> str:
    """The reply of the first rule the prompt (decoded, special tokens kept) meets, else `default_reply`."""
    last = latest_turn(prompt)
    for r in rules:
        if (
            all(s in prompt for s in r.contains)
            and not any(s in prompt for s in r.absent)
            and all(s in last for s in r.last_contains)
        ):
            return r.reply
    return default_reply


def scripted_logprob(i: int, token_id: int) -> float:
    """Deterministic behaviour log-prob of the i-th reply token (always in [-2.0, -0.02])."""
    return -(((token_id * 31 + i * 17) % 97) + 1) / 50.0


class ScriptedEngine:
    """The scripted `/generate` server; `start()` serves it on loopback in a thread and returns its URL."""

    def __init__(self, config: ScriptedEngineConfig, reply_fn: Callable[[str, str], str] | None = None):
        self.config = config
        self.tok = Tokenizer.from_file(str(Path(config.tokenizer) / "tokenizer.json"))
        self.im_start = self.tok.token_to_id("<|im_start|>")
        self.im_end = self.tok.token_to_id("<|im_end|>")
        self.header = self.tok.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
        self.reply_fn = reply_fn
        self.requests: list[dict[str, Any]] = []  # bodies received, for tests
        self.prompts: list[str] = []
        self._aborted: set[str] = set()
        self.holding = threading.Event()  # a request reached `hold_after` tokens
        self.release = threading.Event()  # lets held requests go on
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        self.app = self._build_app()

    # ---- the script ------------------------------------------------------------------------------------------
    def reply_for(self, prompt: str) -> str:
        if self.reply_fn is not None:
            return self.reply_fn(prompt, latest_turn(prompt))
        return match_reply(self.config.rules, self.config.default_reply, prompt)

    def _plan(self, input_ids: list[int]) -> tuple[list[int], int]:
        """Reply ids and how many of them the input already ends with (a continued partial output)."""
        # find the last assistant header: whatever follows it is a partial output being continued
        n = len(self.header)
        pos = -1
        for i in range(len(input_ids) - n, -1, -1):
            if input_ids[i : i + n] == self.header:
                pos = i + n
                break
        partial = input_ids[pos:] if pos >= 0 else []
        prompt = self.tok.decode(input_ids[: pos if pos >= 0 else len(input_ids)], skip_special_tokens=False)
        self.prompts.append(prompt)
        reply = [*self.tok.encode(self.reply_for(prompt), add_special_tokens=False).ids, self.im_end]
        if partial and reply[: len(partial)] == partial:
            return reply, len(partial)
        return reply, 0

    # ---- HTTP ------------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        @app.get("/health_generate")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {
                "model_path": self.config.tokenizer,
                "is_generation": True,
                "weight_version": self.config.weight_version,
            }

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {"context_length": self.config.context_length, "version": "scripted"}

        @app.post("/abort_request")
        async def abort(req: Request) -> dict[str, Any]:
            body = await req.json()
            self._aborted.add(body.get("rid", ""))
            return {}

        @app.post("/generate")
        async def generate(req: Request) -> Response:
            try:
                body = orjson.loads(await req.body())
                ids = [int(t) for t in body["input_ids"]]
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                return JSONResponse({"error": {"message": f"bad request: {e}"}}, status_code=400)
            limit = self.config.context_length
            if limit is not None and len(ids) >= limit:
                msg = f"The input ({len(ids)} tokens) is longer than the model's context length ({limit} tokens)."
                return JSONResponse({"error": {"message": msg}}, status_code=400)
            self.requests.append(body)
            rid = str(body.get("rid") or "")
            max_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 128))
            reply, done = self._plan(ids)
            if body.get("stream"):
                return StreamingResponse(
                    self._stream(rid, ids, reply, done, max_new), media_type="text/event-stream"
                )
            out: list[int] = []
            finish: dict[str, Any] = {"type": "stop", "matched": self.im_end}
            async for step in self._produce(rid, reply, done, max_new):
                out, finish = step
            return JSONResponse(self._answer(rid, ids, out, done, finish))

        return app

    async def _produce(self, rid: str, reply: list[int], done: int, max_new: int):
        out: list[int] = []
        for i in range(done, len(reply)):
            hold = self.config.hold_after
            if hold is not None and done == 0 and len(out) == hold:
                self.holding.set()
                while not self.release.is_set() and rid not in self._aborted:
                    await asyncio.sleep(0.002)  # a gate the test opens; never a timing assumption
            fail = self.config.fail_after
            if fail is not None and len(out) >= fail:
                return  # the stream ends without a finish reason, as when the engine dies
            if rid in self._aborted:
                yield out, {"type": "abort", "message": "aborted"}
                return
            if len(out) >= max_new:
                yield out, {"type": "length", "length": len(out)}
                return
            if self.config.token_delay_s:
                await asyncio.sleep(self.config.token_delay_s)
            out = [*out, reply[i]]
            finish = {"type": "stop", "matched": self.im_end} if i == len(reply) - 1 else None
            yield out, finish

    def _answer(self, rid: str, ids: list[int], out: list[int], done: int, finish) -> dict[str, Any]:
        lps = [[scripted_logprob(done + i, t), t, None] for i, t in enumerate(out)]
        return {
            "text": self.tok.decode(out, skip_special_tokens=True),
            "output_ids": out,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "completion_tokens": len(out),
                "cached_tokens": 0,
                "weight_version": self.config.weight_version,
                "output_token_logprobs": lps,
            },
        }

    async def _stream(self, rid: str, ids: list[int], reply: list[int], done: int, max_new: int):
        async for out, finish in self._produce(rid, reply, done, max_new):
            yield b"data: " + orjson.dumps(self._answer(rid, ids, out, done, finish)) + b"\n\n"
        yield b"data: [DONE]\n\n"

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self, port: int = 0) -> str:
        cfg = uvicorn.Config(
            self.app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", timeout_keep_alive=75
        )
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 20
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("scripted engine did not start")
            time.sleep(0.01)
        sock_port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{sock_port}"
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._server = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gyre_tito.scripted_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--script", help="JSON file: {rules: [...], default_reply: str}")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--weight-version", default="default")
    ap.add_argument(
        "--hold-after", type=int, default=None, help="hold fresh requests after N tokens; prints 'holding'"
    )
    a = ap.parse_args(argv)
    script = json.loads(Path(a.script).read_text()) if a.script else {}
    cfg = ScriptedEngineConfig(
        tokenizer=a.tokenizer,
        token_delay_s=a.token_delay,
        weight_version=a.weight_version,
        hold_after=a.hold_after,
        **script,
    )
    eng = ScriptedEngine(cfg)
    if a.hold_after is not None:  # a test in another process learns the gate was reached from stdout

        def announce() -> None:
            eng.holding.wait()
            print("holding", flush=True)

        threading.Thread(target=announce, daemon=True).start()
    uvicorn.run(
        eng.app, host="127.0.0.1", port=a.port, log_level="warning", lifespan="off", timeout_keep_alive=75
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
