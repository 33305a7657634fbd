"""The trainer computes each call's log-probs at the temperature that call was sampled at.

Under the proxy's `pass` sampling policy a harness chooses its temperature per call. Here one execution makes two
chained calls at 0.6 and 1.7 on gyre-cell's CPU engine (tiny Qwen3). The proxy records each call's temperature
(`metadata["sampling"]["used"]`), the exported trajectory carries it per target token, the packing buffer puts it
into the micro-step's shard, and the torch backend's log-probs on that micro-step equal the engine's behaviour
log-probs within 1e-5. The same shard at one temperature for all tokens does not (the check can fail)."""

import threading
import time

import httpx
import pytest
import torch
import uvicorn

from gyre_tito.export import read_trajectories
from gyre_tito.proxy import ProxyConfig
from gyre_tito.testing import ProxyServer

TEMPS = (0.6, 1.7)


@pytest.fixture
def engine_url(tmp_path):
    from gyre_cell.engine import EngineConfig, TorchEngine
    from gyre_cell.engine.server import create_app
    from gyre_cell.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    engine = TorchEngine(EngineConfig(model_path=str(model), device="cpu", max_total_tokens=4096, seed=5))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.05)  # uvicorn has no started event; this only polls for the bound socket
    try:
        yield model, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        th.join(timeout=10)
        engine.close()


@pytest.mark.slow
def test_trainer_logprobs_at_each_calls_recorded_temperature(tmp_path, engine_url):
    from gyre_train.backends.base import PackedTensors
    from gyre_train.backends.torch_backend import TorchBackend, TorchBackendConfig
    from gyre_train.buffer import ExecutionEntry, TrajectoryBuffer
    from gyre_train.packing import PackingConfig, StreamPackingBuffer
    from gyre_train.types import MicroStep

    model, url = engine_url
    out = tmp_path / "out"
    cfg = ProxyConfig(
        engines=[url],
        tokenizer=str(model),
        store=str(tmp_path / "store"),
        admin_token="adm",
        sampling_policy="pass",
        export_dirs=[str(out)],
    )
    with ProxyServer(cfg) as srv:
        eid, cred = srv.register("ex", group_id="g")
        messages = [{"role": "user", "content": "hello there"}]
        for temperature in TEMPS:
            r = httpx.post(
                f"{srv.url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {cred}"},
                json={"model": "p", "messages": messages, "max_tokens": 12, "temperature": temperature},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            messages += [
                {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""},
                {"role": "user", "content": "go on"},
            ]
        records = list(srv.proxy.executions[eid].records.tree.records())
        assert [r.metadata["sampling"]["used"]["temperature"] for r in records] == list(TEMPS)
        assert records[1].parent_id == records[0].call_id  # one chain: both calls in one trajectory
        r = srv.admin(
            "POST", f"/admin/executions/{eid}/export", {"j_max": 1, "seed": 0, "path": str(out / "t.parquet")}
        )
        assert r.status_code == 200, r.text

    (traj,) = read_trajectories(out / "t.parquet")  # through the Parquet wire
    on_targets = [t for t, m in zip(traj.temperatures, traj.target_mask, strict=True) if m]
    assert on_targets == [TEMPS[0]] * len(records[0].output_ids) + [TEMPS[1]] * len(records[1].output_ids)

    buffer = TrajectoryBuffer(1)
    buffer.add_group("g", 0, [ExecutionEntry(eid, 1.0, 1.0, (traj,))])
    packer = StreamPackingBuffer(PackingConfig(group_size=1, batch_groups=1, tokens_per_shard=4096), buffer)
    packer.open_batch(0, 0)
    (ms,) = packer.next_microsteps()
    ms = MicroStep.model_validate_json(ms.model_dump_json())  # as the core sends it to a cell
    (shard,) = ms.shards
    assert ms.temperature == 1.0 and shard.temperatures is not None

    backend = TorchBackend(TorchBackendConfig(model_path=str(model), optimizer=False))
    targets = torch.tensor([s >= 0 for s in shard.exec_slot])
    behaviour = torch.tensor(shard.behavior_logprobs, dtype=torch.float64)[targets]
    assert int(targets.sum()) == len(records[0].output_ids) + len(records[1].output_ids)
    trainer = backend.logprobs(PackedTensors.from_shard(shard), ms.temperature).double()[targets]
    assert (trainer - behaviour).abs().max() < 1e-5
    one_temperature = PackedTensors.from_shard(shard.model_copy(update={"temperatures": None}))
    wrong = backend.logprobs(one_temperature, ms.temperature).double()[targets]
    assert (wrong - behaviour).abs().max() > 1e-2
