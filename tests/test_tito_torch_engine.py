"""The TITO proxy on gyre-cell's CPU torch engine (tiny random Qwen3): sampled token sequences are usually not the
canonical tokenization of their text, so this checks on real sampled outputs that recorded tokens are reused
verbatim across turns, that the record holds exactly what the engine returned, and that the tree chains the calls."""

import math
import threading
import time

import pytest
import uvicorn

from gyre_tito.proxy import ProxyConfig
from gyre_tito.testing import ProxyServer


@pytest.mark.slow
def test_openai_agent_on_torch_engine_records_exact_tokens(tmp_path):
    import openai  # slow to import: not at collection

    from gyre_cell.engine import EngineConfig, TorchEngine
    from gyre_cell.engine.server import create_app
    from gyre_cell.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    engine = TorchEngine(EngineConfig(model_path=str(model), device="cpu", max_total_tokens=8192, seed=3))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        cfg = ProxyConfig(
            engines=[url], tokenizer=str(model), store=str(tmp_path / "store"), admin_token="adm"
        )
        with ProxyServer(cfg) as srv:
            eid, cred = srv.register()
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key=cred)
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
            replies = []
            for turn in range(3):
                r = client.chat.completions.create(model="p", messages=messages, max_tokens=24, logprobs=True)
                msg = r.choices[0].message
                assert r.choices[0].finish_reason in ("stop", "length")
                assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
                replies.append(msg.content or "")
                messages += [
                    {"role": "assistant", "content": msg.content or ""},
                    {"role": "user", "content": f"more {turn}"},
                ]
            tree = srv.proxy.executions[eid].records.tree
            recs = list(tree.records())
            assert len(recs) == 3
            sent = [b for b in srv.proxy.pool.engines()]  # engine still registered and idle
            assert sent and sent[0]["inflight"] == 0
            for i, rec in enumerate(recs):
                assert rec.output_ids and len(rec.output_logprobs) == len(rec.output_ids)
                assert all(math.isfinite(lp) and lp <= 0.0 for lp in rec.output_logprobs)
                assert [s.engine_id for s in rec.output_segments] == [url]
                if i and replies[i - 1]:
                    # the previous reply came back as text; its recorded tokens were reused, so the chain holds
                    assert rec.parent_id == recs[i - 1].call_id
                    assert list(tree.context_ids(rec.call_id))[: tree.path_len(recs[i - 1].call_id)] == list(
                        tree.path_tokens(recs[i - 1].call_id)
                    )
            chat = srv.proxy.chat
            canon = [chat.encode_text(chat.decode(r.output_ids)).tolist() == list(r.output_ids) for r in recs]
            # random sampling rarely yields the canonical tokenization: re-tokenizing would have broken the chain
            assert not all(canon), "every sampled output was canonical: the splice was not exercised"
    finally:
        server.should_exit = True
        th.join(timeout=10)
        engine.close()
