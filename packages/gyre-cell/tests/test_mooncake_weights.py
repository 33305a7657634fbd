"""Weight transfer over Mooncake TCP between two real processes (publisher in a spawned child, subscriber here);
the reads also run over the publisher's shared memory (same host: `gyre_cell.transfer.shm`), the same seqlock."""

from __future__ import annotations

import importlib.abc
import multiprocessing as mp
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from pydantic import ValidationError

from gyre_cell.engine.weights import load_checkpoint_dir
from gyre_cell.errors import TransferError
from gyre_cell.transfer import (
    MooncakeUnavailableError,
    SubscriberConfig,
    TensorEntry,
    WeightManifest,
    WeightPublisher,
    WeightSubscriber,
    fetch_manifest,
)
from gyre_cell.transfer.manifest import HEADER_BYTES, MAGIC, BufferSlot, plan_layout, tensor_views
from gyre_cell.transfer.mooncake import read_pieces
from gyre_cell.transfer.peer import publisher_process


class Peer:
    """Driver of a publisher child process."""

    def __init__(self, source: dict[str, Any], version: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=publisher_process, args=(child, source, version), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *cmd: Any, timeout_s: float = 60.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"publisher did not answer {cmd[0]!r}")
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def manifest(self) -> WeightManifest:
        return WeightManifest.model_validate_json(self.call("manifest"))

    def manifest_url(self) -> str:
        """Where the publisher serves its manifest (started by the first call)."""
        if not hasattr(self, "_url"):
            self._url = self.call("serve_manifest")
        return self._url

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("close", timeout_s=10)
        except (OSError, EOFError, TimeoutError):
            pass
        finally:
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
            self.conn.close()


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def peer(tiny_model: Path) -> Iterator[Peer]:
    p = Peer({"dir": str(tiny_model)}, version=1)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(params=["mooncake", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


def _subscriber(manifest: WeightManifest, transport: str, **config: Any) -> WeightSubscriber:
    """A subscriber reading over `transport` (asserted: on this host the default is the shared buffer)."""
    sub = WeightSubscriber(manifest, config=SubscriberConfig(shared_memory=transport == "shm", **config))
    assert sub.shared == (transport == "shm")
    return sub


def _to_model(path: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).float()


@pytest.mark.slow
def test_read_equals_published_bytes_and_loads_model(
    peer: Peer, tiny_model: Path, tiny_model_b: Path, transport: str
) -> None:
    expected_a = load_checkpoint_dir(tiny_model)
    peer.call("publish", {"dir": str(tiny_model)}, 1)
    manifest = fetch_manifest(peer.manifest_url())  # handshake over real HTTP
    assert manifest.version == 1 and {e.name for e in manifest.tensors} == set(expected_a)
    with _subscriber(manifest, transport, bucket_bytes=4096) as sub:
        snap = sub.read()
        assert snap.version == 1 and snap.attempts == 1
        assert snap.nbytes == manifest.length - HEADER_BYTES
        for name, t in expected_a.items():
            assert torch.equal(snap.tensors[name], t), name  # bit-exact, every tensor, across many buckets

        model = _to_model(tiny_model)
        sub.load_into(model, snap)
        for name, p in model.state_dict().items():
            assert torch.equal(p, expected_a[name]), name
        bound = _to_model(tiny_model)
        sub.bind(bound)  # zero-copy: the next read lands in `bound` directly

        # A second publish is visible to the next read; the model follows after load_into.
        expected_b = load_checkpoint_dir(tiny_model_b)
        assert not torch.equal(expected_a["lm_head.weight"], expected_b["lm_head.weight"])
        peer.call("publish", {"dir": str(tiny_model_b)}, 2)
        snap2 = sub.read()
        assert snap2.version == 2
        sub.load_into(model, snap2)
        for name, p in model.state_dict().items():
            assert torch.equal(p, expected_b[name]), name
        for name, p in bound.state_dict().items():
            assert torch.equal(p, expected_b[name]), name
        with pytest.raises(ValueError, match="does not match"):
            sub.bind(torch.nn.Linear(2, 2))


def test_version_change_during_read_is_detected_and_retried(
    peer: Peer, tiny_model: Path, tiny_model_b: Path, transport: str
) -> None:
    peer.call("publish", {"dir": str(tiny_model)}, 10)
    fired: list[int] = []

    def publish_midway() -> None:  # the publisher writes after our data read, before our closing header read
        if not fired:  # two publications: the other slot (11), then the one being read (12)
            fired.append(1)
            peer.call("publish", {"dir": str(tiny_model_b)}, 11)
            peer.call("publish", {"dir": str(tiny_model_b)}, 12)

    with _subscriber(peer.manifest(), transport) as sub:
        snap = sub.read(after_data=publish_midway)
        assert fired and snap.attempts == 2 and snap.version == 12
        expected_b = load_checkpoint_dir(tiny_model_b)
        for name, t in expected_b.items():
            assert torch.equal(snap.tensors[name], t), name


def test_reads_during_continuous_publishing_are_never_torn(
    peer: Peer, tiny_model: Path, tiny_model_b: Path, transport: str
) -> None:
    states = [load_checkpoint_dir(tiny_model), load_checkpoint_dir(tiny_model_b)]  # even version: a, odd: b
    peer.call("publish", {"dir": str(tiny_model)}, 100)
    with _subscriber(
        peer.manifest(), transport, bucket_bytes=8192, max_attempts=500, retry_backoff_s=0.001
    ) as sub:
        peer.call("churn", {"dir": str(tiny_model)}, {"dir": str(tiny_model_b)}, 101, 0.02)
        versions: set[int] = set()
        reads, deadline = 0, time.monotonic() + 60.0
        # At least 40 reads, and until the reads have seen the publisher move (a loaded machine can starve it).
        while reads < 40 or (len(versions) < 2 and time.monotonic() < deadline):
            reads += 1
            snap = sub.read()
            versions.add(snap.version)
            expected = states[snap.version % 2]
            for name, t in expected.items():  # every tensor from the same publish as the version says
                assert torch.equal(snap.tensors[name], t), (snap.version, name)
        last = peer.call("churn_stop")
    assert len(versions) > 1 and max(versions) <= last  # the reads really overlapped the publishing


def test_open_write_is_never_read_then_becomes_visible(peer: Peer, tiny_model: Path, transport: str) -> None:
    peer.call("publish", {"dir": str(tiny_model)}, 20)
    with _subscriber(peer.manifest(), transport, max_attempts=3, retry_backoff_s=0.001) as sub:
        peer.call("begin_write")  # into the other slot: readers keep getting the newest closed publication
        try:
            snap = sub.read()
            assert snap.version == 20 and snap.attempts == 1
            for name, t in load_checkpoint_dir(tiny_model).items():
                assert torch.equal(snap.tensors[name], t), name
        finally:
            assert peer.call("end_write", 21) == 21
        assert sub.read().version == 21


def test_subscriber_close_frees_its_port(peer: Peer) -> None:
    sub = _subscriber(peer.manifest(), "mooncake")
    port = sub._engine.get_rpc_port()
    assert not _refused(port)
    sub.close()
    assert _refused(port)
    with pytest.raises(RuntimeError, match="closed"):
        sub.read()


@pytest.mark.slow
def test_publisher_process_teardown_frees_port(tiny_model: Path) -> None:
    p = Peer({"random": 5000, "seed": 3}, version=0)
    try:
        manifest = p.manifest()
        port = int(manifest.peer.rsplit(":", 1)[1])
        assert not _refused(port)
    finally:
        p.close()
    assert p.proc.exitcode == 0
    assert _refused(port)


def test_publisher_in_process_layout_and_tied_weights() -> None:
    emb = torch.randn(8, 4)
    named = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(3)}
    with WeightPublisher(named, version=5) as pub:
        m = pub.manifest()
        by = {e.name: e for e in m.tensors}
        assert by["lm_head.weight"].offset == by["model.embed_tokens.weight"].offset  # tied: stored once
        assert m.version == 5 and m.length == HEADER_BYTES + 128 + 64
        with pytest.raises(ValueError, match="missing"):
            pub.publish({"norm.weight": torch.ones(3)}, version=6)
        with pytest.raises(ValueError, match="shape"):
            pub.publish({**named, "norm.weight": torch.ones(4)}, version=6)
        with pytest.raises(RuntimeError, match="boom"), pub.writing(7) as views:
            views["norm.weight"].fill_(2.0)
            raise RuntimeError("boom")
        assert pub.version == 5  # an aborted write never advances the version
        pub.publish({**named, "norm.weight": torch.full((3,), 9.0)}, version=8)
        assert pub.version == 8 and torch.equal(pub.tensors()["norm.weight"], torch.full((3,), 9.0))


def test_a_version_outside_int64_is_refused_and_never_holds_the_write_lock() -> None:
    """`/cell/publish` with version 2**63 answered 500 and left the publisher's lock held: every later publish, save
    and re-form hung. The wire model now refuses it (a 422), and the publisher releases its lock whatever happens."""
    from pydantic import ValidationError

    from gyre_cell.worker_types import VERSION_MAX, PublishCommand

    with pytest.raises(ValidationError, match="less than or equal"):
        PublishCommand(version=VERSION_MAX + 1)
    named = {"norm.weight": torch.ones(3)}
    with WeightPublisher(named, version=1) as pub:
        with pytest.raises(ValueError, match="int64"):
            pub.publish(named, version=2**63)
        assert pub.version == 1
        pub.publish({"norm.weight": torch.full((3,), 4.0)}, version=VERSION_MAX)  # the lock was released
        assert pub.version == VERSION_MAX and torch.equal(pub.tensors()["norm.weight"], torch.full((3,), 4.0))


def test_layout_views_round_trip_dtypes() -> None:
    named = [
        ("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
        ("b", torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
        ("c", torch.tensor(7, dtype=torch.int64)),
    ]
    entries, length = plan_layout(named)
    buf = torch.zeros(length, dtype=torch.uint8)
    views = tensor_views(buf, entries)
    for n, t in named:
        views[n].copy_(t)
    again = tensor_views(buf, entries)
    for n, t in named:
        assert again[n].dtype == t.dtype and torch.equal(again[n], t)


class _NoIbverbs(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "mooncake.engine":
            raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")


def test_missing_libibverbs_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoIbverbs(), *sys.meta_path])
    with pytest.raises(MooncakeUnavailableError, match=r"apt-get install libibverbs1") as info:
        WeightPublisher({"w": torch.zeros(2)})
    assert "libibverbs.so.1" in str(info.value)


def _manifest_json() -> dict[str, Any]:
    entry = TensorEntry(name="w", dtype="float32", shape=[2, 3], offset=HEADER_BYTES, nbytes=24)
    m = WeightManifest(
        peer="127.0.0.1:1234",
        slots=[BufferSlot(addr=4096)],
        length=HEADER_BYTES + 64,
        version=3,
        tensors=[entry],
    )
    return orjson.loads(m.model_dump_json())


def test_manifest_round_trips_and_rejects_malformed() -> None:
    data = _manifest_json()
    m = WeightManifest.model_validate(data)
    assert orjson.loads(m.model_dump_json()) == data and m.schema_version == 1
    bad_cases = [
        {**data, "extra": 1},
        {**data, "schema_version": 2},
        {**data, "length": HEADER_BYTES + 8},  # tensor outside the buffer
        {**data, "tensors": [{**data["tensors"][0], "nbytes": 20}]},  # nbytes disagrees with shape x dtype
        {**data, "tensors": [{**data["tensors"][0], "dtype": "complex64"}]},
        {**data, "tensors": [{**data["tensors"][0], "offset": HEADER_BYTES + 4}]},  # misaligned
        {**data, "tensors": [data["tensors"][0], data["tensors"][0]]},  # duplicate names
        {**data, "slots": []},
        {**data, "slots": [{"addr": 4096 * k} for k in (1, 2, 3)]},  # more slots than a publisher has
        {**data, "slots": [{"addr": 4096}, {"addr": 4096}]},  # one buffer twice
        {
            **data,
            "slots": [
                {"addr": 4096},
                {"addr": 8192, "shm": {"path": "/p", "boot_id": "b", "nonce": "0" * 32}},
            ],
        },
    ]
    for bad in bad_cases:
        with pytest.raises(ValidationError):
            WeightManifest.model_validate(bad)


def test_a_read_the_publisher_refuses_fails_and_every_piece_has_ended(peer: Peer) -> None:
    """`read_pieces` (asynchronous pieces, polled with pauses): a piece outside the publisher's registered buffer
    fails as a TransferError, after the valid pieces beside it completed (no late write into the buffer)."""
    manifest = fetch_manifest(peer.manifest_url())
    with _subscriber(manifest, "mooncake") as sub:
        local, remote = sub._buffer.data_ptr(), manifest.slots[0].addr
        sub._buffer.zero_()
        with pytest.raises(TransferError, match=r"1 failed|1 pieces refused"):
            read_pieces(
                sub._engine,
                manifest.peer,
                [local, local + 4096],
                [remote, remote + manifest.length + (1 << 30)],  # the second lies outside what it registered
                [4096, 4096],
                timeout_s=60,
            )
        assert int(sub._buffer[:24].view(torch.int64)[2]) == MAGIC  # the valid piece (the header) arrived
