"""Acceptance 4: an engine killed mid-request; the request completes on another engine and the client sees one
valid response. The record keeps one output segment per engine, and the merged output equals an uninterrupted one."""

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gyre_cell.ports import free_port
from gyre_tito.proxy import ProxyConfig
from gyre_tito.scripted_engine import scripted_logprob
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer, load_tiny_tokenizer

REPLY = " ".join(f"word{i}" for i in range(60)) + " done."
HELD = 25  # tokens engine A streams before its gate holds the request (then it is killed)


def _spawn_engine(
    tok_dir, script, version: str, hold_after: int | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    hold = ["--hold-after", str(hold_after)] if hold_after is not None else []
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gyre_tito.scripted_engine",
            "--tokenizer",
            str(tok_dir),
            "--script",
            str(script),
            "--port",
            str(port),
            "--weight-version",
            version,
            *hold,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # readiness poll of a starting process (not an ordering assumption)
        if p.poll() is not None:
            break
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except httpx.HTTPError:
            time.sleep(0.1)
    p.kill()
    raise RuntimeError("scripted engine did not start")


@pytest.mark.slow
def test_engine_killed_mid_request_completes_elsewhere(tmp_path):
    import anthropic  # slow to import: not at collection

    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    tok = load_tiny_tokenizer(tok_dir)
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"rules": [], "default_reply": REPLY}))
    a, url_a = _spawn_engine(tok_dir, script, "v1", hold_after=HELD)
    b, url_b = _spawn_engine(tok_dir, script, "v2")
    try:
        cfg = ProxyConfig(
            engines=[url_a, url_b], tokenizer=str(tok_dir), store=str(tmp_path / "store"), admin_token="adm"
        )
        with ProxyServer(cfg) as srv:
            eid, cred = srv.register()
            client = anthropic.Anthropic(base_url=srv.url, api_key=cred, max_retries=0)
            out: dict = {}

            def run() -> None:
                with client.messages.stream(
                    model="m", max_tokens=500, messages=[{"role": "user", "content": "talk"}]
                ) as s:
                    out["events"] = [e.type for e in s]
                    out["message"] = s.get_final_message()

            th = threading.Thread(target=run)
            th.start()
            # gate: A (the least-loaded pick with both idle is the first engine) streams HELD tokens and holds
            assert a.stdout.readline().strip() == "holding", "request never reached engine A's gate"
            a.kill()
            a.wait()
            th.join(timeout=60)
            assert not th.is_alive()

            msg = out["message"]
            assert [blk.type for blk in msg.content] == ["text"]
            assert msg.content[0].text == REPLY  # one valid, complete answer
            assert msg.stop_reason == "end_turn"
            assert out["events"].count("message_start") == 1 and out["events"][-1] == "message_stop"

            (rec,) = srv.proxy.executions[eid].records.tree.records()
            want = [*tok.encode(REPLY, add_special_tokens=False).ids, tok.token_to_id("<|im_end|>")]
            assert rec.output_ids == want
            assert rec.output_logprobs == [scripted_logprob(i, t) for i, t in enumerate(want)]
            segs = [(s.engine_id, s.weight_version, s.start, s.end) for s in rec.output_segments]
            assert len(segs) == 2
            (ea, va, s0, p), (eb, vb, p2, n) = segs
            assert (ea, va, s0) == (url_a, "v1", 0) and (eb, vb) == (url_b, "v2")
            assert p == p2 == HELD and n == len(want)  # A's part is exactly what it streamed before dying
            assert rec.metadata["attempts"] == 2
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()
