"""Colocate with streaming: the pool trains ready groups before the burst's last group is ready (stragglers move to a
standalone pool when there is one), never while an execution runs on a colocated cell, and goes back to rollout when a
refill needs it."""

from __future__ import annotations

import io

import orjson
import pytest

from gyre_sched.config import PolicyParams, SimConfig
from gyre_sched.events import (
    Assessed,
    BeginTransition,
    GroupAssigned,
    Launch,
    MicrostepClaimed,
    OpenBatch,
    Publish,
    StepDone,
    TransitionDone,
)
from gyre_sched.policies import make_policy
from gyre_sched.presets import NL2REPO, deep_merge
from gyre_sched.sim import Simulator
from gyre_sched.types import CellRole


def preset_colocate(streaming: bool, steps: int = 12, **over) -> SimConfig:
    raw = deep_merge(
        NL2REPO, {"steps": steps, "policy": {"kind": "colocate", "phi": 0.0, "mu": 4, "streaming": streaming}}
    )
    return SimConfig.model_validate(deep_merge(raw, over))


def traced(cfg: SimConfig):
    buf = io.BytesIO()
    res = Simulator(cfg, trace_stream=buf).run()
    return res, [orjson.loads(x) for x in buf.getvalue().splitlines()]


def cell_load_at_claims(lines) -> tuple[int, int, int]:
    """(claims, claims while an execution ran on a colocated cell, claims while one ran on the standalone pool)."""
    engine: dict[str, str] = {}
    claims = on_cells = on_standalone = 0
    for x in lines:
        if x["ev"] in ("launch", "route"):
            engine[x["execution"]] = x["engine"]
        elif x["ev"] == "terminate":
            engine.pop(x["execution"], None)
        elif x["ev"] == "microstep_claim":
            claims += 1
            on_cells += any(e.startswith("cell:") for e in engine.values())
            on_standalone += any(e == "standalone" for e in engine.values())
    return claims, on_cells, on_standalone


def test_streaming_colocate_is_faster_on_the_preset_and_never_trains_beside_pool_executions():
    plain, plain_lines = traced(preset_colocate(False))
    stream, stream_lines = traced(preset_colocate(True))
    # measured (12 steps): 20.20 h without streaming, 19.84 h with; the pool starts while evaluations finish
    assert stream.end_time_s < 0.99 * plain.end_time_s, (stream.end_time_s, plain.end_time_s)
    assert stream.staleness == plain.staleness  # the same groups at the same versions: only the timing moved
    for lines in (plain_lines, stream_lines):
        claims, on_cells, _ = cell_load_at_claims(lines)
        assert claims > 0 and on_cells == 0
    # with streaming the first claim of a burst comes before the burst's last group is ready
    first_claim = next(x["t"] for x in stream_lines if x["ev"] == "microstep_claim")
    ready = [x["t"] for x in stream_lines if x["ev"] == "group_ready"]
    assert first_claim < sorted(ready)[4 * 32 - 1]


def test_with_a_standalone_pool_stragglers_move_there_while_the_pool_trains():
    over = {"cluster": {"standalone_nodes": 4}}
    plain, _ = traced(preset_colocate(False, **over))
    stream, lines = traced(preset_colocate(True, **over))
    assert stream.end_time_s < plain.end_time_s
    claims, on_cells, on_standalone = cell_load_at_claims(lines)
    assert on_cells == 0 and on_standalone > claims // 10  # trained while stragglers ran beside it
    moved = [x for x in lines if x["ev"] == "route" and x["engine"] == "standalone"]
    assert moved  # stragglers were rerouted off the cells when the pool switched


def test_a_refill_during_training_sends_the_pool_back_and_the_batch_completes(driver):
    p = PolicyParams(kind="colocate", K=2, C_e=2, N=2, B=2, phi=0.0, mu=1, streaming=True, rho_min=0.5)
    d = driver(make_policy(p, deep_checks=True))
    assert [x.spec.execution_id for x in d.of(Launch)] == ["g0.e0", "g0.e1", "g1.e0", "g1.e1"]
    d.finish("g0.e0")
    d.finish("g0.e1")  # g0 ready
    d.finish("g1.e0")
    d.finish("g1.e1", status=None)  # terminated; its evaluation is still running
    assert [b.cell for b in d.of(BeginTransition)] == [0, 1]  # nothing runs and one group is ready: switch
    d.finish_transitions()
    assert d.of(OpenBatch) and all(r is CellRole.TRAINING for r in d.policy.roles)
    d.send(GroupAssigned("g0"))
    d.send(MicrostepClaimed(0, "g0"))
    d.send(Assessed("g1.e1", "excluded"))  # g1 drops; its refill g2 needs rollout capacity the pool holds
    back = [b for b in d.of(BeginTransition) if b.to_role is CellRole.TO_ROLLOUT]
    assert [b.cell for b in back] == [0, 1] and d.policy.batch is not None  # the batch stays open
    assert not d.of(Publish)
    d.send(TransitionDone(0))
    d.send(TransitionDone(1))
    d.switching.clear()
    refill = [x.spec.execution_id for x in d.of(Launch)][4:]
    assert refill == ["g2.e0", "g2.e1"]
    d.finish("g2.e0")
    d.finish("g2.e1")
    assert [b.cell for b in d.of(BeginTransition)][-2:] == [0, 1]  # the pool switches again
    d.finish_transitions()
    assert len(d.of(OpenBatch)) == 1  # the same batch continues
    d.send(GroupAssigned("g2"))
    d.send(MicrostepClaimed(1, "g2"))
    d.send(StepDone(1))
    d.finish_transitions()  # the satellite returns at burst end, then the core publishes
    assert d.policy.staleness == [0, 0] and [x.version for x in d.of(Publish)] == [1]


@pytest.mark.parametrize("streaming", [False, True])
def test_colocate_staleness_matches_eq2(small, streaming):
    res = Simulator(small("colocate", 0.0, 3, policy={"streaming": streaming})).run()
    assert res.mean_staleness_steady == pytest.approx(1.0, abs=0.02)
