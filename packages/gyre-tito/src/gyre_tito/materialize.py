"""Materialize admitted paths into ``Trajectory`` objects (docs/design/tito.md#provenance-mask-and-selection, docs/design/training.md#buffers).

API summary
-----------
- ``materialize(tree, admitted, group_id) -> list[Trajectory]``: one trajectory per ``AdmittedPath``; only the
  admitted paths are expanded, straight from the nodes' shared token arrays (candidates stay in the tree).
- ``select_trajectories(tree, group_id, config=None) -> list[Trajectory]``: ``select_paths`` + ``materialize``.
- ``placeholder_trajectory(execution_id, group_id) -> Trajectory``: the zero-reward stand-in for an execution whose
  assessment is ``no_work`` (no tokens, no targets, ``placeholder=True``; the trainer counts it as a valid zero).

A trajectory's ``token_ids`` are its path's tokens (each node's incremental input then its output), ``target_mask`` is 1
exactly on the output tokens of the path's ``target_calls``, ``behavior_logprobs`` holds the recorded log-prob there and
0.0 elsewhere, and ``weight_versions`` has one span per output segment of every node on the path (adjacent spans with the
same engine and version merged), so each target token's sampling engine and weight version can be looked up.
``temperatures`` holds, on each target token, the temperature its call was sampled at (the proxy records it in
``metadata["sampling"]["used"]``; a harness may change it from call to call under the ``pass`` policy), so the
trainer computes every token's log-prob at its own temperature; None when a target call recorded none.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from gyre_tito.selection import AdmittedPath, SelectionConfig, select_paths
from gyre_tito.tree import TOKEN_TYPECODE, ExecutionTree
from gyre_tito.types import RoleClass, Trajectory, WeightSpan

__all__ = [
    "materialize",
    "materialize_path",
    "placeholder_trajectory",
    "recorded_temperature",
    "select_trajectories",
]


def materialize_path(tree: ExecutionTree, admitted: AdmittedPath, group_id: str) -> Trajectory:
    path = tree.path(admitted.leaf_call_id)
    if tuple(n.call_id for n in path) != admitted.path:
        raise ValueError(f"admitted path of {admitted.leaf_call_id!r} does not match the tree")
    targets = set(admitted.target_calls)
    total = path[-1].end
    tokens = array(TOKEN_TYPECODE)
    mask = bytearray(total)
    logprobs = array("d", bytes(8 * total))  # zeros
    temperatures: array | None = array("d", bytes(8 * total))
    spans: list[WeightSpan] = []
    for n in path:
        tokens.extend(n.tokens)
        out_start = n.offset + n.n_input
        if n.call_id in targets:
            mask[out_start : n.end] = b"\x01" * n.n_output
            logprobs[out_start : n.end] = n.output_logprobs
            used = recorded_temperature(n.metadata)
            if used is None:
                temperatures = None
            elif temperatures is not None:
                temperatures[out_start : n.end] = array("d", [used] * n.n_output)
        for seg in n.output_segments:
            start, end = out_start + seg.start, out_start + seg.end
            last = spans[-1] if spans else None
            if (
                last
                and last.end == start
                and (last.engine_id, last.weight_version) == (seg.engine_id, seg.weight_version)
            ):
                spans[-1] = WeightSpan(
                    start=last.start, end=end, engine_id=seg.engine_id, weight_version=seg.weight_version
                )
            else:
                spans.append(
                    WeightSpan(
                        start=start, end=end, engine_id=seg.engine_id, weight_version=seg.weight_version
                    )
                )
    leaf = path[-1]
    return Trajectory(
        execution_id=tree.execution_id,
        group_id=group_id,
        index=admitted.index,
        leaf_call_id=leaf.call_id,
        agent_id=leaf.agent_id,
        role_class=admitted.role_class,
        token_ids=tokens.tolist(),
        target_mask=list(mask),
        behavior_logprobs=logprobs.tolist(),
        weight_versions=spans,
        temperatures=temperatures.tolist() if temperatures is not None else None,
    )


def recorded_temperature(metadata: dict) -> float | None:
    """The temperature a call was sampled at, as the proxy recorded it (None for records without it)."""
    used = (metadata.get("sampling") or {}).get("used") or {}
    value = used.get("temperature")
    return float(value) if isinstance(value, int | float) and value > 0 else None


def materialize(tree: ExecutionTree, admitted: Sequence[AdmittedPath], group_id: str) -> list[Trajectory]:
    return [materialize_path(tree, a, group_id) for a in admitted]


def select_trajectories(
    tree: ExecutionTree, group_id: str, config: SelectionConfig | None = None
) -> list[Trajectory]:
    """Admit up to ``j_max`` paths of ``tree`` and materialize them."""
    return materialize(tree, select_paths(tree, config), group_id)


def placeholder_trajectory(
    execution_id: str, group_id: str, role_class: RoleClass = "main/task"
) -> Trajectory:
    """Zero-reward stand-in for an execution with no assessable work (``no_work``): no tokens, no targets."""
    return Trajectory(
        execution_id=execution_id,
        group_id=group_id,
        index=0,
        leaf_call_id=None,
        agent_id=None,
        role_class=role_class,
        token_ids=[],
        target_mask=[],
        behavior_logprobs=[],
        weight_versions=[],
        placeholder=True,
    )
