"""`gyre_tito.integrations`: the admin session and TRL's rollout contract, without TRL (its trainer is in the root
tests, `tests/test_tito_trl.py`): what `TitoRollout` returns for each prompt is the execution's selected trajectory
split before the policy's first token, and a failing harness is named with its execution, which is ended."""

from __future__ import annotations

import httpx
import pytest

from gyre_tito.integrations import TitoSession
from gyre_tito.integrations.trl import TitoRollout, split_trajectory
from gyre_tito.proxy import ProxyConfig
from gyre_tito.records import log_path, read_log
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig, ScriptRule
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

CALL = '<tool_call>\n{"name": "echo", "arguments": {"x": "hi"}}\n</tool_call>'


@pytest.fixture
def proxy(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    rules = [ScriptRule(last_contains=["<tool_response>"], reply="Done."), ScriptRule(reply=CALL)]
    engine = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok), rules=rules))
    cfg = ProxyConfig(
        engines=[engine.start()], tokenizer=str(tok), store=str(tmp_path / "store"), admin_token="adm"
    )
    try:
        with ProxyServer(cfg) as srv:
            yield srv
    finally:
        engine.stop()


def _two_turns(prompt: str, base_url: str, api_key: str) -> None:
    """Anthropic Messages: the model asks for a tool, gets its result, answers."""
    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01"}
    messages: list[dict] = [{"role": "user", "content": prompt}]
    tools = [{"name": "echo", "description": "Echo x.", "input_schema": {"type": "object"}}]
    for _ in range(3):
        body = {"model": "m", "max_tokens": 64, "messages": messages, "tools": tools}
        out = httpx.post(f"{base_url}/v1/messages", json=body, headers=headers, timeout=60).json()
        uses = [b for b in out["content"] if b["type"] == "tool_use"]
        if not uses:
            return
        messages += [
            {"role": "assistant", "content": out["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0]["id"], "content": "hi"}],
            },
        ]


def test_each_prompt_returns_its_selected_trajectory_split_before_the_first_policy_token(proxy, tmp_path):
    rollout = TitoRollout(TitoSession(proxy.url, "adm"), _two_turns, concurrency=2)
    out = rollout(["say hi", "say hi", "say ho"])
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", "execution_id", "role_class"}
    assert len(set(out["execution_id"])) == 3 and out["role_class"] == ["main/task"] * 3
    for i, eid in enumerate(out["execution_id"]):
        calls = read_log(log_path(tmp_path / "store" / "records", eid)).records
        assert len(calls) == 2
        prompt, completion = out["prompt_ids"][i], out["completion_ids"][i]
        mask, logprobs = out["env_mask"][i], out["logprobs"][i]
        assert (
            prompt + completion[: len(calls[0].output_ids)] == list(calls[0].input_ids) + calls[0].output_ids
        )
        assert [t for t, m in zip(completion, mask, strict=True) if m] == calls[0].output_ids + calls[
            1
        ].output_ids
        assert [lp for lp, m in zip(logprobs, mask, strict=True) if m] == calls[0].output_logprobs + (
            calls[1].output_logprobs
        )
        assert (
            mask[0] == 1
            and 0 in mask
            and all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
        )
        assert proxy.admin("GET", f"/admin/executions/{eid}").json()["ended"] is True


def test_a_failing_harness_is_named_with_its_execution_which_is_ended(proxy):
    def crashes(prompt, base_url, api_key):
        _two_turns(prompt, base_url, api_key)
        raise OSError("tool sandbox gone")

    with pytest.raises(
        RuntimeError, match=r"^execution (ex-\w+): the harness failed: OSError: tool sandbox gone$"
    ) as e:
        TitoRollout(TitoSession(proxy.url, "adm"), crashes)(["x"])
    eid = e.value.args[0].split()[1].rstrip(":")
    assert proxy.admin("GET", f"/admin/executions/{eid}").json()["ended"] is True
    with pytest.raises(RuntimeError, match="made no model call"):
        TitoRollout(TitoSession(proxy.url, "adm"), lambda *a: None)(["x"])
    with pytest.raises(RuntimeError, match=r"gyre-tito POST /admin/executions: HTTP 401"):
        TitoSession(proxy.url, "wrong").open()


def test_a_trajectory_without_policy_output_is_refused():
    with pytest.raises(ValueError, match="execution e1: its trajectory has no policy output"):
        split_trajectory(
            {
                "execution_id": "e1",
                "token_ids": [1, 2],
                "target_mask": [0, 0],
                "behavior_logprobs": [0.0, 0.0],
            }
        )
    assert split_trajectory(
        {
            "execution_id": "e",
            "token_ids": [5, 6, 7, 8],
            "target_mask": [0, 1, 0, 1],
            "behavior_logprobs": [0.0, -0.5, 0.0, -0.25],
        }
    ) == ([5], [6, 7, 8], [-0.5, 0.0, -0.25], [1, 0, 1])
