"""Group membership has one definition: the first N non-excluded executions in dispatch-index order."""

import pytest

from gyre_sched.errors import InvariantError
from gyre_sched.ledger import Ledger


def _run_group(led: Ledger, statuses: list[str]) -> str:
    d = led.dispatch()
    for _ in d.execution_ids:
        led.mark_launched(led.pop_queued(), "cell:0")
    for eid, status in zip(d.execution_ids, statuses, strict=False):
        led.terminated(eid, "completed")
        led.assessed(eid, status)
    return d.group_id


def test_members_skip_excluded_and_keep_dispatch_order() -> None:
    led = Ledger(N=2, N_d=4)  # two spares
    gid = _run_group(led, ["excluded", "valid", "no_work"])
    d = led.groups[gid]
    assert led.members(gid) == [d.execs[1], d.execs[2]]  # not the excluded first, not the unneeded last


def test_members_of_an_open_group_are_refused() -> None:
    led = Ledger(N=2, N_d=2)
    gid = _run_group(led, ["valid"])
    with pytest.raises(InvariantError, match="open"):
        led.members(gid)
