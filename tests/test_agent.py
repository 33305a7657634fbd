"""The built-in agent: tools stay inside the workspace, the conversation loop (answers, turn limit, context resets),
and it starts without site-packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gyre.demo import agent
from gyre.demo.agent import NOTES_HEADER, compact, run_conversation, run_tool


def test_read_and_list(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.txt").write_text("hi")
    (tmp_path / "c.txt").write_text("x")
    assert run_tool(tmp_path, "read_file", json.dumps({"path": "a/b.txt"})) == "hi"
    assert run_tool(tmp_path, "read_file", {"path": "c.txt"}) == "x"  # arguments as an object work too
    assert run_tool(tmp_path, "list_files", "{}") == "a/b.txt c.txt"
    (tmp_path / "answer.txt").write_text("an answer")  # the artifact is not one of the task's files
    assert run_tool(tmp_path, "list_files", "") == "a/b.txt c.txt"


def test_bad_calls_become_errors(tmp_path):
    outside = tmp_path.parent / "outside.txt"
    outside.write_text("secret")
    assert "leaves the workspace" in run_tool(tmp_path, "read_file", json.dumps({"path": "../outside.txt"}))
    assert run_tool(tmp_path, "read_file", "{not json").startswith("error:")
    assert run_tool(tmp_path, "read_file", "[1, 2]").startswith("error:")
    assert run_tool(tmp_path, "read_file", json.dumps({"file": "x"})).startswith("error:")
    assert run_tool(tmp_path, "write_file", "{}") == "error: unknown tool 'write_file'"
    assert run_tool(tmp_path, "read_file", json.dumps({"path": "missing"})).startswith("error:")


def _call(i: int, name: str, args: dict) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


class Script:
    """A `complete` that plays fixed assistant messages and keeps what it was sent."""

    def __init__(self, *messages: dict) -> None:
        self.messages, self.sent = list(messages), []

    def __call__(self, messages: list[dict]) -> dict:
        self.sent.append([dict(m) for m in messages])
        return self.messages.pop(0)


def test_tool_results_come_back_and_the_answer_is_the_artifact(tmp_path):
    (tmp_path / "a.txt").write_text("code: pink\n")
    script = Script(
        {"role": "assistant", "content": None, "tool_calls": [_call(0, "read_file", {"path": "a.txt"})]},
        {"role": "assistant", "content": "The code is pink."},
    )
    result = run_conversation(script, tmp_path, "Read a.txt.", max_turns=4, record=True)
    assert (result.calls, result.tool_calls, result.resets, result.answer) == (2, 1, 0, "The code is pink.")
    assert (tmp_path / "answer.txt").read_text() == "The code is pink."
    second = script.sent[1]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
    assert second[2]["tool_calls"][0]["id"] == "c0" and second[2]["content"] == ""
    assert second[3] == {"role": "tool", "tool_call_id": "c0", "content": "code: pink\n"}
    assert [sent for sent, _ in result.transcript] == script.sent


def test_no_answer_within_the_turn_limit_leaves_no_artifact(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    read = {"role": "assistant", "content": None, "tool_calls": [_call(0, "read_file", {"path": "a.txt"})]}
    result = run_conversation(Script(read, read, read), tmp_path, "task", max_turns=3)
    assert (result.calls, result.tool_calls, result.answer) == (3, 3, None)
    assert not (tmp_path / "answer.txt").exists()


def test_context_reset_keeps_the_task_and_the_notes(tmp_path):
    (tmp_path / "a.txt").write_text("next: b\n" + "filler\n" * 10)
    (tmp_path / "b.txt").write_text("code: gold\n")
    script = Script(
        {"role": "assistant", "content": None, "tool_calls": [_call(0, "read_file", {"path": "a.txt"})]},
        {"role": "assistant", "content": None, "tool_calls": [_call(1, "read_file", {"path": "b.txt"})]},
        {"role": "assistant", "content": "gold"},
    )
    result = run_conversation(script, tmp_path, "Start at a.txt.", max_turns=5, context_chars=60)
    assert (result.calls, result.resets, result.answer) == (3, 1, "gold")
    # The first read grew the conversation by more than 60 characters: the second call starts a new context.
    assert script.sent[1] == compact(
        "Start at a.txt.", [f"[read_file a.txt]\n{(tmp_path / 'a.txt').read_text().strip()}"]
    )
    assert script.sent[1][1]["content"].startswith(
        f"Start at a.txt.\n\n{NOTES_HEADER}\n[read_file a.txt]\nnext: b"
    )
    # After the reset the conversation grows again from the compacted one (below the threshold: no second reset).
    assert script.sent[2][:2] == script.sent[1][:2] and len(script.sent[2]) == 4


def test_agent_starts_without_site_packages(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-I", "-S", agent.__file__, "--workspace", str(tmp_path), "--task", "t"],
        capture_output=True,
        text=True,
        env={},
        timeout=60,
    )
    assert proc.returncode == 2 and "OPENAI_BASE_URL and OPENAI_API_KEY must be set" in proc.stderr
    env = {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_API_KEY": "k"}  # nothing listens on port 9
    proc = subprocess.run(
        [sys.executable, "-I", "-S", agent.__file__, "--workspace", str(tmp_path), "--task", "t"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 3 and "model endpoint failed" in proc.stderr


def test_the_agent_process_imports_no_module_it_does_not_need():
    """A run starts one agent process per execution: what it imports is paid thousands of times in a suite, once
    per execution in a demo. `dataclasses` (through `inspect`) was a quarter of its CPU."""
    code = (
        f"import sys\nsys.path.insert(0, {os.path.dirname(agent.__file__)!r})\nimport agent\n"
        "print('imported:', *sorted(set(sys.modules) & {'dataclasses', 'inspect', 'asyncio', 'typing'}))"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported:", proc.stdout


def test_http_complete_posts_to_the_endpoint_and_names_its_refusal(tmp_path):
    """The agent's own HTTP client (http.client, no TLS context for plain http) against a loopback server."""
    import http.server
    import threading

    seen: list[tuple[str, str, dict]] = []

    class Endpoint(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["Authorization"], body))
            refused = self.headers["Authorization"] != "Bearer right"
            reply = (
                b'{"error": "no such key"}'
                if refused
                else json.dumps({"choices": [{"message": {"role": "assistant", "content": "pink"}}]}).encode()
            )
            self.send_response(401 if refused else 200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}/v1"
        config = agent.AgentConfig(base_url=base, api_key="right", workspace=tmp_path, max_tokens=7)
        message = agent.http_complete(config)([{"role": "user", "content": "hi"}])
        assert message == {"role": "assistant", "content": "pink"}
        path, auth, body = seen[0]
        assert (path, auth) == ("/v1/chat/completions", "Bearer right")
        assert (
            body["max_tokens"] == 7
            and body["messages"][0]["content"] == "hi"
            and body["tools"] == agent.TOOLS
        )
        wrong = agent.AgentConfig(base_url=base, api_key="wrong", workspace=tmp_path)
        try:
            agent.http_complete(wrong)([{"role": "user", "content": "hi"}])
            raise AssertionError("a 401 must raise")
        except agent.EndpointError as exc:
            assert str(exc) == '401 {"error": "no such key"}'
    finally:
        server.shutdown()
        server.server_close()
