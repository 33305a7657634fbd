"""The publisher's buffer in shared memory (`gyre_cell.transfer.shm`), the publisher's finite check, and an engine
loading published weights in place from the mapped buffer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gyre_cell.engine import EngineConfig, TorchEngine
from gyre_cell.engine.weights import all_finite, load_checkpoint_dir
from gyre_cell.transfer import (
    SubscriberConfig,
    TornSnapshotError,
    WeightManifest,
    WeightPublisher,
    WeightSubscriber,
)
from gyre_cell.transfer.engine_loader import pull_into_engine
from gyre_cell.transfer.publisher import FINITE_CHUNK, copy_finite


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(7, generator=g)}


def test_a_manifest_from_another_host_or_process_falls_back_to_mooncake() -> None:
    with WeightPublisher(_state(0), version=3) as pub:
        manifest = pub.manifest()
        assert len(manifest.slots) == 2 and all(s.shm.path.startswith("/proc/") for s in manifest.slots)
        with WeightSubscriber(manifest) as sub:
            assert sub.shared and sub.read().version == 3  # the same host: mapped

        def elsewhere(**change: str) -> WeightManifest:
            slots = [s.model_copy(update={"shm": s.shm.model_copy(update=change)}) for s in manifest.slots]
            return manifest.model_copy(update={"slots": slots})

        # another boot id (host); the path naming another file (another PID namespace)
        for other in (elsewhere(boot_id="not-this-host"), elsewhere(nonce="0" * 32)):
            with WeightSubscriber(other) as sub:
                assert not sub.shared
                snap = sub.read()  # over Mooncake TCP instead
                assert snap.version == 3 and torch.equal(snap.tensors["a.weight"], _state(0)["a.weight"])


def test_the_publisher_refuses_nan_and_readers_never_get_it() -> None:
    bad = _state(1)
    bad["b.bias"][3] = float("nan")
    with WeightPublisher(_state(0), version=1) as pub:
        assert pub.manifest().finite_checked
        with WeightSubscriber(
            pub.manifest(), config=SubscriberConfig(max_attempts=2, retry_backoff_s=0)
        ) as sub:
            with pytest.raises(ValueError, match=r"b\.bias: NaN or infinite"):
                pub.publish(bad, version=2)
            snap = sub.read()  # the aborted write is never read: the newest closed publication is
            assert snap.version == 1 and torch.equal(snap.tensors["b.bias"], _state(0)["b.bias"])
            assert pub.version == 1
            pub.publish(_state(2), version=3)
            snap = sub.read()
            assert snap.version == 3 and torch.equal(snap.tensors["b.bias"], _state(2)["b.bias"])
    with WeightPublisher(_state(0), version=1, check_finite=False) as pub:  # the satellites' flat snapshots
        assert not pub.manifest().finite_checked
        pub.publish(bad, version=2)
        assert pub.version == 2


@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([1.0, 3e38, 3e38, 3e38], True),
        ([1.0, float("inf")], False),
        ([float("-inf"), float("inf")], False),
        ([0.0, float("nan")], False),
        ([], True),
    ],
)
def test_all_finite(values: list[float], finite: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert all_finite(torch.tensor(values, dtype=dtype)) is finite
    assert all_finite(torch.tensor([1, 2])) is True  # integers hold no NaN


def test_an_engine_loads_in_place_from_the_shared_buffer(tiny_model: Path, tiny_model_b: Path) -> None:
    """The copy path (an engine of another dtype cannot serve the buffer's pages) from a one-slot publisher."""
    engine = TorchEngine(
        EngineConfig(model_path=str(tiny_model_b), device="cpu", cpu_threads=1, dtype="bfloat16")
    )
    expected = {n: t.to(torch.bfloat16) for n, t in load_checkpoint_dir(tiny_model).items()}
    try:
        params = dict(engine.model.named_parameters())
        addresses = {n: p.data_ptr() for n, p in params.items()}
        with (
            WeightPublisher(load_checkpoint_dir(tiny_model), version=7, slots=1) as pub,
            WeightSubscriber(pub.manifest(), config=SubscriberConfig(max_attempts=2)) as sub,
        ):
            assert sub.shared
            assert pull_into_engine(engine, sub) == "7" and engine.weight_version == "7"
            for name, t in expected.items():
                assert torch.equal(params[name].detach(), t), name
            assert {n: p.data_ptr() for n, p in params.items()} == addresses  # copied into the parameters
            # straight from the publisher's pages: nothing staged in the subscriber's own data region
            assert not sub._buffer[: sub.manifest.length].any()

            pub.begin_write()  # a write in progress on the only slot: no load, the engine keeps 7 and its weights
            with pytest.raises(TornSnapshotError):
                pull_into_engine(engine, sub)
            pub.abort_write()
            assert engine.weight_version == "7"
            assert torch.equal(params["lm_head.weight"].detach(), expected["lm_head.weight"])
    finally:
        engine.close()


def test_copy_finite_checks_every_chunk_and_copies_exactly() -> None:
    n = 3 * FINITE_CHUNK + 5
    for where, value, finite in [
        (None, 0.0, True),
        (n - 1, float("nan"), False),  # the short last chunk
        (FINITE_CHUNK + 7, float("inf"), False),
        (0, float("-inf"), False),
    ]:
        src = torch.randn(n)
        if where is not None:
            src[where] = value
        dst = torch.empty(n)
        assert copy_finite(dst, src) is finite
        assert torch.equal(dst, src) if finite else torch.equal(dst.isnan(), src.isnan())
    huge = torch.full((n,), 3e38)  # every chunk's sum overflows, yet every value is finite
    assert copy_finite(torch.empty(n), huge)
    odd = torch.randn(64, 32).t()  # not contiguous: one copy, then the check
    odd[5, 3] = float("nan")
    dst = torch.empty(32, 64)
    assert not copy_finite(dst, odd) and dst.isnan().sum() == 1
    assert copy_finite(torch.empty(4, dtype=torch.int64), torch.arange(4))
