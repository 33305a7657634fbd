"""Every cell-fault scenario of the real-process tests (tests/test_cell_loss.py, test_kill9.py, test_launch_ray.py),
played by the simulator against the same policy and cell-health machine: deterministic, in well under a second each.

Each test reads the trace the simulator wrote (the same lines a real run writes) and checks the story: the loss, the
restart, the load of the published weights, the re-form at a burst boundary, and training again; the counters the
trace recomputes equal the policy's own, and every step of the run is done.
"""

from __future__ import annotations

import io

import orjson
import pytest

from gyre_sched.faults import Fault, FaultPlan
from gyre_sched.health import Health
from gyre_sched.sim import Simulator
from gyre_sched.trace import summarize_trace

KEYS = ("cell_lost", "cell_restored", "cell_untrained", "collective_failed", "publish_begin", "publish")


@pytest.fixture
def play(small):
    def run(faults: list[Fault], kind: str = "elastic", phi: float = 1.0, mu: int = 2, **plan) -> tuple:
        """A short run of the small configuration with these faults: (simulator, result, trace lines)."""
        cfg = small(kind, phi, mu, bursts=5, policy={"async_train_cells": 2})
        buf = io.BytesIO()
        sim = Simulator(cfg, trace_stream=buf, deep_checks=True, faults=FaultPlan(faults, **plan))
        result = sim.run()
        lines = [orjson.loads(x) for x in buf.getvalue().splitlines()]
        s = summarize_trace(lines)
        assert result.steps == cfg.steps
        assert (s.d, s.p, s.f, s.x) == tuple(result.counters[k] for k in "dpfx")
        return sim, result, lines

    return run


def story(lines: list[dict], cell: int) -> list[tuple]:
    """The cell's health lines in order: ("cell_lost",), ("cell_restored", trains), ("cell_untrained",)."""
    out = []
    for x in lines:
        if x["ev"] in KEYS[:3] and x["cell"] == cell:
            out.append((x["ev"], x["trains"]) if x["ev"] == "cell_restored" else (x["ev"],))
    return out


def first(lines: list[dict], ev: str, **match) -> dict:
    return next(x for x in lines if x["ev"] == ev and all(x.get(k) == v for k, v in match.items()))


def claims_between(lines: list[dict], cell: int, start: dict, end: dict | None) -> int:
    i, j = lines.index(start), (lines.index(end) if end is not None else len(lines))
    return sum(1 for x in lines[i:j] if x["ev"] == "microstep_claim" and x["cell"] == cell)


def test_a_satellite_killed_at_its_claim_is_restarted_serves_the_published_version_and_trains_after_the_reform(
    play,
):
    sim, _, lines = play([Fault(1, "kill", at_claim=1)])
    assert story(lines, 1) == [("cell_lost",), ("cell_restored", False), ("cell_restored", True)]
    lost, restored = first(lines, "cell_lost"), first(lines, "cell_restored", trains=False)
    rejoined = first(lines, "cell_restored", trains=True)
    published = [x["version"] for x in lines[: lines.index(restored)] if x["ev"] == "publish"]
    assert restored["serves"] == (published[-1] if published else 0)
    assert restored["t"] == pytest.approx(lost["t"] + 30.0 + 3.0)  # restart, then the load
    # The re-form comes at a publication (its boundary), after which the cell claims micro-steps again.
    assert lines[lines.index(rejoined) + 1]["ev"] == "publish"
    assert claims_between(lines, 1, lost, rejoined) == 0 and claims_between(lines, 1, rejoined, None) > 0
    assert sim.policy.health.generation == 1 and sim.policy.lost == set()


def test_a_satellite_stopped_at_a_publication_is_found_by_its_silence_and_restarted_after_the_publication(
    play,
):
    """Found 20 s into a 60 s publication and restarted 30 s later, while it still runs: the load waits for the
    publication's end and takes the version it published (the core refreshed its buffer in place)."""
    _, _, lines = play([Fault(2, "stop", at_publish=2)], silence_s=20.0, restart_s=30.0)
    begin, done = first(lines, "publish_begin", version=2), first(lines, "publish", version=2)
    lost, restored = first(lines, "cell_lost"), first(lines, "cell_restored", trains=False)
    assert lost["t"] == pytest.approx(begin["t"] + 20.0) and lost["t"] + 30.0 < done["t"]
    assert restored["t"] == pytest.approx(done["t"] + 3.0) and restored["serves"] == 2
    assert story(lines, 2)[:2] == [("cell_lost",), ("cell_restored", False)]


def test_a_load_met_by_a_publication_fails_and_loads_the_new_version_after_it(play):
    """CI's 'pulled weight version 4, expected 2': a restarted cell's load under way when a publication starts pulls
    the refreshed buffer and fails; it loads again once that publication is done."""
    _, _, lines = play([Fault(2, "stop", at_publish=2)], silence_s=0.0, restart_s=55.0, load_s=10.0)
    done = first(lines, "publish", version=2)
    restored = first(lines, "cell_restored", trains=False)
    assert restored["t"] == pytest.approx(done["t"] + 10.0) and restored["serves"] == 2


def test_a_satellite_hung_in_the_reduce_is_untrained_at_the_boundary_and_trains_again_after_the_reform(play):
    batch = _batch_of(play([])[2], 1)
    _, _, lines = play([Fault(1, "hang_in_reduce", batch=batch)])
    failed = first(lines, "collective_failed")
    assert (failed["version"], failed["cells"]) == (batch, [1])
    assert story(lines, 1) == [("cell_untrained",), ("cell_restored", True)]
    untrained, rejoined = first(lines, "cell_untrained"), first(lines, "cell_restored", trains=True)
    assert claims_between(lines, 1, untrained, rejoined) == 0 and claims_between(lines, 1, rejoined, None) > 0
    assert not any(x["ev"] == "cell_lost" for x in lines)


def test_a_reform_waits_while_a_restart_is_under_way_then_takes_both_cells(play):
    """Cell 1's reduce hangs in a burst's last batch; cell 2 stops when that burst's publication starts and is still
    loading at its boundary: no re-form there (cell 2 would miss it), cell 1 serves untrained, and the next boundary
    re-forms the world once with both."""
    clean = play([])[2]
    batch = _batch_of(clean, 1, last_of_burst=True)
    sim, _, lines = play([Fault(1, "hang_in_reduce", batch=batch), Fault(2, "stop", at_publish=batch + 1)])
    assert story(lines, 1) == [("cell_untrained",), ("cell_restored", True)]
    assert story(lines, 2) == [("cell_lost",), ("cell_restored", False), ("cell_restored", True)]
    rejoined = [x for x in lines if x["ev"] == "cell_restored" and x["trains"]]
    assert rejoined[0]["t"] == rejoined[1]["t"] and sim.policy.health.generation == 1
    assert rejoined[0]["serves"] > batch + 1


def _batch_of(lines: list[dict], cell: int, last_of_burst: bool = False) -> int:
    """The first batch (its batch_open version) in which `cell` claimed a micro-step; `last_of_burst`: a batch whose
    step is published right after (a burst's last)."""
    published = {x["version"] for x in lines if x["ev"] == "publish"}
    opened, claimed = None, False
    for x in lines:
        if x["ev"] == "batch_open":
            opened, claimed = x["version"], False
        elif x["ev"] == "microstep_claim" and x["cell"] == cell and opened is not None:
            claimed = True
        elif x["ev"] == "step_end" and claimed and (not last_of_burst or opened + 1 in published):
            return opened
    raise AssertionError(f"cell {cell} never claimed")


def test_a_cell_lost_for_good_is_left_out_and_does_not_block_another_cells_rejoin(play):
    sim, _, lines = play([Fault(2, "kill", at_s=100.0), Fault(1, "kill", at_claim=1)], restarts_fail=(2,))
    assert story(lines, 2) == [("cell_lost",)]
    assert story(lines, 1) == [("cell_lost",), ("cell_restored", False), ("cell_restored", True)]
    health = sim.policy.health
    assert health.cells[2].health is Health.GONE and health.cells[1].health is Health.SERVING
    assert sim.policy.roles[2].value == "lost" and sim.policy.trainable() == [0, 1, 3]


def test_a_cell_whose_restarts_are_spent_stays_lost(play):
    sim, _, lines = play([Fault(1, "kill", at_claim=1), Fault(1, "kill", at_s=8000.0)], restarts=1)
    assert story(lines, 1)[:4] == [
        ("cell_lost",),
        ("cell_restored", False),
        ("cell_restored", True),
        ("cell_lost",),
    ]
    assert len(story(lines, 1)) == 4 and sim.policy.health.cells[1].health is Health.GONE


def test_two_cells_lost_together_rejoin_in_one_reform(play):
    sim, _, lines = play([Fault(1, "kill", at_s=1000.0), Fault(2, "kill", at_s=1000.0)])
    for cell in (1, 2):
        assert story(lines, cell) == [("cell_lost",), ("cell_restored", False), ("cell_restored", True)]
    rejoined = [x for x in lines if x["ev"] == "cell_restored" and x["trains"]]
    assert rejoined[0]["t"] == rejoined[1]["t"] and sim.policy.health.generation == 1


def test_a_member_dying_in_the_reform_leaves_the_satellites_untrained_until_the_next_one(play):
    sim, _, lines = play([Fault(1, "kill", at_claim=1), Fault(3, "die_in_reform", generation=1)])
    assert story(lines, 3)[:3] == [("cell_lost",), ("cell_restored", False), ("cell_restored", True)]
    assert story(lines, 2) == [("cell_untrained",), ("cell_restored", True)]  # live, its world failed
    assert story(lines, 1) == [("cell_lost",), ("cell_restored", False), ("cell_restored", True)]
    assert sim.policy.health.generation == 2 and sim.policy.trainable() == [0, 1, 2, 3]


def test_async_keeps_its_split_a_lost_training_satellite_idles_until_it_rejoins(play):
    """Async, cells 0 and 1 train for the whole run: cell 1 killed at its claim is restarted, takes no rollout work
    while its training side is away, and trains again after the re-form."""
    sim, _, lines = play([Fault(1, "kill", at_claim=1)], kind="async", phi=1.0, mu=1)
    assert story(lines, 1) == [("cell_lost",), ("cell_restored", False), ("cell_restored", True)]
    restored, rejoined = (
        first(lines, "cell_restored", trains=False),
        first(lines, "cell_restored", trains=True),
    )
    between = lines[lines.index(restored) : lines.index(rejoined)]
    assert not any(x["ev"] == "launch" and x["engine"] == "cell:1" for x in between)
    assert claims_between(lines, 1, rejoined, None) > 0
    assert sim.policy.roles[1].value == "training"


def test_without_restarts_a_lost_cell_is_gone_and_the_run_trains_on_the_others(play):
    _, result, lines = play([Fault(1, "kill", at_claim=1)], restarts=0)
    assert story(lines, 1) == [("cell_lost",)] and result.role_share["lost"] > 0
    assert claims_between(lines, 1, first(lines, "cell_lost"), None) == 0


def test_the_same_faults_give_the_same_trace(play):
    faults = [Fault(1, "kill", at_claim=2), Fault(2, "stop", at_publish=2)]
    assert play(faults)[2] == play(faults)[2]


@pytest.mark.parametrize(
    "bad",
    [
        dict(cell=0, kind="kill", at_s=1.0),
        dict(cell=1, kind="kill"),
        dict(cell=1, kind="kill", at_s=1.0, at_claim=1),
        dict(cell=1, kind="hang_in_reduce", at_s=1.0),
    ],
)
def test_a_fault_names_a_satellite_and_one_trigger(bad):
    with pytest.raises(ValueError):
        Fault(**bad)
