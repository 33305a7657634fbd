"""The metrics sink: TensorBoard event files read back with tensorboard's own reader, wandb when configured, the
interval metrics, and the progress bar. (A real demo run's event files are checked in tests/test_dashboard.py.)"""

from __future__ import annotations

import io
import json
import logging
import math
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gyre.observe import progress
from gyre.observe.metrics import INTERVAL_TAGS, STEP_TAGS, MetricsSink, interval_scalars, step_scalars
from gyre.observe.progress import Progress, format_duration
from gyre.observe.rundata import Call, percentile, time_unit


def row(version: int, **over) -> dict:
    """A steps.jsonl row as the controller writes it (gyre-cell's StepReport + reward, cells, t)."""
    metrics = {
        "clip_frac_all": 0.25,
        "clip_frac_d0": 0.0,
        "clip_frac_pos": 0.5,
        "clip_frac_neg": 0.125,
        "mean_log_ratio_d0": -0.001,
        "ratio_dev_mean": 0.01,
        "ratio_dev_max": 0.03,
        "capped_frac": 0.0625,
        "weight_mean": 1.0005,
        "weight_max": 1.3,
        "lr": 1e-4 * version,
    }
    if version > 1:  # from the second step on, groups of staleness 1 exist
        metrics |= {"clip_frac_d1": 0.5, "mean_log_ratio_dpos": -0.005}
    base = {
        "schema_version": 1,
        "step": version - 1,
        "policy_version": version,
        "loss": -0.3 * version,
        "surrogate": -0.05 * version,
        "grad_norm": 0.7 + version,
        "num_groups": 2,
        "num_executions": 8,
        "num_target_tokens": 256 - version,
        "num_microsteps": 8,
        "microsteps_by_cell": {"0": 5, "1": 3} if version == 1 else {"0": 8},
        "group_ids": ["g0", "g1"],
        "staleness": [0, version - 1],
        "metrics": metrics,
        "seconds": 1.5,
        "mean_reward": 0.1 * version,
        "reward_std": 0.02 * version,
        "training_cells": 2 if version == 1 else 1,
        "t": 7.5 * version,
    }
    return base | over


def test_step_scalars_cover_every_tag_and_mark_undefined_ones_nan():
    first = step_scalars(row(1), cells=3)
    assert set(STEP_TAGS) <= set(first)
    assert first["reward/mean"] == pytest.approx(0.1) and first["reward/std"] == pytest.approx(0.02)
    assert first["clip/frac_pos_adv"] == 0.5 and first["clip/frac_neg_adv"] == 0.125
    assert first["is/w_max"] == 1.3 and first["is/capped_frac"] == 0.0625
    assert first["staleness/mean"] == 0.0 and first["staleness/max"] == 0.0
    # no token at d > 0 in the first step: nothing to measure
    assert math.isnan(first["is/mean_l_minus_b_dpos"])
    assert "clip/frac_d1" not in first
    # every cell has a micro-step count, 0 for one that claimed none
    assert (first["microsteps/cell0"], first["microsteps/cell1"], first["microsteps/cell2"]) == (5, 3, 0)
    assert first["microsteps/total"] == 8
    second = step_scalars(row(2), cells=3)
    assert second["clip/frac_d1"] == 0.5 and second["is/mean_l_minus_b_dpos"] == -0.005
    assert second["staleness/mean"] == 0.5 and second["microsteps/cell1"] == 0
    assert math.isnan(step_scalars(row(3, mean_reward=None), cells=2)["reward/mean"])


def test_interval_scalars_from_state_and_recorded_calls():
    calls = [Call("e", i, 10, 20 + i, request_at=100.0, end_at=100.0 + 0.1 * (i + 1)) for i in range(10)]
    state = {
        "running": 3,
        "queued": 5,
        "waterlevel": 8,
        "capacity": 4,
        "roles": ["training", "to_rollout", "rollout", "rollout"],
    }
    s = interval_scalars(state, calls, seconds=2.0)
    assert set(s) == set(INTERVAL_TAGS)
    assert s["rollout/tokens_per_s"] == sum(20 + i for i in range(10)) / 2.0
    assert s["proxy/latency_p50_s"] == pytest.approx(0.5) and s["proxy/latency_p99_s"] == pytest.approx(1.0)
    assert (s["cells/share_rollout"], s["cells/share_training"], s["cells/share_switching"]) == (
        0.5,
        0.25,
        0.25,
    )
    assert (s["executions/running"], s["executions/queued"], s["scheduler/waterlevel"]) == (3, 5, 8)
    empty = interval_scalars(state, [], seconds=2.0)
    assert empty["rollout/tokens_per_s"] == 0.0 and math.isnan(empty["proxy/latency_p99_s"])
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0], 99) == 1.0


def test_event_files_hold_every_scalar_for_every_step(tmp_path):
    (tmp_path / "metrics").mkdir()
    sink = MetricsSink(tmp_path, cells=2)
    rows = [row(v) for v in (1, 2, 3)]
    for r in rows:
        sink.step(r)
    state = {"running": 2, "queued": 1, "waterlevel": 3, "capacity": 8, "roles": ["rollout", "training"]}
    sink.interval(2.0, state, [Call("e", 0, 5, 32, 10.0, 10.5)], 2.0)
    sink.interval(4.0, state | {"running": 0}, [], 2.0)
    sink.switches([{"total_s": 0.12}, {"total_s": 0.05}])
    sink.publishes([{"version": 1, "total_s": 0.02, "core_s": 0.001}])
    sink.publishes(
        [{"version": 1, "total_s": 0.02, "core_s": 0.001}, {"version": 2, "total_s": 0.03, "core_s": 0.002}]
    )
    sink.close()

    acc = EventAccumulator(str(tmp_path / "metrics"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in [*STEP_TAGS, "microsteps/cell0", "microsteps/cell1"]:
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3], tag
    assert [e.value for e in acc.Scalars("loss/loss")] == pytest.approx([-0.3, -0.6, -0.9])
    assert [e.value for e in acc.Scalars("optim/grad_norm")] == pytest.approx([1.7, 2.7, 3.7])
    assert [e.value for e in acc.Scalars("optim/lr")] == pytest.approx([1e-4, 2e-4, 3e-4])
    assert [e.value for e in acc.Scalars("microsteps/cell1")] == [3, 0, 0]
    assert [e.step for e in acc.Scalars("clip/frac_d1")] == [2, 3]
    dpos = [e.value for e in acc.Scalars("is/mean_l_minus_b_dpos")]
    assert math.isnan(dpos[0]) and dpos[1:] == pytest.approx([-0.005, -0.005])
    for tag in INTERVAL_TAGS:
        assert [e.step for e in acc.Scalars(tag)] == [2, 4], tag
    assert [e.value for e in acc.Scalars("executions/running")] == [2, 0]
    assert [e.value for e in acc.Scalars("rollout/tokens_per_s")] == [16, 0]
    assert [e.step for e in acc.Scalars("switch/total_s")] == [1, 2]
    assert [e.step for e in acc.Scalars("publish/total_s")] == [1, 2]  # each publication once


def test_wandb_when_installed_and_configured(tmp_path, monkeypatch):
    calls: list[tuple] = []

    class FakeRun:
        def define_metric(self, name, step_metric=None):
            calls.append(("define", name, step_metric))

        def log(self, data):
            calls.append(("log", data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    (tmp_path / "metrics").mkdir()
    sink = MetricsSink(tmp_path, cells=2, tensorboard=False, wandb_project="gyre-test", config={"a": 1})
    sink.step(row(1))
    sink.close()
    init_kwargs = calls[0][1]
    assert init_kwargs["project"] == "gyre-test" and init_kwargs["config"] == {"a": 1}
    assert ("define", "reward/*", "step") in calls and ("define", "scheduler/*", "time_s") in calls
    logged = next(c[1] for c in calls if c[0] == "log")
    assert logged["step"] == 1 and logged["loss/loss"] == pytest.approx(-0.3)
    assert "is/mean_l_minus_b_dpos" not in logged  # NaN (undefined) is left out of wandb
    assert calls[-1] == ("finish",)
    assert not list((tmp_path / "metrics").glob("events.out.tfevents.*"))

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: TensorBoard only, with a warning
    sink = MetricsSink(tmp_path, cells=2, wandb_project="gyre-test")
    assert sink.wandb is None and sink.tb is not None
    sink.close()


def test_progress_bar_text_json_and_quiet():
    out = io.StringIO()
    bar = Progress(out, "text", tty=False)
    bar.update(0, 4, 3.0, None)
    bar.update(0, 4, 5.0, None)  # same step: no new line off a terminal
    bar.update(1, 4, 20.0, 0.125)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "step 1/4" in lines[1] and "25%" in lines[1] and "ETA 1m00s" in lines[1] and "0.1250" in lines[1]
    assert "[######------------------]" in lines[1]

    tty = io.StringIO()
    bar = Progress(tty, "text", tty=True)
    bar.update(2, 4, 10.0, 0.5)
    bar.log_line("a log line")
    assert tty.getvalue().endswith("a log line\n" + bar.bar())  # the line scrolls above, the bar is redrawn

    js = io.StringIO()
    Progress(js, "json").update(3, 4, 30.0, 0.25)
    event = json.loads(js.getvalue())
    assert event["event"] == "progress" and (event["step"], event["steps"], event["eta_s"]) == (3, 4, 10.0)

    quiet = io.StringIO()
    Progress(quiet, "quiet").update(1, 2, 1.0, 0.0)
    assert quiet.getvalue() == ""
    assert (
        format_duration(59) == "59s" and format_duration(125) == "2m05s" and format_duration(7260) == "2h01m"
    )
    assert (
        time_unit(30) == ("s", 1.0)
        and time_unit(600) == ("min", 60.0)
        and time_unit(5 * 3600) == ("h", 3600.0)
    )


@pytest.fixture
def root_logging():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_log_format_json_and_quiet(root_logging):
    buf = io.StringIO()
    progress.setup(log_format="json", stream=buf)
    logging.getLogger("gyre").info("dashboard: %s", "http://127.0.0.1:1/")
    progress.current().update(1, 2, 4.0, 0.5)
    first, second = (json.loads(line) for line in buf.getvalue().splitlines())
    assert (first["level"], first["logger"], first["msg"]) == (
        "info",
        "gyre",
        "dashboard: http://127.0.0.1:1/",
    )
    assert second["event"] == "progress" and second["eta_s"] == 4.0

    buf = io.StringIO()
    progress.setup(quiet=True, stream=buf)
    logging.getLogger("gyre").info("not shown")
    logging.getLogger("gyre").warning("shown")
    progress.current().update(1, 2, 4.0, 0.5)
    (line,) = buf.getvalue().splitlines()  # the warning alone: no info line, no bar
    assert line.endswith("gyre: shown")
