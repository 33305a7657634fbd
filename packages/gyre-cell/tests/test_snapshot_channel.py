"""MooncakeSnapshotChannel between two real processes: the core in a spawned child, a satellite in the test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gyre_cell.transfer import (
    MooncakeSnapshotChannel,
    StaleSnapshotError,
    SubscriberConfig,
    TransferError,
)
from gyre_cell.transfer.peer import PeerProcess, random_flat, snapshot_core_process
from gyre_cell.transfer.snapshot_channel import make_ref, parse_ref
from gyre_train.errors import SnapshotError
from gyre_train.snapshot import SnapshotChannel

N = 300_000  # 1.2 MB of float32: many 64 KiB buckets per read


@pytest.fixture
def core() -> Iterator[PeerProcess]:
    with PeerProcess(snapshot_core_process) as c:
        yield c


def test_over_mooncake_a_satellite_gets_the_subscribers_buffer_without_another_copy(
    core: PeerProcess,
) -> None:
    """Across hosts the read lands in the subscriber's own buffer and `load` returns it (valid until the next load,
    as the protocol says): the satellite copies it into its model, one copy after the transfer, not two."""
    ref3 = core.call("publish", 3, N, 103)
    with MooncakeSnapshotChannel(subscriber=SubscriberConfig(shared_memory=False)) as sat:
        flat3 = sat.load(ref3)
        assert torch.equal(flat3, random_flat(N, 103))
        flat4 = sat.load(core.call("publish", 4, N, 104))
        assert torch.equal(flat4, random_flat(N, 104)) and flat4.data_ptr() == flat3.data_ptr()


@pytest.mark.slow
def test_satellite_loads_each_batch_bit_exact_and_a_stale_ref_raises(core: PeerProcess) -> None:
    ref3 = core.call("publish", 3, N, 103)
    url, batch = parse_ref(ref3)
    assert batch == 3 and url.startswith("http://127.0.0.1:") and url.endswith("/weights/manifest")
    with MooncakeSnapshotChannel(subscriber=SubscriberConfig(bucket_bytes=64 << 10)) as sat:
        flat3 = sat.load(ref3)
        assert flat3.dtype == torch.float32 and torch.equal(flat3, random_flat(N, 103))
        assert sat.load(ref3).data_ptr() != flat3.data_ptr()  # a copy, not a view of the subscriber's buffer

        ref4 = core.call("publish", 4, N, 104)
        assert parse_ref(ref4) == (url, 4)  # same publisher, same manifest URL
        flat4 = sat.load(ref4)
        assert torch.equal(flat4, random_flat(N, 104))
        assert torch.equal(flat3, random_flat(N, 103))  # the earlier result was not overwritten by the read
        assert len(sat._subscribers) == 1  # one cached subscriber per manifest URL

        with pytest.raises(StaleSnapshotError, match=r"moved on to batch 3 .*holds batch 4"):
            sat.load(ref3)
        with pytest.raises(StaleSnapshotError, match="not reached batch 9"):
            sat.load(make_ref(url, 9))

        # The core reading its own ref takes no transfer and gives the same bytes.
        assert torch.equal(core.call("load", ref4), random_flat(N, 104))
        # The layout is fixed by the first publish.
        status, msg = core.ask("publish", 5, N + 1, 105)
        assert status == "error" and "changed layout" in msg
        assert torch.equal(sat.load(ref4), random_flat(N, 104))  # the refused publish left batch 4 intact

        core.close()  # publisher gone: a clear error, and the cached subscriber is dropped
        with pytest.raises(TransferError):
            sat.load(ref4)
        assert sat._subscribers == {}


def test_an_open_write_is_a_torn_read_not_a_snapshot(core: PeerProcess) -> None:
    ref = core.call("publish", 1, N, 11)
    with MooncakeSnapshotChannel(subscriber=SubscriberConfig(max_attempts=3, retry_backoff_s=0.001)) as sat:
        assert isinstance(sat, SnapshotChannel)  # gyre-train's protocol (runtime-checkable)
        core.call("begin_write")
        with pytest.raises(SnapshotError, match="torn snapshot") as info:
            sat.load(ref)
        assert not isinstance(info.value, StaleSnapshotError)
        core.call("end_write", 1)
        assert torch.equal(sat.load(ref), random_flat(N, 11))


def test_core_side_in_process_and_closed_channel() -> None:
    params = torch.arange(10, dtype=torch.float32)
    with MooncakeSnapshotChannel() as ch:
        ref = ch.publish(0, params)
        assert ch.manifest_url is not None and parse_ref(ref) == (ch.manifest_url, 0)
        got = ch.load(ref)
        assert torch.equal(got, params) and got.data_ptr() != params.data_ptr()
        ref1 = ch.publish(1, params * 2)
        assert torch.equal(ch.load(ref1), params * 2)
        with pytest.raises(SnapshotError, match="moved on"):  # gyre-train's error type
            ch.load(ref)
        with pytest.raises(ValueError, match="changed layout"):
            ch.publish(2, params.double())
        with pytest.raises(ValueError, match="batch must be >= 0"):
            ch.publish(-1, params)
    with pytest.raises(RuntimeError, match="closed"):
        ch.publish(3, params)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "http://x/weights/manifest#batch=1",
        "mooncake+#batch=1",
        "mooncake+http://x",
        "mooncake+u#batch=-1",
    ],
)
def test_malformed_ref_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a Mooncake snapshot ref"):
        parse_ref(bad)


def test_ref_round_trip() -> None:
    url = "http://10.0.0.7:4100/weights/manifest"
    assert parse_ref(make_ref(url, 12)) == (url, 12)
