"""A satellite's join and its leave (`to_rollout`) race: the controller fires the join after a transition and may
send the cell back to rollout before the join is served. Whatever the order, no burst runs after the leave.

The burst is gated: it runs until its `leave` event is set, as SatelliteRunner.run_burst returns at its next safe
point; the satellite side is that loop alone, the rest of CellTraining (threads, lock, events) is the real code.
"""

from __future__ import annotations

import threading

from gyre_cell.worker_training import CellTraining


class _GatedSatellite:
    """Holds its burst until `leave` is set; counts the bursts it ran."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.bursts = 0

    def run_burst(self, leave: threading.Event) -> str:
        self.bursts += 1
        self.started.set()
        leave.wait(timeout=30)
        return "left" if leave.is_set() else "timeout"


def _training() -> tuple[CellTraining, _GatedSatellite, list]:
    events: list = []
    training = CellTraining.__new__(CellTraining)  # the burst control only: no backend, no process group
    training.cfg = type("Cfg", (), {"cell": 1})()
    training.emit = lambda kind, /, **fields: events.append((kind, fields))
    training.satellite = _GatedSatellite()
    training.leave = threading.Event()
    training._burst_lock = threading.Lock()
    training._may_join = False
    training._thread = None
    return training, training.satellite, events


def test_a_join_served_after_the_leave_starts_no_burst():
    training, satellite, events = _training()
    training.arm()  # to_training
    training.stop_burst()  # to_rollout arrives before the fired join is served
    assert training.join() is False
    assert satellite.bursts == 0 and training._thread is None and events == []


def test_a_leave_during_a_burst_ends_it_and_later_joins_wait_for_the_next_arm():
    training, satellite, events = _training()
    training.arm()
    assert training.join() is True
    assert satellite.started.wait(timeout=30)
    training.stop_burst()  # returns only once the burst thread has returned
    assert not training._thread.is_alive()
    assert events == [("satellite_done", {"cell": 1, "result": "left"})]
    assert training.join() is False and satellite.bursts == 1
    training.arm()  # back in training: the next join runs a burst again
    assert training.join() is True and satellite.started.wait(timeout=30)
    training.stop_burst()
    assert satellite.bursts == 2


def test_concurrent_join_and_leave_never_leave_a_burst_running():
    for _ in range(50):
        training, _, _ = _training()
        training.arm()
        go = threading.Barrier(2)
        joiner = threading.Thread(target=lambda t=training, g=go: (g.wait(), t.join()))
        joiner.start()
        go.wait()
        training.stop_burst()
        joiner.join(timeout=30)
        training.wait_idle()  # a burst started before the leave has returned; none starts after it
        assert training._thread is None or not training._thread.is_alive()
        assert training.leave.is_set()


class _GatedCore:
    """A core step that reports its new version, then holds (the step thread returning after its step_end) until
    `returned` is set."""

    def __init__(self, trainer) -> None:
        self.trainer, self.reported, self.returned, self.steps = (
            trainer,
            threading.Event(),
            threading.Event(),
            0,
        )

    def step(self, **_):
        self.steps += 1
        self.trainer.version += 1
        self.reported.set()
        self.returned.wait(timeout=30)
        return type(
            "Report", (), {"policy_version": self.trainer.version, "model_dump": lambda self, **_: {}}
        )()


def test_the_next_batch_waits_for_the_previous_step_thread_to_return(tmp_path):
    training, _, events = _training()
    training.trainer = type("Trainer", (), {"version": 0})()
    training.core = _GatedCore(training.trainer)
    training.cfg = type(
        "Cfg",
        (),
        {
            "cell": 0,
            "run_dir": str(tmp_path),
            "training": type("T", (), {"dump_batches": [], "checkpoint_keep": 0})(),
        },
    )()
    training._hold_for_join = lambda done: None
    training.abort = threading.Event()
    training.open_batch(0, final=False)
    assert training.core.reported.wait(timeout=30)  # version 1 reported; its thread has not returned yet
    opened = threading.Thread(target=training.open_batch, args=(1, False))
    opened.start()  # the controller asks for the next batch within that window: it waits, never refuses
    training.core.returned.set()
    opened.join(timeout=30)
    training.wait_idle()
    assert training.core.steps == 2 and training.trainer.version == 2
    assert [kind for kind, _ in events] == ["step_end", "step_end"]
