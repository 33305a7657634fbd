"""Cell role switching against the real torch engine server: `gyre-cell engine serve` in a subprocess, and the round
trip on the same server in-process, whose gate (Served.hold_after) holds a request while the switch starts."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import torch

from gyre_cell.client import TorchEngineClient
from gyre_cell.errors import IllegalRoleTransition, RoleSwitchError
from gyre_cell.ports import free_port
from gyre_cell.roles import (
    CellRoleManager,
    CellRoleManagerConfig,
    DiskWeights,
    SwitchReport,
    TorchTrainingState,
)
from gyre_sched.types import CellRole

PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine_url(tiny_model: Path) -> Iterator[str]:
    port = free_port()
    exe = Path(sys.executable).parent / "gyre-cell"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gyre_cell.cli"]
    cmd += ["engine", "serve", "--model", str(tiny_model), "--port", str(port), "--weights-backup", "none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "engine exited"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@torch.no_grad()
def _greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(ids) :]


class _Trainer:
    """A real torch training side: a model with grads and Adam state, offloaded to disk while in rollout."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(64, 64)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.model(torch.randn(4, 64)).pow(2).sum().backward()
        self.opt.step()
        self.state = TorchTrainingState(self.model, self.opt)
        self.reference = {n: p.detach().clone() for n, p in self.model.named_parameters()}


async def _memory(client: TorchEngineClient) -> dict[str, int]:
    return (await client.loads())["loads"][0]["memory"]


async def _decoding(client: TorchEngineClient) -> bool:
    load = (await client.loads())["loads"][0]
    return load["num_running_reqs"] > 0 and load["num_used_tokens"] > len(PROMPT)


@pytest.mark.slow
def test_round_trip_serves_new_weights_and_releases_memory(
    served_without_backup, tiny_model: Path, tiny_model_b: Path
) -> None:
    engine_url = served_without_backup.url
    expected_a = _greedy(_model(tiny_model), PROMPT, 8)
    expected_b = _greedy(_model(tiny_model_b), PROMPT, 8)
    assert expected_a != expected_b
    trainer = _Trainer()
    full_bytes = trainer.state.nbytes()

    async def run() -> None:
        async with TorchEngineClient(engine_url) as client:
            await trainer.state.offload()  # the cell starts in rollout: training state is off the device
            assert trainer.state.nbytes() == 0
            before = await client.generate(PROMPT, GREEDY)
            assert before.output_ids == expected_a
            mem0 = await _memory(client)
            assert mem0["weights_bytes"] > 0 and mem0["kv_cache_bytes"] > 0

            mgr = CellRoleManager(client, trainer.state, CellRoleManagerConfig(cell="3"))
            # A request still running when the switch starts is aborted (the proxy retries it elsewhere).
            # The gate: the engine holds the request once it has 4 tokens (Served.hold_after), so it still runs,
            # holding KV, when the switch starts (a polled one could end first on a loaded machine).
            held = served_without_backup.hold_after("long", 4)
            long = asyncio.create_task(
                client.generate(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, rid="long")
            )
            assert await asyncio.to_thread(held.wait, 60), "the request never reached its gate"
            assert await _decoding(client)
            rep = await mgr.to_training()
            cut = await long
            assert cut.finish_reason is not None and cut.finish_reason.type == "abort"
            assert cut.completion_tokens == 4  # exactly what it had at the gate

            assert mgr.role is CellRole.TRAINING
            assert (rep.from_role, rep.to_role, rep.cell) == (CellRole.ROLLOUT, CellRole.TRAINING, "3")
            names = [p.name for p in rep.phases]
            assert names == ["pause_generation", "flush_cache", "release_memory", "restore_training"]
            assert rep.total_s >= sum(p.seconds for p in rep.phases) > 0
            assert await _memory(client) == {"weights_bytes": 0, "kv_cache_bytes": 0}
            info = (await client._http.get("/server_info")).json()
            assert info["released_tags"] == ["cuda_graph", "kv_cache", "weights"] and info["paused"]
            assert trainer.state.nbytes() == full_bytes
            for n, p in trainer.model.named_parameters():
                assert torch.equal(p, trainer.reference[n]), n

            rep2 = await mgr.to_rollout(DiskWeights(tiny_model_b, "v1"))
            assert mgr.role is CellRole.ROLLOUT and rep2.weight_version == "v1"
            assert [p.name for p in rep2.phases] == [
                "offload_training",
                "resume_weights_memory",
                "load_weights",
                "resume_kv_memory",
                "continue_generation",
            ]
            assert trainer.state.nbytes() == 0
            assert await client.weight_version() == "v1"
            mem2 = await _memory(client)
            assert mem2 == mem0
            after = await client.generate(PROMPT, GREEDY)
            assert after.output_ids == expected_b and after.weight_version == "v1"

            again = SwitchReport.model_validate(orjson.loads(rep2.model_dump_json()))
            assert again == rep2

            # Back to the original weights so other tests see the fixture's model.
            await mgr.to_training()
            await mgr.to_rollout(DiskWeights(tiny_model, "default"))
            assert (await client.generate(PROMPT, GREEDY)).output_ids == expected_a

    asyncio.run(run())


@pytest.mark.slow
def test_illegal_transitions_and_retry_after_failed_phase(engine_url: str, tiny_model: Path) -> None:
    trainer = _Trainer()

    async def boom(_: object) -> str:
        raise RuntimeError("publisher unreachable")

    async def run() -> None:
        async with TorchEngineClient(engine_url) as client:
            await trainer.state.offload()
            mgr = CellRoleManager(client, trainer.state)
            with pytest.raises(IllegalRoleTransition, match="from role rollout"):
                await mgr.to_rollout(DiskWeights(tiny_model, "x"))
            assert mgr.role is CellRole.ROLLOUT and (await client.weight_version()) != "x"

            results = await asyncio.gather(mgr.to_training(), mgr.to_training(), return_exceptions=True)
            assert sum(isinstance(r, IllegalRoleTransition) for r in results) == 1
            assert mgr.role is CellRole.TRAINING
            with pytest.raises(IllegalRoleTransition):
                await mgr.to_training()

            with pytest.raises(RoleSwitchError, match="load_weights") as info:
                await mgr.to_rollout(boom)
            assert info.value.phase == "load_weights" and mgr.role is CellRole.TO_ROLLOUT
            with pytest.raises(IllegalRoleTransition):
                await mgr.to_training()
            rep = await mgr.to_rollout(DiskWeights(tiny_model, "default"))  # retry from TO_ROLLOUT
            assert mgr.role is CellRole.ROLLOUT and rep.from_role is CellRole.TRAINING
            out = await client.generate(PROMPT, GREEDY)
            assert out.finish_reason is not None and out.finish_reason.type == "length"

    asyncio.run(run())


@pytest.mark.slow
def test_to_rollout_with_mooncake_loader(engine_url: str, tiny_model: Path, tiny_model_b: Path) -> None:
    from gyre_cell.transfer import WeightManifest, WeightSubscriber, mooncake_engine_loader
    from gyre_cell.transfer.peer import publisher_process

    expected_b = _greedy(_model(tiny_model_b), PROMPT, 8)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=publisher_process, args=(child, {"dir": str(tiny_model_b)}, 7), daemon=True)
    proc.start()
    child.close()
    try:
        conn.send(("manifest",))
        assert conn.poll(120)
        status, raw = conn.recv()
        assert status == "ok", raw

        async def run() -> None:
            async with TorchEngineClient(engine_url) as client:
                trainer = _Trainer()
                await trainer.state.offload()
                mgr = CellRoleManager(client, trainer.state)
                with WeightSubscriber(WeightManifest.model_validate_json(raw)) as sub:
                    await mgr.to_training()
                    rep = await mgr.to_rollout(mooncake_engine_loader(sub))
                assert rep.weight_version == "7" and await client.weight_version() == "7"
                assert (await client.generate(PROMPT, GREEDY)).output_ids == expected_b
                await mgr.to_training()
                await mgr.to_rollout(DiskWeights(tiny_model, "default"))

        asyncio.run(run())
    finally:
        conn.send(("close",))
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        conn.close()
