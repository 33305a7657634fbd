"""Engines on the publisher's host serve its newest buffer as their parameters (`WeightStore.bind`): two alternating
slots, a lease that keeps the publisher off the slot an engine serves (and an engine that missed a publication
revoked, never serving torn weights), and every other weight path (disk update, release, resume, close, another
dtype) working on read-only bound pages without a crash."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gyre_cell.engine import EngineConfig, TorchEngine
from gyre_cell.engine.request import SamplingSpec
from gyre_cell.engine.weights import WeightStore, load_checkpoint_dir
from gyre_cell.transfer import SubscriberConfig, WeightPublisher, WeightSubscriber
from gyre_cell.transfer.engine_loader import bind_published, pull_into_engine
from gyre_cell.transfer.peer import PeerProcess, engine_process


def _engine(model_dir: Path, dtype: str = "float32") -> TorchEngine:
    return TorchEngine(EngineConfig(model_path=str(model_dir), device="cpu", cpu_threads=1, dtype=dtype))


@pytest.fixture
def engine(tiny_model_b: Path) -> Iterator[TorchEngine]:
    e = _engine(tiny_model_b)
    yield e
    e.close()


def _serves(engine: TorchEngine, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p.detach(), expected[n]) for n, p in engine.model.named_parameters())


def _generate(engine: TorchEngine, rid: str) -> dict:
    """One greedy request of 4 tokens; its final response."""
    out: dict = {}
    done = threading.Event()

    def sink(response: dict, final: bool) -> None:
        if final:
            out.update(response)
            done.set()

    spec = SamplingSpec(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine.submit(rid=rid, input_ids=[3, 1, 4], sampling=spec, return_logprob=False, stream=False, sink=sink)
    assert done.wait(60)
    return out


_MISSED = "missed a publication"


def _inside(engine: TorchEngine, sub: WeightSubscriber, slot: int) -> bool:
    """Every parameter's memory lies in the subscriber's mapping of the publisher's slot `slot`."""
    m = sub._mappings[slot].tensor
    lo, hi = m.data_ptr(), m.data_ptr() + m.numel()
    return all(lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi for p in engine.model.parameters())


def test_a_bound_engine_keeps_its_version_while_the_next_is_written_then_binds_it_without_a_copy(
    engine: TorchEngine, tiny_model: Path, tiny_model_b: Path
) -> None:
    a, b = load_checkpoint_dir(tiny_model), load_checkpoint_dir(tiny_model_b)
    with (
        WeightPublisher(a, version=7, lease_wait_s=0) as pub,
        WeightSubscriber(pub.manifest(), config=SubscriberConfig(max_attempts=2)) as sub,
    ):
        assert pull_into_engine(engine, sub) == "7" and engine.weight_version == "7"
        assert engine.weights.bound and _inside(engine, sub, 0) and _serves(engine, a)

        pub.publish(b, version=8)  # into the other slot: the engine keeps serving 7, bit-exact
        assert pub.version == 8 and _serves(engine, a) and engine.weight_version == "7"
        assert pull_into_engine(engine, sub) == "8"
        assert _inside(engine, sub, 1) and _serves(engine, b)  # pointers swapped, nothing copied

        pub.publish(a, version=9)  # slot 0 again: the engine let go of it when it bound slot 1
        assert pull_into_engine(engine, sub) == "9" and _inside(engine, sub, 0) and _serves(engine, a)
        pub.publish(b, version=10)  # the engine moved on: slot 1 is free
        engine.close()  # closing drops the lease on slot 0 (its parameters get memory of their own)
        assert not engine.weights.bound and _serves(engine, a)
        pub.publish(a, version=11)


def test_an_engine_that_missed_a_publication_is_revoked_not_waited_for(
    engine: TorchEngine,
    tiny_model: Path,
    tiny_model_b: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bound engine that lags two publications would stop the publisher for good: the write goes ahead after the
    lease wait, and the engine finds its pages rewritten after the step that read them, keeps nothing that step
    computed, ends its requests aborted and serves nothing until it loads again."""
    a, b = load_checkpoint_dir(tiny_model), load_checkpoint_dir(tiny_model_b)
    with (
        WeightPublisher(a, version=1, lease_wait_s=0) as pub,
        WeightSubscriber(pub.manifest()) as sub,
    ):
        assert pull_into_engine(engine, sub) == "1" and _inside(engine, sub, 0)
        served = _generate(engine, "before")
        assert served["meta_info"]["finish_reason"]["type"] == "length"
        pub.publish(b, version=2)  # slot 1; the engine misses it and keeps slot 0
        assert engine.weights.intact() and not caplog.records
        step = engine.runner.step

        def step_then_publish(*args):  # the gate: version 3 is written while the engine is inside a step
            logits = step(*args)
            if pub.version == 2:
                pub.publish(b, version=3)  # slot 0, still the engine's: written after the (zero) wait
            return logits

        monkeypatch.setattr(engine.runner, "step", step_then_publish)
        with caplog.at_level(logging.WARNING):
            revoked = _generate(engine, "revoked")
        assert pub.version == 3 and _MISSED in caplog.text
        assert revoked["meta_info"]["finish_reason"]["type"] == "abort"
        assert "revoked" in revoked["meta_info"]["finish_reason"]["message"]
        assert revoked["output_ids"] == []  # the token of the step that read the rewritten pages is not kept
        assert engine.weights.revoked and not engine.weights.bound
        assert (
            _generate(engine, "still")["meta_info"]["finish_reason"]["type"] == "abort"
        )  # nothing until a load

        assert pull_into_engine(engine, sub) == "3" and _serves(engine, b) and not engine.weights.revoked
        again = _generate(engine, "after")
        assert again["meta_info"]["finish_reason"]["type"] == "length" and len(again["output_ids"]) == 4


def test_a_killed_engine_process_releases_its_lease(
    tiny_model: Path, tiny_model_b: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = load_checkpoint_dir(tiny_model), load_checkpoint_dir(tiny_model_b)
    with WeightPublisher(a, version=1, lease_wait_s=0) as pub, caplog.at_level(logging.WARNING):
        peer = PeerProcess(engine_process, str(tiny_model_b))
        try:
            assert peer.call("subscribe", pub.manifest().model_dump_json()) is True
            assert peer.call("pull") == "1"  # bound to slot 0
            pub.publish(b, version=2)  # slot 1
            pub.publish(a, version=3)  # slot 0, held by the engine: written anyway, the engine revoked
            assert caplog.text.count(_MISSED) == 1
            assert peer.call("pull") == "3"  # it loads again: bound to slot 0
            pub.publish(b, version=4)  # slot 1 is free
            os.kill(peer.proc.pid, signal.SIGKILL)
            peer.proc.join()
            pub.publish(a, version=5)  # slot 0: the kernel dropped the dead engine's lock, nothing revoked
            assert pub.version == 5 and caplog.text.count(_MISSED) == 1
        finally:
            peer.close()


@pytest.mark.parametrize("shared", [True, False], ids=["mapped", "mooncake"])
def test_readers_take_the_newest_slot_and_never_a_torn_one(shared: bool) -> None:
    def state(k: int) -> dict[str, torch.Tensor]:
        return {"w": torch.full((4096,), float(k)), "b": torch.full((3,), -float(k))}

    with (
        WeightPublisher(state(1), version=1) as pub,
        WeightSubscriber(
            pub.manifest(), config=SubscriberConfig(shared_memory=shared, retry_backoff_s=0)
        ) as sub,
    ):
        assert sub.shared is shared
        pub.publish(state(2), version=2)
        snap = sub.read()
        assert snap.version == 2 and torch.equal(snap.tensors["w"], state(2)["w"])  # the newest of two slots

        writes = iter(
            [(3,), (4, 5)]
        )  # during a read: one publication (the other slot), then two (this slot too)

        def publish_midway() -> None:
            for k in next(writes, ()):
                pub.publish(state(k), version=k)

        snap = sub.read(after_data=publish_midway)  # slot 1 read; 3 went into slot 0: still consistent
        assert (snap.version, snap.attempts) == (2, 1) and torch.equal(snap.tensors["b"], state(2)["b"])
        snap = sub.read(after_data=publish_midway)  # slot 0 read (3); 4 and 5 overwrote it: retried, newest
        assert (snap.version, snap.attempts) == (5, 2)
        assert torch.equal(snap.tensors["w"], state(5)["w"]) and torch.equal(snap.tensors["b"], state(5)["b"])

        got: list[tuple[int, float]] = []
        writes = iter([(6, 7)])
        version = sub.read_apply(lambda t, v: got.append((v, float(t["w"][0]))), after_data=publish_midway)
        assert version == 7 and got[-1] == (7, 7.0) and len(got) == (2 if shared else 1)  # mapped: ran again


def test_disk_update_release_and_resume_on_a_bound_engine(
    engine: TorchEngine, tiny_model: Path, tiny_model_b: Path
) -> None:
    a, b = load_checkpoint_dir(tiny_model), load_checkpoint_dir(tiny_model_b)
    with (
        WeightPublisher(a, version=1, lease_wait_s=0) as pub,
        WeightSubscriber(pub.manifest()) as sub,
    ):
        pull_into_engine(engine, sub)
        assert engine.weights.bound
        # a copy into read-only pages would kill this process: the update gives the parameters their own memory
        engine.update_weights_from_disk(str(tiny_model_b), weight_version="disk")
        assert not engine.weights.bound and not _inside(engine, sub, 0) and _serves(engine, b)
        pub.publish(b, version=2)
        pub.publish(a, version=3)  # both slots written: no lease left behind

        assert pull_into_engine(engine, sub) == "3" and engine.weights.bound
        engine.release_memory(["weights"])  # the backup (a spill file) reads the bound values
        assert not engine.weights.bound
        pub.publish(b, version=4)
        pub.publish(b, version=5)  # slot 0, which the engine served before its release
        engine.resume_memory(["weights"])
        assert _serves(engine, a) and not engine.weights.bound

        engine.update_weights(b, weight_version="copy")  # and the in-place copy path on private memory again
        assert _serves(engine, b)


def test_another_dtype_falls_back_to_copying(tiny_model: Path, tiny_model_b: Path) -> None:
    e = _engine(tiny_model_b, dtype="bfloat16")
    try:
        addresses = [p.data_ptr() for p in e.model.parameters()]
        a = load_checkpoint_dir(tiny_model)
        with WeightPublisher(a, version=4) as pub, WeightSubscriber(pub.manifest()) as sub:
            assert sub.shared and pull_into_engine(e, sub) == "4"
            assert not e.weights.bound and [p.data_ptr() for p in e.model.parameters()] == addresses
            assert _serves(e, {n: t.to(torch.bfloat16) for n, t in a.items()})
    finally:
        e.close()


def test_tied_weights_keep_sharing_when_bound() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    store = WeightStore(model, device=torch.device("cpu"), backup="none")
    state = {n: t + 1 for n, t in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied in the published layout too
    with WeightPublisher(state, version=1) as pub, WeightSubscriber(pub.manifest()) as sub:
        layout = [(e.name, e.dtype, e.shape) for e in pub.manifest().tensors]
        assert store.bindable(layout)
        held = sub.lease_newest()
        store.bind(held.tensors, held.lease)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
        store.close()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_the_cores_own_engine_binds_its_publishers_newest_slot_read_only(
    engine: TorchEngine, tiny_model: Path, tiny_model_b: Path
) -> None:
    a, b = load_checkpoint_dir(tiny_model), load_checkpoint_dir(tiny_model_b)
    with WeightPublisher(a, version=7, lease_wait_s=0) as pub:
        own = pub.tensors()  # what the core's worker hands its in-process engine
        assert bind_published(engine, own, "7") and engine.weight_version == "7" and _serves(engine, a)
        writable = {t.untyped_storage().data_ptr() for t in own.values()}
        assert not writable & {
            p.untyped_storage().data_ptr() for p in engine.model.parameters()
        }  # own mapping
        pub.publish(b, version=8)
        assert bind_published(engine, pub.tensors(), "8") and _serves(engine, b)
        pub.publish(a, version=9)  # the engine moved to 8's slot
        assert not bind_published(engine, own, "7")  # 7's slot holds 9 now: nothing binds, nothing changes
        assert _serves(engine, b) and engine.weights.bound and engine.weight_version == "8"
