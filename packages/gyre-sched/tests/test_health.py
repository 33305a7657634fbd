"""The cell-health state machine alone (gyre_sched.health): each transition and the interleavings real runs met."""

from __future__ import annotations

import pytest

from gyre_sched.errors import InvariantError
from gyre_sched.events import (
    CellGone,
    CellRestored,
    CellUntrained,
    CompletePublish,
    LoadWeights,
    ReformWorld,
    RejoinRefused,
    RestartCell,
)
from gyre_sched.health import CellHealth, Health
from gyre_sched.types import CellRole

R, T, L = CellRole.ROLLOUT, CellRole.TRAINING, CellRole.LOST


def restored(h: CellHealth, cell: int, version: int = 0) -> None:
    assert h.lost(cell) == [RestartCell(cell)]
    assert h.restarted(cell, publishing=False, published=version) == [LoadWeights(cell, version)]
    assert h.weights_loaded(cell, version, publishing=False, published=version) == [
        CellRestored(cell, False, version)
    ]


def test_a_lost_cell_is_restarted_loads_and_serves_untrained_then_rejoins_at_a_boundary():
    h = CellHealth(3, restarts=True)
    assert h.lost(2) == [RestartCell(2)] and h.lost(2) == []  # reported twice: once
    assert h.down == {2} and h.restarting() == {2}
    assert h.restarted(2, publishing=False, published=4) == [LoadWeights(2, 4)]
    assert h.cells[2].health is Health.LOADING and h.down == {2}
    assert h.weights_loaded(2, 4, publishing=False, published=4) == [CellRestored(2, False, 4)]
    assert h.down == set() and h.of(Health.UNTRAINED) == {2}
    assert h.boundary(5, [T, R, R], trains_through=False) == [ReformWorld(1, (2,), None)]
    assert h.reforming
    assert h.world_formed(1) == [CellRestored(2, True, 5), CompletePublish(5)]
    assert h.cells[2].health is Health.SERVING and h.generation == 1 and not h.reforming


def test_without_restarts_a_lost_cell_is_gone_and_later_worlds_leave_it_out():
    h = CellHealth(3)
    assert h.lost(1) == [CellGone(1, "no restarts in this run")]
    h.restarts = True
    restored(h, 2)
    assert h.boundary(1, [T, L, R], trains_through=False) == [ReformWorld(1, (2,), (0, 2))]


def test_a_restart_that_finishes_during_a_publication_loads_after_it():
    h = CellHealth(2, restarts=True)
    h.lost(1)
    assert h.restarted(1, publishing=True, published=2) == []  # the core refreshes its buffer meanwhile
    assert h.publish_done(3) == [LoadWeights(1, 3)] and h.publish_done(3) == []


def test_a_load_that_finishes_during_a_publication_loads_again_after_it():
    h = CellHealth(2, restarts=True)
    h.lost(1)
    h.restarted(1, publishing=False, published=2)
    assert h.weights_loaded(1, 2, publishing=True, published=2) == []
    assert h.cells[1].health is Health.LOADING and h.publish_done(3) == [LoadWeights(1, 3)]
    assert h.weights_loaded(1, 3, publishing=False, published=3) == [CellRestored(1, False, 3)]


def test_a_failed_load_is_tried_again_after_a_moved_publication_or_a_back_off_and_at_most_three_times():
    h = CellHealth(2, restarts=True)
    h.lost(1)
    h.restarted(1, publishing=False, published=2)
    # CI's "pulled weight version 4, expected 2": the publication moved on before it was heard of.
    assert h.load_failed(1, 2, "pulled 4", publishing=False, published=3) == [LoadWeights(1, 3, 0.0)]
    assert h.load_failed(1, 3, "refused", publishing=False, published=3) == [LoadWeights(1, 3, 2.0)]
    (gone,) = h.load_failed(1, 3, "refused", publishing=False, published=3)
    assert isinstance(gone, CellGone) and h.cells[1].health is Health.GONE


def test_a_served_version_other_than_the_published_one_counts_as_a_failed_load():
    h = CellHealth(2, restarts=True, load_attempts=1)
    h.lost(1)
    h.restarted(1, publishing=False, published=2)
    (gone,) = h.weights_loaded(1, 1, publishing=False, published=2)
    assert isinstance(gone, CellGone) and "serves version 1" in gone.reason


def test_a_failed_collective_untrains_its_satellites_at_the_next_boundary_once_they_are_back_in_rollout():
    h = CellHealth(3)
    h.collective_failed([1, 2])
    assert h.boundary(1, [T, T, R], trains_through=False) == [CompletePublish(1)]  # cell 1 still switches
    assert h.cells[1].unformed and h.cells[1].health is Health.SERVING
    assert h.boundary(2, [T, R, R], trains_through=False) == [
        CellUntrained(1),
        CellUntrained(2),
        ReformWorld(1, (1, 2), None),
    ]
    assert h.world_failed(1) == [CompletePublish(2)]  # both untrained already
    assert h.of(Health.UNTRAINED) == {1, 2}


def test_under_async_a_training_satellite_reforms_from_training():
    h = CellHealth(3)
    h.collective_failed([1])
    assert h.boundary(1, [T, T, R], trains_through=True) == [CellUntrained(1), ReformWorld(1, (1,), None)]


def test_a_failed_reform_untrains_every_live_satellite_and_the_next_boundary_takes_them_all():
    h = CellHealth(4, restarts=True)
    restored(h, 1)
    h.boundary(3, [T, R, R, R], trains_through=False)
    assert h.lost(3) == [RestartCell(3)]  # it died in the rendezvous: reported before the failure
    assert h.world_failed(1) == [CellUntrained(2), CompletePublish(3)]
    assert h.boundary(4, [T, R, R, L], trains_through=False) == [CompletePublish(4)]  # cell 3 restarts
    h.restarted(3, publishing=False, published=4)
    h.weights_loaded(3, 4, publishing=False, published=4)
    assert h.boundary(5, [T, R, R, R], trains_through=False) == [ReformWorld(2, (1, 2, 3), None)]


def test_a_run_whose_backend_cannot_reform_says_so_once_and_keeps_restored_cells_untrained():
    h = CellHealth(2, restarts=True, rejoin_refused="megatron PP=2")
    restored(h, 1)
    assert h.boundary(1, [T, R], trains_through=False) == [
        RejoinRefused((1,), "megatron PP=2"),
        CompletePublish(1),
    ]
    assert h.boundary(2, [T, R], trains_through=False) == [CompletePublish(2)]


def test_reports_out_of_turn_are_invariant_errors():
    h = CellHealth(2, restarts=True)
    with pytest.raises(InvariantError, match="restarted while serving"):
        h.restarted(1, publishing=False, published=0)
    with pytest.raises(InvariantError, match="none under way"):
        h.world_formed(1)
    restored(h, 1)
    h.boundary(1, [T, R], trains_through=False)
    with pytest.raises(InvariantError, match="re-forms"):
        h.publish_done(1)  # the publication completes only after the boundary's re-form
    with pytest.raises(InvariantError, match="generation 2"):
        h.world_failed(2)
