"""The HTTP weight transport (no system library): publish, pull, version checks, the run's secret, bad input.

Real HTTP on loopback: the publisher's server thread streams its buffer, the subscriber reads it with its own
connection; the seqlock is exercised with the publisher's write left open and with a write made between the data and
the closing sequence number (a gate in the serving thread, no timing).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
import torch

from gyre_cell.errors import StaleSnapshotError, TornSnapshotError, TransferError
from gyre_cell.transfer.http_publisher import DATA_PATH, HttpWeightPublisher
from gyre_cell.transfer.http_snapshot_channel import HttpSnapshotChannel
from gyre_cell.transfer.http_subscriber import HttpWeightSubscriber, fetch_http_manifest
from gyre_cell.transfer.snapshot_channel import parse_ref
from gyre_cell.transfer.subscriber import SubscriberConfig
from gyre_train.snapshot import SnapshotChannel

SECRET = "s3cret-token"


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(300, 64, generator=g)
    return {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,  # tied: one region in the buffer
        "model.norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(1100, 1000, generator=g),  # 4.4 MB: two 4 MiB chunks
    }


@pytest.fixture
def pub() -> Iterator[tuple[HttpWeightPublisher, str]]:
    with HttpWeightPublisher(state(1), version=1, secret=SECRET) as p:
        yield p, p.serve_manifest("127.0.0.1")


def same(tensors: dict[str, torch.Tensor], seed: int) -> bool:
    want = state(seed)
    return set(tensors) == set(want) and all(torch.equal(tensors[n], want[n]) for n in want)


def test_pull_each_publication_bit_exact_with_its_version(pub) -> None:
    p, url = pub
    manifest = fetch_http_manifest(url, SECRET)
    assert manifest.peer == p.peer and manifest.version == 1 and url == p.peer + "/weights/manifest"
    with HttpWeightSubscriber(manifest, secret=SECRET) as sub:
        snap = sub.read()
        assert (snap.version, snap.attempts, snap.nbytes) == (1, 1, manifest.data_bytes)
        assert same(snap.tensors, 1)
        assert (
            snap.tensors["lm_head.weight"].data_ptr() == snap.tensors["model.embed_tokens.weight"].data_ptr()
        )
        p.publish(state(2), version=2)
        snap = sub.read()
        assert snap.version == 2 and same(snap.tensors, 2)


def test_version_checks(pub) -> None:
    p, url = pub
    manifest = fetch_http_manifest(url, SECRET)
    with HttpWeightSubscriber(manifest, secret=SECRET) as sub:
        assert sub.read().version == 1
        # A version the header cannot hold is refused and leaves the publisher usable (the write lock released).
        with pytest.raises(ValueError, match="int64"):
            p.publish(state(3), version=2**63)
        p.publish(state(3), version=3)
        assert sub.read().version == 3 and same(sub.read().tensors, 3)
        with pytest.raises(ValueError, match="does not match the layout"):
            p.publish({"x": torch.zeros(2)}, version=4)
    # A manifest of another buffer (a publisher that restarted) is refused before any byte is sent.
    slot = manifest.slots[0].model_copy(update={"addr": manifest.buffer_addr + 64})
    stale = manifest.model_copy(update={"slots": [slot]})
    with HttpWeightSubscriber(stale, secret=SECRET) as sub, pytest.raises(TransferError, match="409"):
        sub.read()


def test_the_seqlock_never_returns_a_torn_snapshot(pub) -> None:
    p, url = pub
    manifest = fetch_http_manifest(url, SECRET)
    cfg = SubscriberConfig(max_attempts=3, retry_backoff_s=0.001)
    with HttpWeightSubscriber(manifest, secret=SECRET, config=cfg) as sub:
        p.begin_write()  # a write left open (a core dying mid-publish): every attempt is refused
        with pytest.raises(TornSnapshotError, match="3 attempts"):
            sub.read()
        p.end_write(1)
        # A publication lands between the data and the closing sequence number: that attempt is dropped, the next
        # one returns the new weights whole.
        fired = []

        def write_now() -> None:
            if not fired:
                fired.append(True)
                p.publish(state(5), version=5)

        p.after_send = write_now
        snap = sub.read()
        assert fired and snap.attempts == 2 and snap.version == 5 and same(snap.tensors, 5)


def test_the_run_secret_is_required(pub) -> None:
    p, url = pub
    with pytest.raises(TransferError, match="401"):
        fetch_http_manifest(url, "wrong")
    manifest = fetch_http_manifest(url, SECRET)
    with HttpWeightSubscriber(manifest, secret="wrong") as sub, pytest.raises(TransferError, match="401"):
        sub.read()
    data = f"{p.peer}{DATA_PATH}?addr={manifest.buffer_addr}"
    assert httpx.get(data).status_code == 401
    assert httpx.get(data, headers={"authorization": f"Basic {SECRET}"}).status_code == 401
    assert httpx.get(data, headers={"authorization": f"Bearer {SECRET}x"}).status_code == 401
    assert httpx.get(data, headers={"authorization": f"Bearer {SECRET}"}).status_code == 200
    with pytest.raises(ValueError, match="secret"):
        HttpWeightPublisher(state(1), secret="")


@pytest.mark.parametrize(
    ("method", "target", "status"),
    [
        ("GET", "/nope", 404),
        ("GET", DATA_PATH, 400),
        ("GET", f"{DATA_PATH}?addr=abc", 400),
        ("GET", f"{DATA_PATH}?addr=-1", 400),
        ("GET", f"{DATA_PATH}?addr={2**64}", 409),
        ("GET", f"{DATA_PATH}?addr={'9' * 5000}", 409),  # past int()'s digit limit: compared as text
        ("GET", f"{DATA_PATH}?addr=1&addr=2", 400),
        ("GET", f"{DATA_PATH}?addr=1&extra=2", 400),
        ("GET", f"{DATA_PATH}?addr=1&version=x", 400),
        ("GET", f"{DATA_PATH}?addr&version", 400),
        ("GET", f"{DATA_PATH}?addr=%F0%9F%98%80", 400),
        ("GET", f"{DATA_PATH}?addr=1", 409),
        ("POST", DATA_PATH, 405),
        ("PUT", "/weights/manifest", 405),
        ("HEAD", "/weights/manifest", 405),
        ("BREW", "/weights/manifest", 405),
    ],
)
def test_bad_requests_are_4xx(pub, method: str, target: str, status: int) -> None:
    p, _ = pub
    resp = httpx.request(method, p.peer + target, headers={"authorization": f"Bearer {SECRET}"})
    assert resp.status_code == status, resp.text
    if method != "HEAD":
        assert "message" in resp.json()["error"]


def test_a_malformed_request_line_is_400_and_the_server_goes_on(pub) -> None:
    p, url = pub
    host, port = p.peer.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"\x00\xff garbage\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 400")
    with socket.create_connection((host, int(port))) as s:  # a client that hangs up mid-body
        s.sendall(
            f"GET {DATA_PATH}?addr={p._buffer.data_ptr()} HTTP/1.1\r\nauthorization: Bearer {SECRET}\r\n\r\n".encode()
        )
        assert s.recv(12) == b"HTTP/1.0 200"
    assert fetch_http_manifest(url, SECRET).version == 1


def test_snapshot_channel_between_a_core_and_a_satellite() -> None:
    flat = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    with HttpSnapshotChannel("127.0.0.1", secret=SECRET) as core, HttpSnapshotChannel(secret=SECRET) as sat:
        assert isinstance(core, SnapshotChannel)
        ref3 = core.publish(3, flat)
        url, batch = parse_ref(ref3, "http+")
        assert batch == 3 and url == core.manifest_url and ref3.startswith("http+http://127.0.0.1:")
        got = sat.load(ref3)
        assert torch.equal(got, flat) and got.data_ptr() != flat.data_ptr()
        ref4 = core.publish(4, flat * 2)
        assert torch.equal(sat.load(ref4), flat * 2) and torch.equal(core.load(ref4), flat * 2)
        with pytest.raises(StaleSnapshotError, match="moved on to batch 3"):
            sat.load(ref3)
        with pytest.raises(StaleSnapshotError, match="not reached batch 9"):
            sat.load(f"http+{url}#batch=9")
        with pytest.raises(StaleSnapshotError, match="moved on to batch 3"):
            core.load(ref3)
        with pytest.raises(ValueError, match="changed layout"):
            core.publish(5, flat[:10])
        with pytest.raises(ValueError, match="not a HTTP snapshot ref"):
            sat.load(f"mooncake+{url}#batch=4")
        with pytest.raises(TransferError, match="401"):
            HttpSnapshotChannel(secret="other").load(ref4)
    with pytest.raises(TransferError):  # the core is gone: a clear error
        HttpSnapshotChannel(secret=SECRET).load(ref4)
