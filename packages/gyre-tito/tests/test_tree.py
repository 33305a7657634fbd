"""ExecutionTree: prefix matching, branching, root attachment, separate identical outputs, linear matching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_tito.errors import TreeError
from gyre_tito.testing.synthetic import SessionDriver, make_record
from gyre_tito.tree import ExecutionTree


def _chain() -> ExecutionTree:
    tree = ExecutionTree("ex")
    tree.add(make_record(call_id="a", seq=0, input_ids=[1, 2, 3], output_ids=[10, 11]))
    tree.add(make_record(call_id="b", seq=1, parent_id="a", input_ids=[4], output_ids=[12]))
    return tree


def test_match_finds_deepest_full_prefix():
    tree = _chain()
    assert tree.match([1, 2, 3, 10, 11, 4, 12, 5]) == ("b", 7)
    assert tree.match([1, 2, 3, 10, 11, 4, 12]) == ("b", 7)
    assert tree.match([1, 2, 3, 10, 11, 4]) == ("a", 5)  # b's output is not in the context
    assert tree.match([1, 2, 3, 10]) == (None, 0)  # a's output is only partly there
    assert tree.match([9, 9]) == (None, 0)
    assert tree.match([]) == (None, 0)


def test_path_tokens_and_context_ids():
    tree = _chain()
    assert tree.path_tokens("b").tolist() == [1, 2, 3, 10, 11, 4, 12]
    assert tree.context_ids("b").tolist() == [1, 2, 3, 10, 11, 4]
    assert tree.path_tokens(None).tolist() == []
    assert tree.path_len("a") == 5
    assert [n.call_id for n in tree.path("b")] == ["a", "b"]


def test_divergence_branches_and_no_match_attaches_to_root():
    tree = _chain()
    d = SessionDriver(tree)
    # Diverges after a's output: branch under a.
    r = d.call([1, 2, 3, 10, 11, 7, 7], [13])
    assert (r.parent_id, r.input_ids) == ("a", [7, 7])
    # Shares tokens with a's input but not a's whole path: attaches to the root with the full context.
    r2 = d.call([1, 2, 9], [14])
    assert (r2.parent_id, r2.input_ids) == (None, [1, 2, 9])
    assert tree.children("a") == ["b", "c2"]
    assert tree.children(None) == ["a", "c3"]
    assert tree.leaves() == ["b", "c2", "c3"]
    # The trie split a's span; matching still finds both branches.
    assert tree.match([1, 2, 3, 10, 11, 4, 12, 0]) == ("b", 7)
    assert tree.match([1, 2, 9, 14, 0]) == ("c3", 4)
    assert tree.match([1, 2, 3, 10, 11, 7, 7, 13]) == ("c2", 8)


def test_identical_independent_outputs_stay_separate_nodes():
    tree = ExecutionTree("ex")
    tree.add(make_record(call_id="x1", seq=0, input_ids=[1, 2], output_ids=[3]))
    tree.add(make_record(call_id="x2", seq=1, input_ids=[1, 2], output_ids=[3]))
    assert len(tree) == 2 and tree.leaves() == ["x1", "x2"]
    assert tree.match([1, 2, 3, 4]) == ("x2", 3)  # the most recent of equal paths
    tree.add(make_record(call_id="y", seq=2, parent_id="x1", input_ids=[4], output_ids=[5]))
    assert tree.match([1, 2, 3, 4, 5]) == ("y", 5)  # deeper wins over recency


def test_add_refuses_bad_records():
    tree = _chain()
    with pytest.raises(TreeError, match="already"):
        tree.add(make_record(call_id="a", seq=2, input_ids=[1]))
    with pytest.raises(TreeError, match="unknown parent"):
        tree.add(make_record(call_id="z", seq=2, parent_id="nope", input_ids=[1]))
    with pytest.raises(TreeError, match="seq"):
        tree.add(make_record(call_id="z", seq=5, input_ids=[1]))
    with pytest.raises(TreeError, match="execution"):
        tree.add(make_record(execution_id="other", call_id="z", seq=2, input_ids=[1]))
    assert len(tree) == 2


def test_record_round_trips_through_the_tree():
    tree = _chain()
    rec = make_record(
        call_id="c", seq=2, parent_id="b", input_ids=[5, 6], output_ids=[7], input_policy=[True, False]
    )
    tree.add(rec)
    assert tree.record("c") == rec


def _brute_force(tree: ExecutionTree, ctx: list[int]) -> tuple[str | None, int]:
    best: tuple[str | None, int] = (None, 0)
    for node in tree.nodes:
        path = tree.path_tokens(node.call_id).tolist()
        if ctx[: len(path)] == path and len(path) >= best[1]:
            best = (node.call_id, len(path))
    return best


# A call: which earlier call is its parent (0: the root), its input and its output tokens.
_CALL = (st.integers(0, 5), st.lists(st.integers(0, 3), max_size=6), st.lists(st.integers(0, 3), max_size=3))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(*_CALL), min_size=1, max_size=25), st.lists(st.integers(0, 3), max_size=40))
def test_match_equals_brute_force(calls, probe):
    """Property: match() == the deepest node (latest on ties) whose root path is a prefix, by brute force."""
    tree = ExecutionTree("ex")
    for i, (parent_pick, inp, out) in enumerate(calls):
        parent = None if i == 0 or parent_pick == 0 else f"c{parent_pick % i}"
        tree.add(make_record(call_id=f"c{i}", seq=i, parent_id=parent, input_ids=inp, output_ids=out))
    contexts = [probe] + [tree.path_tokens(f"c{i}").tolist() + probe for i in range(len(calls))]
    for ctx in contexts:
        assert tree.match(ctx) == _brute_force(tree, ctx)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(*_CALL, st.lists(st.integers(0, 5), max_size=3)), min_size=1, max_size=20),
    st.lists(st.integers(0, 3), max_size=6),
)
def test_matches_between_adds_equal_brute_force(calls, probe):
    """Property: matching between adds (where earlier matches leave hints behind) still equals brute force."""
    tree = ExecutionTree("ex")
    for i, (parent_pick, inp, out, probes) in enumerate(calls):
        parent = None if i == 0 or parent_pick == 0 else f"c{parent_pick % i}"
        tree.add(make_record(call_id=f"c{i}", seq=i, parent_id=parent, input_ids=inp, output_ids=out))
        for pick in probes:  # contexts that extend some node's path, as a harness's next call does
            ctx = tree.path_tokens(f"c{pick % (i + 1)}").tolist() + probe
            assert tree.match(ctx) == _brute_force(tree, ctx)
            assert tree.match(ctx[: len(ctx) // 2]) == _brute_force(tree, ctx[: len(ctx) // 2])
