"""Per-execution trajectory tree (docs/design/tito.md#record-and-tree): one node per call record, matched by token prefix.

API summary
-----------
``tree = ExecutionTree(execution_id)`` (or ``ExecutionTree.from_records(execution_id, records)``)

- ``tree.match(context_ids) -> (call_id | None, matched_len)``: the deepest node whose whole root path (input + output
  tokens of every node from the root down to it) is a prefix of ``context_ids``; ``None, 0`` when nothing matches (attach
  to the root). Among nodes with the same root path (independently generated identical outputs) the most recently added
  wins. Cost is O(len(context_ids)), independent of the number of nodes.
- ``tree.add(record)``: append a ``CallRecord`` as a node under ``record.parent_id``; ``tree.check(record)`` raises the
  same ``TreeError`` without changing anything. ``record.seq`` must equal ``len(tree)``.
- ``tree.path_tokens(call_id) -> array('i')``: root-path tokens (``None`` -> empty); ``tree.context_ids(call_id)``: the
  exact tokens the engine was given (parent path + incremental input); ``tree.path_len(call_id)``.
- ``tree.node(call_id) -> TreeNode``; ``tree.nodes`` (add order); ``tree.children(call_id | None)``; ``tree.leaves()``;
  ``tree.path(call_id)`` (root -> node); ``tree.record(call_id)`` rebuilds the ``CallRecord``; ``tree.records()``.
- Thread safety: one writer and any number of concurrent readers (``add`` and ``match`` share a lock; nodes never
  change once added).

How the proxy uses it: compute the request's full context ids (reusing ``path_tokens`` of the previously matched node),
``parent, n = tree.match(ctx)``, build ``CallRecord(parent_id=parent, input_ids=ctx[n:], ...)``, append it durably
(``records.ExecutionRecords.append`` does log + tree in one step).

Matching uses a compressed trie (radix tree) over all root paths whose edges are spans of the nodes' own token arrays
(nothing is copied). Every node's root path ends at a trie point; match walks the trie along the context comparing whole
edges with C-level slice comparison, so each context token is examined at most once.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from gyre_tito.errors import TreeError
from gyre_tito.types import CallRecord, OutputSegment, ProvenanceRun, RoleClass, Timings

__all__ = ["ExecutionTree", "TreeError", "TreeNode", "as_tokens"]

TOKEN_TYPECODE = "i"  # 4-byte token ids: vocabularies are far below 2**31
_FIRST_CHUNK = 32
_MAX_CHUNK = 8192


def as_tokens(ids: Sequence[int] | array) -> array:
    """Token ids as a compact ``array('i')`` (returned as is when it already is one)."""
    if isinstance(ids, array) and ids.typecode == TOKEN_TYPECODE:
        return ids
    return array(TOKEN_TYPECODE, ids)


class TreeNode:
    """One call record inside the tree. ``tokens`` = incremental input followed by output."""

    __slots__ = (
        "_trie_end",
        "agent_id",
        "call_id",
        "call_kind",
        "children",
        "finish_reason",
        "index",
        "input_provenance",
        "metadata",
        "n_input",
        "offset",
        "output_logprobs",
        "output_segments",
        "parent",
        "role_class",
        "seq",
        "timings",
        "tokens",
    )

    def __init__(self, index: int, parent: int, offset: int, record: CallRecord) -> None:
        self.index = index
        self.parent = parent  # index of the parent node, -1 for the root
        self.offset = offset  # root-path length before this node's tokens
        self.call_id = record.call_id
        self.seq = record.seq
        # Built in one go: exact size (extend() would over-allocate).
        self.tokens = array(TOKEN_TYPECODE, record.input_ids + record.output_ids)
        self.n_input = len(record.input_ids)
        self.input_provenance: tuple[ProvenanceRun, ...] = tuple(record.input_provenance)
        self.output_logprobs = array("d", record.output_logprobs)
        self.output_segments: tuple[OutputSegment, ...] = tuple(record.output_segments)
        self.agent_id = record.agent_id
        self.role_class: RoleClass = record.role_class
        self.call_kind = record.call_kind
        self.finish_reason = record.finish_reason
        self.timings: Timings = record.timings
        self.metadata: dict[str, Any] = record.metadata
        self.children: list[int] = []
        self._trie_end: _Trie | None = None

    @property
    def n_output(self) -> int:
        return len(self.tokens) - self.n_input

    @property
    def end(self) -> int:
        """Root-path length including this node."""
        return self.offset + len(self.tokens)

    @property
    def input_ids(self) -> array:
        return self.tokens[: self.n_input]

    @property
    def output_ids(self) -> array:
        return self.tokens[self.n_input :]

    def __repr__(self) -> str:
        return (
            f"TreeNode({self.call_id!r}, parent={self.parent}, in={self.n_input}, out={self.n_output}, "
            f"role={self.role_class})"
        )


class _Trie:
    """A radix-trie point. The edge into it is ``buf[start:end]``; ``depth`` is the path length at its end."""

    __slots__ = ("buf", "calls", "children", "depth", "end", "start")

    def __init__(self, buf: array, start: int, end: int, depth: int) -> None:
        self.buf = buf
        self.start = start
        self.end = end
        self.depth = depth
        self.children: dict[int, _Trie] = {}
        self.calls: list[int] = []  # node indices whose root path ends exactly here, in add order


def _common_prefix(a: array, i: int, b: array, j: int, limit: int) -> int:
    """Length of the common prefix of a[i:i+limit] and b[j:j+limit] (galloping C-level slice compares)."""
    k = 0
    chunk = _FIRST_CHUNK
    while k < limit:
        c = min(chunk, limit - k)
        if a[i + k : i + k + c] == b[j + k : j + k + c]:
            k += c
            chunk = min(chunk * 2, _MAX_CHUNK)
            continue
        while a[i + k] == b[j + k]:
            k += 1
        return k
    return k


class ExecutionTree:
    """The trajectory tree of one execution (see the module docstring)."""

    def __init__(self, execution_id: str) -> None:
        self.execution_id = execution_id
        self._nodes: list[TreeNode] = []
        self._by_id: dict[str, int] = {}
        self._root_children: list[int] = []
        self._trie = _Trie(array(TOKEN_TYPECODE), 0, 0, 0)
        # add() splits trie edges in place; the lock keeps a match() in another thread from seeing half a split.
        self._lock = threading.Lock()
        # Where the last match stopped: (its context's bytes, tokens matched, trie point, best). A harness's next
        # context repeats the last one, so one memcmp skips the walk over every earlier call's edge (one Python step
        # per call: 0.2 ms at 128k tokens). One hint only: it holds 4 bytes per context token. A split leaves a
        # point's root path as it was; an add that ends at or above the hint's depth could change its best, so it
        # drops the hint.
        self._hints: list[tuple[bytes, int, _Trie, tuple[str | None, int]]] = []

    @classmethod
    def from_records(cls, execution_id: str, records: Iterable[CallRecord]) -> ExecutionTree:
        tree = cls(execution_id)
        for record in records:
            tree.add(record)
        return tree

    # ----- size and lookup -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, call_id: object) -> bool:
        return call_id in self._by_id

    @property
    def nodes(self) -> Sequence[TreeNode]:
        """All nodes in add order (a parent always precedes its children)."""
        return self._nodes

    def node(self, call_id: str) -> TreeNode:
        try:
            return self._nodes[self._by_id[call_id]]
        except KeyError:
            raise TreeError(f"execution {self.execution_id!r} has no call {call_id!r}") from None

    def children(self, call_id: str | None) -> list[str]:
        ids = self._root_children if call_id is None else self.node(call_id).children
        return [self._nodes[i].call_id for i in ids]

    def leaves(self) -> list[str]:
        """Call ids of nodes without children, in add order."""
        return [n.call_id for n in self._nodes if not n.children]

    def path(self, call_id: str) -> list[TreeNode]:
        """Nodes from the root down to ``call_id`` (inclusive)."""
        out: list[TreeNode] = []
        i = self.node(call_id).index
        while i >= 0:
            out.append(self._nodes[i])
            i = self._nodes[i].parent
        out.reverse()
        return out

    def path_len(self, call_id: str | None) -> int:
        return 0 if call_id is None else self.node(call_id).end

    def path_tokens(self, call_id: str | None) -> array:
        """Root-path tokens (input + output of every node on the path); empty for ``None`` (the root)."""
        out = array(TOKEN_TYPECODE)
        if call_id is not None:
            for n in self.path(call_id):
                out.extend(n.tokens)
        return out

    def context_ids(self, call_id: str) -> array:
        """The exact input the engine saw for ``call_id``: parent's root path + incremental input."""
        node = self.node(call_id)
        parent = None if node.parent < 0 else self._nodes[node.parent].call_id
        out = self.path_tokens(parent)
        out.extend(node.input_ids)
        return out

    def record(self, call_id: str) -> CallRecord:
        """Rebuild the ``CallRecord`` a node was made from."""
        n = self.node(call_id)
        return CallRecord(
            execution_id=self.execution_id,
            call_id=n.call_id,
            seq=n.seq,
            parent_id=None if n.parent < 0 else self._nodes[n.parent].call_id,
            input_ids=n.tokens[: n.n_input].tolist(),
            input_provenance=list(n.input_provenance),
            output_ids=n.tokens[n.n_input :].tolist(),
            output_logprobs=n.output_logprobs.tolist(),
            output_segments=list(n.output_segments),
            agent_id=n.agent_id,
            role_class=n.role_class,
            call_kind=n.call_kind,
            finish_reason=n.finish_reason,
            timings=n.timings,
            metadata=n.metadata,
        )

    def records(self) -> Iterator[CallRecord]:
        for n in self._nodes:
            yield self.record(n.call_id)

    # ----- matching --------------------------------------------------------------------------------------------
    def match(self, context_ids: Sequence[int] | array) -> tuple[str | None, int]:
        """Deepest node whose root path is a prefix of ``context_ids``: ``(call_id, path_len)`` or ``(None, 0)``."""
        ctx = as_tokens(context_ids)
        with self._lock:
            return self._match(ctx)

    def _match(self, ctx: array) -> tuple[str | None, int]:
        n = len(ctx)
        point = self._trie
        best: tuple[str | None, int] = (None, 0)
        if point.calls:
            best = (self._nodes[point.calls[-1]].call_id, 0)
        # Edges are compared as bytes (memcmp, no copy of the edge): array == array compares element by element
        # and slicing copies both sides, which made matching a 128k context cost ~0.4 ms.
        raw, size = ctx.tobytes(), ctx.itemsize
        pos = 0
        for hint in self._hints:  # the earlier stop this context repeats
            if pos < hint[1] <= n and raw.startswith(memoryview(hint[0])[: hint[1] * size]):
                _, pos, point, best = hint
        while pos < n:
            child = point.children.get(ctx[pos])
            if child is None:
                break
            length = child.end - child.start
            edge = memoryview(child.buf)[child.start : child.end].cast("B")
            if pos + length > n or not raw.startswith(edge, pos * size):
                break
            pos += length
            point = child
            if point.calls:
                best = (self._nodes[point.calls[-1]].call_id, pos)
        if pos:
            self._hints = [(raw, pos, point, best)]
        return best

    # ----- building --------------------------------------------------------------------------------------------
    def check(self, record: CallRecord) -> None:
        """Raise ``TreeError`` if ``add(record)`` would be refused; change nothing."""
        if record.execution_id != self.execution_id:
            raise TreeError(
                f"record of execution {record.execution_id!r} added to tree of {self.execution_id!r}"
            )
        if record.call_id in self._by_id:
            raise TreeError(f"call {record.call_id!r} is already in execution {self.execution_id!r}")
        if record.parent_id is not None and record.parent_id not in self._by_id:
            raise TreeError(f"call {record.call_id!r} names unknown parent {record.parent_id!r}")
        if record.seq != len(self._nodes):
            raise TreeError(f"call {record.call_id!r} has seq {record.seq}, expected {len(self._nodes)}")

    def add(self, record: CallRecord) -> TreeNode:
        """Append ``record`` as a new node (independently generated equal outputs stay separate nodes)."""
        with self._lock:
            self.check(record)
            parent = -1 if record.parent_id is None else self._by_id[record.parent_id]
            offset = 0 if parent < 0 else self._nodes[parent].end
            node = TreeNode(len(self._nodes), parent, offset, record)
            start = self._trie if parent < 0 else self._nodes[parent]._trie_end
            assert start is not None
            end = self._insert(start, node.tokens)
            end.calls.append(node.index)
            self._hints = [h for h in self._hints if h[1] < end.depth]
            node._trie_end = end
            self._nodes.append(node)
            self._by_id[node.call_id] = node.index
            (self._root_children if parent < 0 else self._nodes[parent].children).append(node.index)
            return node

    def _insert(self, point: _Trie, seq: array) -> _Trie:
        """Walk/extend the trie from ``point`` along ``seq``; return the trie point where ``seq`` ends."""
        pos, n = 0, len(seq)
        while pos < n:
            child = point.children.get(seq[pos])
            if child is None:
                leaf = _Trie(seq, pos, n, point.depth + n - pos)
                point.children[seq[pos]] = leaf
                return leaf
            length = child.end - child.start
            k = _common_prefix(child.buf, child.start, seq, pos, min(length, n - pos))
            if k < length:
                # Split the edge at k: a new middle point; `child` keeps representing its own end point, so
                # references held by nodes (their _trie_end) stay valid.
                mid = _Trie(child.buf, child.start, child.start + k, point.depth + k)
                child.start += k
                mid.children[child.buf[child.start]] = child
                point.children[seq[pos]] = mid
                child = mid
            point = child
            pos += k
        return point
