"""A Claude Code-shaped session with two compactions and three sub-agents: classifier + tree + selection together.

Requests have Claude Code's shape (billing line, system blocks, tools, tool_use/tool_result, compaction prompt,
"This session is being continued" restart). A toy append-only renderer (one token per character, billing line
dropped like the proxy does) turns each request into context ids; the "engine" output is the rendered assistant turn.
"""

from __future__ import annotations

import itertools

from gyre_tito.materialize import select_trajectories
from gyre_tito.roles import ClaudeCodeClassifier
from gyre_tito.selection import SelectionConfig, select_paths
from gyre_tito.testing.synthetic import make_record
from gyre_tito.tree import ExecutionTree

MAIN_BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a1; cc_entrypoint=sdk-cli;"
SUB_BILLING = "x-anthropic-billing-header: cc_version=2.1.197.b2; cc_entrypoint=sdk-cli; cc_is_subagent=true;"
MAIN_SYSTEM = "You are an interactive agent that helps users with software engineering tasks."
SUB_SYSTEM = "You are an agent for Claude Code, Anthropic's official CLI for Claude."
COMPACT = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\nCreate a detailed summary of the conversation."
)
CONTINUED = "This session is being continued from a previous conversation that ran out of context. Summary: "
TOOLS = [{"name": n, "input_schema": {"type": "object"}} for n in ("Agent", "Bash", "Write")]


def tok(text: str) -> list[int]:
    return [ord(c) for c in text]


def render_turn(m: dict) -> str:
    content = m["content"]
    if isinstance(content, str):
        body = content
    else:
        parts = []
        for b in content:
            if b["type"] == "text":
                parts.append(b["text"])
            elif b["type"] == "tool_use":
                parts.append(f"<call {b['name']} {b['input']}>")
            elif b["type"] == "tool_result":
                parts.append(f"<result {b['content']}>")
        body = "".join(parts)
    return f"<{m['role']}>{body}</>"


def render(req: dict) -> list[int]:
    system = "".join(
        b["text"] for b in req["system"] if not b["text"].startswith("x-anthropic-billing-header")
    )
    tools = ",".join(t["name"] for t in req.get("tools") or [])
    return tok(
        f"<sys>{system}<tools>{tools}</>" + "".join(render_turn(m) for m in req["messages"]) + "<assistant>"
    )


class Harness:
    """Plays Claude Code's side: keeps each agent's message history, sends requests through 'the proxy'."""

    def __init__(self) -> None:
        self.tree = ExecutionTree("ex-cc")
        self.classifier = ClaudeCodeClassifier()
        self.calls: list[tuple[str, str]] = []  # (call id, role class)

    def send(self, billing: str, system: str, messages: list, reply: str, tools=TOOLS) -> str:
        req = {
            "system": [{"type": "text", "text": billing}, {"type": "text", "text": system}],
            "messages": messages,
        }
        if tools:
            req["tools"] = tools
        ctx = render(req)
        agent_id, role_class, call_kind = self.classifier.classify(req)
        parent, n = self.tree.match(ctx)
        call_id = f"c{len(self.tree)}"
        self.tree.add(
            make_record(
                execution_id="ex-cc",
                call_id=call_id,
                seq=len(self.tree),
                parent_id=parent,
                input_ids=ctx[n:],
                output_ids=tok(reply + "</>"),
                role_class=role_class,
                agent_id=agent_id,
                call_kind=call_kind,
            )
        )
        self.calls.append((call_id, role_class))
        messages.append({"role": "assistant", "content": reply})
        return call_id

    def agent(self, billing, system, task: str, steps: int) -> list[str]:
        msgs = [{"role": "user", "content": task}]
        ids = []
        for k in range(steps):
            ids.append(self.send(billing, system, msgs, f"step {k} of {task}"))
            msgs.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": f"t{k}", "content": f"ok {k}"}],
                }
            )
        return ids


def run_session() -> tuple[Harness, dict[str, list[str]]]:
    h = Harness()
    ids: dict[str, list[str]] = {}
    # Side call: title generation, no tools.
    ids["title"] = [
        h.send(
            MAIN_BILLING,
            "Generate a short title.",
            [{"role": "user", "content": "Build a CLI"}],
            "CLI",
            tools=None,
        )
    ]
    epochs = []
    summary = None
    for epoch in range(3):
        first = "Build a CLI" if summary is None else CONTINUED + summary
        msgs = [{"role": "user", "content": first}]
        epoch_ids = []
        for k in range(3):
            epoch_ids.append(h.send(MAIN_BILLING, MAIN_SYSTEM, msgs, f"main e{epoch} k{k}"))
            if k == 1:  # the main agent delegates through the Agent tool: a sub-agent conversation runs
                ids[f"sub{epoch}"] = h.agent(SUB_BILLING, SUB_SYSTEM, f"subtask {epoch}", steps=2)
            msgs.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": f"m{k}", "content": "done"}],
                }
            )
        if epoch < 2:  # compaction: same system and tools, history + the compaction prompt
            msgs.append({"role": "user", "content": [{"type": "text", "text": COMPACT}]})
            summary = f"summary of epoch {epoch}"
            ids[f"summary{epoch}"] = [h.send(MAIN_BILLING, MAIN_SYSTEM, msgs, summary)]
        epochs.append(epoch_ids)
    for e, epoch_ids in enumerate(epochs):
        ids[f"main{e}"] = epoch_ids
    return h, ids


def test_two_compactions_three_subagents_give_the_expected_branches():
    h, ids = run_session()
    tree = h.tree
    assert len(tree) == 1 + 3 * 3 + 3 * 2 + 2
    roles = dict(h.calls)
    assert [roles[i] for i in ids["main0"] + ids["main1"] + ids["main2"]] == ["main/task"] * 9
    assert [roles[i] for i in ids["sub0"] + ids["sub1"] + ids["sub2"]] == ["sub/task"] * 6
    assert [roles[ids[f"summary{e}"][0]] for e in range(2)] == ["main/summary"] * 2
    assert roles[ids["title"][0]] == "other"
    # Every agent conversation is a chain; each epoch and each sub-agent starts a new branch at the root.
    roots = [
        ids["title"][0],
        ids["main0"][0],
        ids["sub0"][0],
        ids["main1"][0],
        ids["sub1"][0],
        ids["main2"][0],
        ids["sub2"][0],
    ]
    assert tree.children(None) == roots
    for chain in [ids[f"main{e}"] for e in range(3)] + [ids[f"sub{e}"] for e in range(3)]:
        for parent, child in itertools.pairwise(chain):
            assert tree.node(child).parent == tree.node(parent).index
    # Compaction calls extend the last main call of their epoch.
    for e in range(2):
        assert tree.children(ids[f"main{e}"][-1]) == ids[f"summary{e}"]
    expected_leaves = {ids["title"][0], ids["summary0"][0], ids["summary1"][0], ids["main2"][-1]} | {
        ids[f"sub{e}"][-1] for e in range(3)
    }
    assert set(tree.leaves()) == expected_leaves
    # Incremental inputs: a continuing call stores only the tool result + the new assistant prefix.
    second = tree.node(ids["main2"][1])
    assert bytes(second.input_ids.tolist()).decode() == "<user><result done></><assistant>"


def test_selection_on_the_session_follows_the_priority():
    h, ids = run_session()
    admitted = select_paths(h.tree, SelectionConfig(j_max=5, seed=11))
    assert [a.role_class for a in admitted] == [
        "main/task",
        "main/summary",
        "main/summary",
        "sub/task",
        "sub/task",
    ]
    assert admitted[0].leaf_call_id == ids["main2"][-1]
    assert {a.leaf_call_id for a in admitted[1:3]} == {ids["summary0"][0], ids["summary1"][0]}
    # The summary trajectory trains its epoch's task turns too (they are on its path and were not fixed before).
    s0 = next(a for a in admitted if a.leaf_call_id == ids["summary0"][0])
    assert set(s0.target_calls) == set(ids["main0"]) | set(ids["summary0"])

    everything = select_trajectories(h.tree, "g", SelectionConfig(j_max=50, seed=11))
    assert len(everything) == 6  # every non-`other` leaf; the title call is never admitted
    targets = sum(t.num_targets for t in everything)
    assert targets == sum(n.n_output for n in h.tree.nodes if n.role_class != "other")


def test_long_token_level_session_rebuilds_every_context():
    """The benchmark's generator at small scale: every call's context + output is exactly its root path."""
    from gyre_tito.testing.synthetic import LongSessionConfig, SessionDriver, long_session

    cfg = LongSessionConfig(
        calls=40,
        max_context=4000,
        sub_calls=3,
        system_tokens=500,
        sub_system_tokens=300,
        output_tokens=50,
        summary_tokens=100,
    )
    script = long_session(cfg)
    driver = SessionDriver(ExecutionTree("long"))
    for call in script:
        rec = driver.call(
            call.context, call.output.tolist(), role_class=call.role_class, agent_id=call.agent_id
        )
        assert driver.context(rec.call_id) == call.context + call.output
    tree = driver.tree
    assert len(tree) == 40 and max(len(c.context) for c in script) <= 4000
    assert len(tree.children(None)) == cfg.compactions + 1 + cfg.subagents
    summaries = [n for n in tree.nodes if n.role_class == "main/summary"]
    assert len(summaries) == 2 and all(not n.children for n in summaries)
    # Continuing calls store only what is new: input = previous tool result (+ the sub-agent's answer).
    assert sum(len(n.tokens) for n in tree.nodes) < sum(len(c.context) + len(c.output) for c in script) / 3
