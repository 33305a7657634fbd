"""KV migration from a source engine in its own process that is killed while the destination reads its blocks.

The source process holds the request at a gate once it has 5 tokens (its engine pauses in the step that made the
5th, as a pause in place leaves it: stop 32's CI saw a 1000-token request finish before the client's pause landed);
the kill happens inside the destination's read gate."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gyre_cell.engine.kv_migration import KVExport

PROMPT = [(11 * i + 5) % 480 + 7 for i in range(50)]
N_NEW = 1000
HELD_AT = 5
SP = {"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}

pytestmark = pytest.mark.slow

# The source engine served over HTTP in its own process, with the gate on request "moving".
SOURCE = textwrap.dedent(
    f"""
    import sys, uvicorn
    from gyre_cell.engine import EngineConfig, TorchEngine
    from gyre_cell.engine.server import create_app

    engine = TorchEngine(EngineConfig(model_path=sys.argv[1], max_total_tokens=2048, cpu_threads=1))
    check_finish = engine._check_finish

    def gate(req, token):
        out = check_finish(req, token)
        if req.rid == "moving" and len(req.output_ids) == {HELD_AT} and out is None:
            engine.paused = True  # the engine's lock is held: it stops before its next step
        return out

    engine._check_finish = gate
    uvicorn.run(create_app(engine), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
    """
)


@pytest.fixture
def source(tiny_model: Path, port_factory: Any) -> Iterator[tuple[subprocess.Popen, str]]:
    port = port_factory()
    cmd = [sys.executable, "-c", SOURCE, str(tiny_model), str(port)]
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
                time.sleep(0.2)  # polling a starting process, not ordering events
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=20)


def test_source_killed_during_transfer_falls_back_to_recompute(
    source: tuple[subprocess.Popen, str], tiny_model: Path, serve_engine: Any
) -> None:
    proc, url = source
    body = {"input_ids": PROMPT, "sampling_params": SP, "return_logprob": True}
    with httpx.Client(base_url=url, timeout=60) as http:
        ref = http.post("/generate", json=body).json()
        assert http.post("/flush_cache").status_code == 200
        # mid-decode: stream until the request's 5 tokens arrived (held there), pause in place, pin (ends it)
        last: dict[str, Any] = {}
        export = None
        with (
            httpx.Client(base_url=url, timeout=60) as ctl,
            http.stream("POST", "/generate", json=dict(body, rid="moving", stream=True)) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                last = orjson.loads(line[5:])
                if export is None and len(last["output_ids"]) == HELD_AT:
                    assert ctl.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
                    pin = ctl.post("/kv/pin", json={"rid": "moving"})
                    assert pin.status_code == 200, pin.text
                    export = KVExport.model_validate(pin.json()).model_copy(update={"source_url": url})
        assert export is not None and last["meta_info"]["finish_reason"]["type"] == "abort"
    done = last["output_ids"]
    assert len(done) == HELD_AT and export.token_ids == (PROMPT + done)[:-1]

    with serve_engine(tiny_model, max_total_tokens=2048, cpu_threads=1) as dst:
        used0 = dst.http.get("/v1/loads").json()["loads"][0]["num_used_tokens"]

        # the gate: the destination holds its blocks, the read has not begun
        def kill_source(
            _: KVExport,
        ) -> None:
            proc.kill()
            proc.wait(timeout=20)

        dst.engine.migrator.before_read = kill_source
        r = dst.http.post(
            "/kv/takeover", json={"export": export.model_dump(), "token_ids": PROMPT + done, "timeout_s": 20}
        )
        assert r.status_code == 502, r.text
        assert r.json()["status"] == "failed" and "failed (rc" in r.json()["reason"]  # the read itself failed
        assert dst.http.get("/v1/loads").json()["loads"][0]["num_used_tokens"] == used0  # blocks given back
        assert dst.engine.migrator.adopted == {}
        rest = dst.http.post(
            "/generate",
            json={
                "input_ids": PROMPT + done,
                "sampling_params": dict(SP, max_new_tokens=N_NEW - len(done)),
                "return_logprob": True,
            },
        ).json()
        assert rest["meta_info"].get("migrated_tokens", 0) == 0
        assert done + rest["output_ids"] == ref["output_ids"]
        got = [
            t[0]
            for t in last["meta_info"]["output_token_logprobs"] + rest["meta_info"]["output_token_logprobs"]
        ]
        want = [t[0] for t in ref["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
