"""Incremental encoding: a call pays for the new part of its request, not for the whole history again.

A harness resends its whole conversation on every call. Re-rendering and re-encoding it (even with every piece
memoised, `render.py`) is Python work per message: 4.3 ms of a 132k-token call, 1 ms of a 3k one. Each execution keeps
an `EncodeState` of its last request instead: its turns, their chat-template messages (recorded outputs as markers),
and the token ids of the render without the generation prompt, with the token offset where each message's part
starts. The next request's turns are compared with those (one C-level list comparison: the parser hands back the same
`Turn` objects for an unchanged prefix, `anthropic_api.parse_request`), and only the messages after the unchanged
prefix are turned into template messages, rendered and encoded; the kept token ids are copied (memcpy), not rebuilt.

Rendering by parts needs to know which parts of a longer conversation stay the same; that is template semantics, so
it is done only for templates rendered natively (`qwen3_render`: `qwen3_chunk`, `qwen3_stable`), which are checked
byte for byte against the tokenizer's own template when it loads. Parts are split at `<|im_start|>`: the tokenizer
splits on added tokens before anything else, so the ids of a text are the ids of its parts between them, and the kept
ids are exactly what encoding the whole render would give (`tests/test_incremental.py` compares both on every call).
Any other template is rendered and encoded whole (`Proxy.encode`).

What stays per execution: 5 bytes a context token plus the template messages (which share their strings with the
parsed turns); it leaves memory with the execution.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gyre_tito.conversation import Conversation, Turn, append_template_message, common_prefix
from gyre_tito.errors import ProtocolError
from gyre_tito.qwen3_render import (
    qwen3_chunk,
    qwen3_generation_prompt,
    qwen3_head,
    qwen3_last_query,
    qwen3_stable,
)
from gyre_tito.render import ChatTokenizer

if TYPE_CHECKING:
    from gyre_tito.execution import Execution

__all__ = ["INLINE_CHARS", "EncodeState", "Splices", "encode_incremental", "new_chars"]

_SEG = "<|im_start|>"


class Splices:
    """The recorded outputs a render splices in: `slot(turn)` gives an assistant turn that replays one of our
    recorded responses its marker index (`recorded_marker`), `recorded[k]` / `prefixes[k]` are what the encoder puts
    there (`ChatTokenizer.encode_rendered`)."""

    __slots__ = ("ex", "prefixes", "recorded", "slots")

    def __init__(self, ex: Execution, base: Splices | None = None) -> None:
        self.ex = ex
        self.recorded: list[Any] = list(base.recorded) if base else []
        self.prefixes: list[str] = list(base.prefixes) if base else []
        self.slots: dict[str, int] = dict(base.slots) if base else {}

    def slot(self, t: Turn) -> int | None:
        cid = self.ex.recorded_call(t)
        if cid is None:
            return None
        if cid not in self.slots:
            self.slots[cid] = len(self.recorded)
            self.recorded.append(self.ex.records.tree.node(cid).output_ids)
            self.prefixes.append(self.ex.gen_suffix.get(cid, ""))
        return self.slots[cid]


@dataclass
class EncodeState:
    """One execution's last encoded request (see the module docstring); replaced whole after each encode."""

    key: tuple[Any, ...] | None = (
        None  # (system, tools, enable_thinking): anything else changed renders afresh
    )
    turns: list[Turn] = field(default_factory=list)
    msgs_after: list[int] = field(default_factory=list)  # template messages after turn i
    tmsgs: list[dict[str, Any]] = field(default_factory=list)
    real_query: int = -1  # index of the last real user query in tmsgs (-1: none)
    splices: Splices | None = None
    unrecognised: list[int] = field(default_factory=list)  # text-only assistant turns no record matched
    text_index_len: int = 0
    # token offset of part p (0: head, 1 + j: message j), -1: mid-part
    seg: list[int] = field(default_factory=list)
    ids: array = field(default_factory=lambda: array("i"))  # the whole request's, generation prompt last
    policy: bytearray = field(default_factory=bytearray)
    body: int = 0  # tokens before the generation prompt


def encode_incremental(
    chat: ChatTokenizer, ex: Execution, conv: Conversation, limit: int | None = None
) -> tuple[array, bytearray]:
    """`Proxy.encode` for natively rendered templates: the same ids and policy flags, at the cost of the new part."""
    st: EncodeState = ex.encode_state
    key = (conv.system, conv.tools, conv.enable_thinking)
    c = common_prefix(conv.turns, st.turns) if st.key == key else 0
    if c and len(ex.text_index) != st.text_index_len and st.unrecognised and st.unrecognised[0] < c:
        c = 0  # a newer text-only reply may now be recognised in a kept turn: restore from scratch
    if c == 0:
        splices, unrecognised = Splices(ex), []
        tmsgs = [{"role": "system", "content": conv.system}] if conv.system else []
        msgs_after: list[int] = []
    else:  # lists shared with the old state are only appended to once copied
        splices = Splices(ex, st.splices)
        unrecognised = [i for i in st.unrecognised if i < c]
        msgs_after = st.msgs_after[:c]
        tmsgs = st.tmsgs[: msgs_after[-1]]
    kept_msgs = len(tmsgs) if c else 0
    for i in range(c, len(conv.turns)):
        t = conv.turns[i]
        if t.role == "assistant" and not t.tool_calls and splices.slot(t) is None:
            unrecognised.append(i)  # a text-only turn no record matched (yet)
        append_template_message(tmsgs, t, splices.slot)
        msgs_after.append(len(tmsgs))

    # the last real user query decides which assistant parts keep their reasoning
    real_query = qwen3_last_query(tmsgs, kept_msgs)
    if real_query < 0 and kept_msgs:
        real_query = st.real_query if st.real_query < kept_msgs else qwen3_last_query(tmsgs[:kept_msgs])
    n = len(tmsgs)
    last_query = real_query if real_query >= 0 else n - 1
    if kept_msgs:
        old_n = len(st.tmsgs)
        old_last_query = st.real_query if st.real_query >= 0 else old_n - 1
        # parts 0..p-1 (head, messages 0..keep-1) are unchanged: not the last kept message (what follows it changed)
        keep = max(min(kept_msgs - 1, qwen3_stable(old_n, old_last_query, last_query)), 0)
        p = 1 + keep
        while st.seg[p] < 0:  # start at a part that begins a segment: its token offset is known
            p -= 1
        seg = st.seg[:p]
        start = st.seg[p]
        ids, policy = st.ids[:start], st.policy[:start]
    else:
        p, seg, ids, policy = 0, [], array("i"), bytearray()
    parts = [qwen3_head(tmsgs, conv.tools)] if p == 0 else []
    parts.extend(qwen3_chunk(tmsgs, j, last_query) for j in range(max(p - 1, 0), n))
    gen = qwen3_generation_prompt(True, conv.enable_thinking)
    if limit is not None:
        least = len(ids) + chat.min_tokens("".join(parts) + gen)
        if least >= limit:
            raise ProtocolError(
                400, "invalid_request_error", f"prompt is too long: at least {least} tokens > {limit} maximum"
            )
    group: list[str] = []
    for q, part in enumerate(parts):
        if (q == 0 or part.startswith(_SEG)) and group:
            _extend(chat, ids, policy, "".join(group), splices)
            group = []
        seg.append(len(ids) if q == 0 or part.startswith(_SEG) else -1)
        group.append(part)
    if group:
        _extend(chat, ids, policy, "".join(group), splices)
    body = len(ids)
    _extend(chat, ids, policy, gen, splices)
    ex.encode_state = EncodeState(
        key,
        list(conv.turns),
        msgs_after,
        tmsgs,
        real_query,
        splices,
        unrecognised,
        len(ex.text_index),
        seg,
        ids,
        policy,
        body,
    )
    return ids, policy  # shared with the state, which only ever copies a prefix of them (never changes them)


INLINE_CHARS = 16384
"""New text up to this size is encoded on the event loop (`Proxy._encode`): well under a millisecond."""


def new_chars(st: EncodeState, conv: Conversation) -> float:
    """About how much text `encode_incremental` would encode for `conv` (inf when it would start afresh)."""
    if st.key != (conv.system, conv.tools, conv.enable_thinking) or not st.turns:
        return float("inf")
    c = common_prefix(conv.turns, st.turns)
    if c == 0:
        return float("inf")
    return sum(
        len(t.content) + len(t.reasoning or "") + sum(len(orjson.dumps(x.arguments)) for x in t.tool_calls)
        for t in conv.turns[c - 1 :]
    )


def _extend(chat: ChatTokenizer, ids: array, policy: bytearray, text: str, splices: Splices) -> None:
    enc = chat.encode_rendered(text, splices.recorded, splices.prefixes)
    ids.extend(enc.ids)
    policy.extend(enc.policy)
