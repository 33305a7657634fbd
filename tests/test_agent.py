"""The built-in agent's tools stay inside the workspace and turn bad calls into tool results, never crashes."""

from __future__ import annotations

import json

from gyre.agent import run_tool


def test_write_then_read(tmp_path):
    assert run_tool(tmp_path, "write_file", json.dumps({"path": "a/b.txt", "content": "hi"})).startswith(
        "wrote 2"
    )
    assert (tmp_path / "a" / "b.txt").read_text() == "hi"
    assert run_tool(tmp_path, "read_file", json.dumps({"path": "a/b.txt"})) == "hi"


def test_bad_calls_become_errors(tmp_path):
    outside = tmp_path.parent / "outside.txt"
    assert "leaves the workspace" in run_tool(
        tmp_path, "write_file", json.dumps({"path": "../outside.txt", "content": "x"})
    )
    assert not outside.exists()
    assert run_tool(tmp_path, "write_file", "{not json").startswith("error:")
    assert run_tool(tmp_path, "write_file", json.dumps({"path": "x"})).startswith("error:")
    assert run_tool(tmp_path, "rm_rf", "{}") == "error: unknown tool 'rm_rf'"
    assert run_tool(tmp_path, "read_file", json.dumps({"path": "missing"})).startswith("error:")
