"""J_max admission (docs/design/tito.md#provenance-mask-and-selection): priority, proportional draws, fixed targets, whole-path masking, reproducibility."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre_tito.materialize import materialize
from gyre_tito.selection import SelectionConfig, select_paths
from gyre_tito.testing.synthetic import make_record
from gyre_tito.tree import ExecutionTree
from gyre_tito.types import ROLE_CLASSES

ROLE = st.sampled_from(ROLE_CLASSES)


def build(spec, execution_id="ex") -> ExecutionTree:
    """spec: [(parent index or None, n_input, n_output, role_class)]; tokens are distinct per node."""
    tree = ExecutionTree(execution_id)
    for i, (parent, n_in, n_out, role) in enumerate(spec):
        tree.add(
            make_record(
                execution_id=execution_id,
                call_id=f"n{i}",
                seq=i,
                parent_id=None if parent is None else f"n{parent}",
                input_ids=[1000 * i + k for k in range(n_in)],
                output_ids=[1000 * i + 500 + k for k in range(n_out)],
                input_policy=[k % 3 == 0 for k in range(n_in)],  # policy-marked input stays context only
                role_class=role,
            )
        )
    return tree


@st.composite
def trees(draw):
    n = draw(st.integers(1, 18))
    spec = []
    for i in range(n):
        parent = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        spec.append((parent, draw(st.integers(0, 4)), draw(st.integers(0, 5)), draw(ROLE)))
    return spec


def _replay_unmasked(tree, masked):
    out = {}
    for n in tree.nodes:
        own = 0 if n.call_id in masked else n.n_output
        out[n.call_id] = own + (out[tree.nodes[n.parent].call_id] if n.parent >= 0 else 0)
    return out


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(1, 6), st.integers(0, 10**6))
def test_admission_properties(spec, j_max, seed):
    tree = build(spec)
    config = SelectionConfig(j_max=j_max, seed=seed)
    admitted = select_paths(tree, config)
    trajectories = materialize(tree, admitted, "g")
    assert len(admitted) <= j_max
    assert select_paths(tree, config) == admitted  # reproducible

    rank = {c: i for i, c in enumerate(config.priority)}
    eligible = [n.call_id for n in tree.nodes if not n.children and n.role_class in rank]
    masked: set[str] = set()
    seen: set[tuple[str, int]] = set()
    for a, traj in zip(admitted, trajectories, strict=True):
        unmasked = _replay_unmasked(tree, masked)
        live = [leaf for leaf in eligible if unmasked[leaf] > 0]
        # No lower class while a higher class still has unmasked trainable tokens.
        assert rank[a.role_class] == min(rank[tree.node(leaf).role_class] for leaf in live)
        assert a.leaf_call_id in live and a.role_class != "other"
        assert a.num_targets == unmasked[a.leaf_call_id] == traj.num_targets
        # Targets = exactly the still-unmasked output tokens of the path; each is policy-produced.
        expected_positions = set()
        for node in tree.path(a.leaf_call_id):
            for k in range(node.n_output):
                pos = node.offset + node.n_input + k
                if node.call_id not in masked:
                    expected_positions.add(pos)
                    key = (node.call_id, k)
                    assert key not in seen  # no token is a target twice in one execution
                    seen.add(key)
                    assert traj.behavior_logprobs[pos] == node.output_logprobs[k]
        assert {p for p, m in enumerate(traj.target_mask) if m} == expected_positions
        assert traj.token_ids == tree.path_tokens(a.leaf_call_id).tolist()
        masked.update(a.path)
    if len(admitted) < j_max:  # stopped early: nothing trainable left in any admissible class
        unmasked = _replay_unmasked(tree, masked)
        assert all(unmasked[leaf] == 0 for leaf in eligible)


def test_other_is_excluded_by_default_and_can_be_included():
    tree = build([(None, 2, 3, "other"), (None, 2, 3, "sub/summary")])
    assert [a.leaf_call_id for a in select_paths(tree)] == ["n1"]
    cfg = SelectionConfig(priority=("main/task", "main/summary", "sub/task", "sub/summary", "other"))
    assert [a.leaf_call_id for a in select_paths(tree, cfg)] == ["n1", "n0"]


def test_shared_prefix_is_a_target_once_and_reweights():
    # root a (out 4) -> x (out 1), a -> y (out 2): after x, y's count is 2 (a already fixed in x's targets).
    tree = build([(None, 1, 4, "main/task"), (0, 1, 1, "main/task"), (0, 1, 2, "main/task")])
    admitted = select_paths(tree, SelectionConfig(seed=3))
    assert len(admitted) == 2
    first, second = admitted
    assert "n0" in first.target_calls and "n0" not in second.target_calls
    assert second.num_targets == tree.node(second.leaf_call_id).n_output


def test_stops_at_j_max():
    tree = build([(None, 1, 1, "main/task") for _ in range(9)])
    assert len(select_paths(tree, SelectionConfig(j_max=5))) == 5
    assert len(select_paths(tree, SelectionConfig(j_max=20))) == 9


def test_seeded_per_execution():
    spec = [(None, 1, k + 1, "main/task") for k in range(8)]
    a = [select_paths(build(spec, "e1"), SelectionConfig(seed=s)) for s in range(10)]
    b = [select_paths(build(spec, "e1"), SelectionConfig(seed=s)) for s in range(10)]
    c = [select_paths(build(spec, "e2"), SelectionConfig(seed=s)) for s in range(10)]
    assert a == b
    assert [x.leaf_call_id for r in a for x in r] != [x.leaf_call_id for r in c for x in r]


def test_config_validation():
    with pytest.raises(ValueError, match="j_max"):
        SelectionConfig(j_max=0)
    with pytest.raises(ValueError, match="priority"):
        SelectionConfig(priority=("main/task", "main/task"))


def _chi2(observed: Counter, expected: dict) -> float:
    return sum((observed[k] - e) ** 2 / e for k, e in expected.items())


def test_draws_are_proportional_to_unmasked_counts():
    """Statistical check with fixed seeds: first draw ~ counts; second draw ~ counts after masking (joint law)."""
    # a (out 50) -> x (out 10), a -> y (out 40); z (out 100) separate. Weights: x 60, y 90, z 100.
    tree = build(
        [
            (None, 1, 50, "main/task"),
            (0, 1, 10, "main/task"),
            (0, 1, 40, "main/task"),
            (None, 1, 100, "main/task"),
        ]
    )
    names = {"n1": "x", "n2": "y", "n3": "z"}
    w1 = {"x": 60, "y": 90, "z": 100}
    after = {"x": {"y": 40, "z": 100}, "y": {"x": 10, "z": 100}, "z": {"x": 60, "y": 90}}
    expected_p = {}
    for f, s in itertools.permutations("xyz", 2):
        expected_p[(f, s)] = w1[f] / 250 * after[f][s] / sum(after[f].values())
    trials = 6000
    observed = Counter()
    for seed in range(trials):
        first, second = select_paths(tree, SelectionConfig(j_max=2, seed=seed))
        observed[(names[first.leaf_call_id], names[second.leaf_call_id])] += 1
    chi2 = _chi2(observed, {k: p * trials for k, p in expected_p.items()})
    assert chi2 < 20.5, (chi2, observed)  # 5 degrees of freedom, p = 0.001
    assert set(observed) == set(expected_p)
