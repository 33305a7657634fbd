"""Provenance mask and J_max trajectory admission (docs/design/tito.md#provenance-mask-and-selection, paper Equation 7).

API summary
-----------
- ``SelectionConfig(j_max=5, priority=ROLE_PRIORITY, seed=0)``.
- ``select_paths(tree, config) -> list[AdmittedPath]``: the admitted root-to-leaf paths of one execution, in draw order.
  ``AdmittedPath(index, leaf_call_id, role_class, path, target_calls, num_targets)``: ``path`` = call ids root -> leaf;
  ``target_calls`` = the calls on the path whose output tokens are this trajectory's targets.
- ``trainable_count(node)``: a node's trainable tokens (its recorded output tokens).

Rules (exactly docs/design/tito.md#provenance-mask-and-selection):

- Trainable tokens are the tokens our engines sampled: each node's recorded output tokens (they carry behaviour
  log-probs). Input tokens are context only, including input tokens whose provenance is ``policy`` (recorded outputs the
  proxy spliced into a context other than the one they were sampled in: their log-probs belong to that other context).
- A candidate is a leaf (a node without children) with its root path; its class is the leaf node's ``role_class``.
- Start from the provenance mask (every trainable token unmasked). Repeat: take the first class in ``priority`` that
  has a leaf with unmasked trainable tokens; draw one such leaf with probability proportional to its unmasked trainable
  count; its targets are the still-unmasked trainable tokens on its path; mask its whole root-to-leaf path. Stop after
  ``j_max`` admissions or when no listed class has unmasked trainable tokens. Classes not in ``priority`` (by default
  ``other``) are never admitted. Each token is a target at most once per execution.
- Masking is per whole path, so a node is either entirely masked or not; counts are kept per node.
- Reproducible: draws use ``random.Random`` seeded from ``(config.seed, execution_id)`` (SHA-256, not Python's salted
  hash), so an execution's selection does not depend on which other executions were selected before it.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from gyre_tito.tree import ExecutionTree, TreeNode
from gyre_tito.types import ROLE_CLASSES, ROLE_PRIORITY, RoleClass

__all__ = ["AdmittedPath", "SelectionConfig", "execution_rng", "select_paths", "trainable_count"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectionConfig:
    j_max: int = 5
    """most trajectories admitted per execution"""
    priority: tuple[RoleClass, ...] = ROLE_PRIORITY
    """role classes in admission order; classes not listed (default: ``other``) are never admitted"""
    seed: int = 0
    """base seed; each execution draws from a stream derived from (seed, execution_id)"""

    def __post_init__(self) -> None:
        if self.j_max < 1:
            raise ValueError(f"j_max must be at least 1, got {self.j_max}")
        unknown = [c for c in self.priority if c not in ROLE_CLASSES]
        if unknown or len(set(self.priority)) != len(self.priority):
            raise ValueError(f"priority must list distinct classes of {ROLE_CLASSES}, got {self.priority}")


@dataclass(frozen=True, slots=True)
class AdmittedPath:
    index: int
    """admission order within the execution (0 = first drawn)"""
    leaf_call_id: str
    role_class: RoleClass
    path: tuple[str, ...]
    """call ids from the root down to the leaf"""
    target_calls: tuple[str, ...]
    """calls on the path whose output tokens are targets of this trajectory (unmasked at the draw)"""
    num_targets: int


def trainable_count(node: TreeNode) -> int:
    """Trainable tokens of one node: its recorded output tokens (sampled by our engines)."""
    return node.n_output


def execution_rng(seed: int, execution_id: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}\x00{execution_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def select_paths(tree: ExecutionTree, config: SelectionConfig | None = None) -> list[AdmittedPath]:
    """Admit at most ``config.j_max`` root-to-leaf paths of ``tree`` (rules in the module docstring)."""
    config = config or SelectionConfig()
    # A snapshot: the proxy may append while an execution is exported; nodes only ever get appended, parents first,
    # so a prefix of the node list is a consistent tree (leaves are computed within it).
    nodes = list(tree.nodes)
    rng = execution_rng(config.seed, tree.execution_id)
    masked = [False] * len(nodes)
    rank = {c: i for i, c in enumerate(config.priority)}
    has_child = [False] * len(nodes)
    for n in nodes:
        if n.parent >= 0:
            has_child[n.parent] = True
    leaves = [
        n.index for n in nodes if not has_child[n.index] and n.role_class in rank
    ]  # add order: deterministic
    admitted: list[AdmittedPath] = []
    while len(admitted) < config.j_max:
        # unmasked[i] = unmasked trainable tokens on the root path of node i (parents precede children).
        unmasked = [0] * len(nodes)
        for n in nodes:
            own = 0 if masked[n.index] else trainable_count(n)
            unmasked[n.index] = own + (unmasked[n.parent] if n.parent >= 0 else 0)
        live = [i for i in leaves if unmasked[i] > 0]
        if not live:
            break
        best = min(rank[nodes[i].role_class] for i in live)
        candidates = [i for i in live if rank[nodes[i].role_class] == best]
        leaf = _draw(rng, candidates, [unmasked[i] for i in candidates])
        path = tree.path(nodes[leaf].call_id)
        targets = tuple(n.call_id for n in path if not masked[n.index] and trainable_count(n) > 0)
        for n in path:
            masked[n.index] = True
        admitted.append(
            AdmittedPath(
                index=len(admitted),
                leaf_call_id=nodes[leaf].call_id,
                role_class=nodes[leaf].role_class,
                path=tuple(n.call_id for n in path),
                target_calls=targets,
                num_targets=unmasked[leaf],
            )
        )
    return admitted


def _draw(rng: random.Random, items: list[int], weights: list[int]) -> int:
    """One item with probability weight / sum(weights) (exact integer arithmetic)."""
    r = rng.randrange(sum(weights))
    for item, w in zip(items, weights, strict=True):
        if r < w:
            return item
        r -= w
    raise AssertionError("unreachable: r < sum(weights)")
