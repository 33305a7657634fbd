"""Materialization of admitted paths: tokens, aligned targets/log-probs, weight-version spans, placeholder."""

from __future__ import annotations

import pytest

from gyre_tito.materialize import materialize_path, placeholder_trajectory, select_trajectories
from gyre_tito.selection import AdmittedPath, SelectionConfig, select_paths
from gyre_tito.testing.synthetic import make_record
from gyre_tito.tree import ExecutionTree
from gyre_tito.types import OutputSegment, WeightSpan


def _tree() -> ExecutionTree:
    tree = ExecutionTree("ex")
    tree.add(
        make_record(
            call_id="a",
            seq=0,
            input_ids=[1, 2],
            output_ids=[3, 4, 5],
            output_logprobs=[-0.1, -0.2, -0.3],
            weight_version="7",
        )
    )
    # A retried call: two engines and versions serve one output.
    segs = [
        OutputSegment(engine_id="e1", weight_version="7", start=0, end=1),
        OutputSegment(engine_id="e2", weight_version="8", start=1, end=3),
    ]
    tree.add(
        make_record(
            call_id="b",
            seq=1,
            parent_id="a",
            input_ids=[6],
            output_ids=[7, 8, 9],
            output_logprobs=[-1.0, -2.0, -3.0],
            segments=segs,
        )
    )
    tree.add(
        make_record(
            call_id="c",
            seq=2,
            parent_id="a",
            input_ids=[10],
            output_ids=[11],
            output_logprobs=[-4.0],
            engine_id="engine-0",
            weight_version="7",
        )
    )
    return tree


def test_materialized_path_is_exact():
    tree = _tree()
    a = AdmittedPath(
        index=0,
        leaf_call_id="b",
        role_class="main/task",
        path=("a", "b"),
        target_calls=("a", "b"),
        num_targets=6,
    )
    t = materialize_path(tree, a, "g1")
    assert t.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert t.target_mask == [0, 0, 1, 1, 1, 0, 1, 1, 1]
    assert t.behavior_logprobs == [0.0, 0.0, -0.1, -0.2, -0.3, 0.0, -1.0, -2.0, -3.0]
    assert t.weight_versions == [
        WeightSpan(start=2, end=5, engine_id="engine-0", weight_version="7"),
        WeightSpan(start=6, end=7, engine_id="e1", weight_version="7"),
        WeightSpan(start=7, end=9, engine_id="e2", weight_version="8"),
    ]
    assert (t.execution_id, t.group_id, t.leaf_call_id, t.role_class, t.index) == (
        "ex",
        "g1",
        "b",
        "main/task",
        0,
    )


def test_prefix_already_fixed_is_context_in_the_second_trajectory():
    tree = _tree()
    trajs = select_trajectories(tree, "g", SelectionConfig(seed=0))
    assert len(trajs) == 2
    first, second = trajs
    # all outputs on its path (inputs: 3 tokens)
    assert first.num_targets == tree.path_len(first.leaf_call_id) - 3
    # The shared node `a` was fixed in the first trajectory: in the second it is context (mask 0, logprob 0.0).
    assert second.target_mask[2:5] == [0, 0, 0] and second.behavior_logprobs[2:5] == [0.0, 0.0, 0.0]
    assert second.num_targets == tree.node(second.leaf_call_id).n_output
    # Spans are merged when adjacent with the same engine/version, and still cover non-target outputs.
    if second.leaf_call_id == "c":
        assert second.weight_versions == [
            WeightSpan(start=2, end=5, engine_id="engine-0", weight_version="7"),
            WeightSpan(start=6, end=7, engine_id="engine-0", weight_version="7"),
        ]


def test_mismatched_admission_is_refused():
    tree = _tree()
    bad = AdmittedPath(
        index=0, leaf_call_id="b", role_class="main/task", path=("b",), target_calls=("b",), num_targets=3
    )
    with pytest.raises(ValueError, match="does not match"):
        materialize_path(tree, bad, "g")


def test_empty_tree_and_placeholder():
    assert select_paths(ExecutionTree("ex")) == []
    p = placeholder_trajectory("ex", "g")
    assert p.placeholder and p.token_ids == [] and p.num_targets == 0 and p.leaf_call_id is None


def _sampled(record, temperature):
    """The record as the proxy writes it: the temperature the call was sampled at in its metadata."""
    used = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "max_tokens": 8}
    return record.model_copy(update={"metadata": {"sampling": {"policy": "pass", "used": used}}})


def test_each_target_token_carries_its_calls_recorded_temperature():
    tree = ExecutionTree("ex")
    tree.add(_sampled(make_record(call_id="a", input_ids=[1, 2], output_ids=[3, 4]), 0.5))
    tree.add(_sampled(make_record(call_id="b", seq=1, parent_id="a", input_ids=[5], output_ids=[6]), 1.5))
    both = AdmittedPath(
        index=0,
        leaf_call_id="b",
        role_class="main/task",
        path=("a", "b"),
        target_calls=("a", "b"),
        num_targets=3,
    )
    assert materialize_path(tree, both, "g").temperatures == [0.0, 0.0, 0.5, 0.5, 0.0, 1.5]
    leaf_only = AdmittedPath(
        index=0, leaf_call_id="b", role_class="main/task", path=("a", "b"), target_calls=("b",), num_targets=1
    )
    assert materialize_path(tree, leaf_only, "g").temperatures == [0.0] * 5 + [1.5]
    # a target call without a recorded temperature (an older store): none for the trajectory, the trainer uses
    # the run's temperature
    assert _tree_path_temperatures() is None


def _tree_path_temperatures():
    tree = _tree()
    path = AdmittedPath(
        index=0,
        leaf_call_id="b",
        role_class="main/task",
        path=("a", "b"),
        target_calls=("a", "b"),
        num_targets=6,
    )
    return materialize_path(tree, path, "g").temperatures


def test_recorded_temperatures_are_validated():
    t = placeholder_trajectory("ex", "g")
    ok = dict(
        t.model_dump(),
        placeholder=False,
        leaf_call_id="a",
        token_ids=[1, 2],
        target_mask=[0, 1],
        behavior_logprobs=[0.0, -0.5],
        weight_versions=[{"start": 1, "end": 2, "engine_id": "e", "weight_version": "0"}],
    )
    assert type(t).model_validate(ok | {"temperatures": [0.0, 0.7]}).temperatures == [0.0, 0.7]
    for bad in ([0.0, 0.0], [0.0, -1.0], [1.0, 0.7], [0.7]):
        with pytest.raises(ValueError, match="temperatures"):
            type(t).model_validate(ok | {"temperatures": bad})
