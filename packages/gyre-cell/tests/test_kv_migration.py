"""KV-cache migration between two torch engines served over HTTP (Mooncake TCP on loopback).

Gates, not sleeps: a request is held after k tokens by pausing its engine from inside the step that produced the
k-th token; expiry is awaited on the migrator's release callback.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gyre_cell.engine.kv_migration import KVExport

Served = Any  # conftest.Served: .engine, .url, .http


PROMPT = [(7 * i + 3) % 500 + 5 for i in range(45)]
N_NEW = 24
SP = {"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}
SMALL = {"max_total_tokens": 2048, "cpu_threads": 1}


serve: Any = None


@pytest.fixture(autouse=True)
def _serve(serve_engine: Any) -> None:
    global serve
    serve = serve_engine


@pytest.fixture
def pair(tiny_model: Path) -> Iterator[tuple[Served, Served]]:
    with serve(tiny_model, **SMALL) as src, serve(tiny_model, **SMALL) as dst:
        yield src, dst


def generate(s: Served, ids: list[int], sp: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    if rid:
        body["rid"] = rid
    r = s.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(out: dict[str, Any]) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def reference(s: Served) -> dict[str, Any]:
    """An uninterrupted generation, then the engine forgets it (no prefix left behind)."""
    out = generate(s, PROMPT, SP)
    assert s.http.post("/flush_cache").status_code == 200
    return out


def cut_mid_decode(src: Served, k: int) -> tuple[KVExport, dict[str, Any]]:
    """Run the request on `src`, hold it after k tokens, pin it (which ends it): (export, partial response)."""
    held = src.hold_after("moving", k)
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(generate(src, PROMPT, SP, rid="moving")))
    t.start()
    assert held.wait(60)
    r = src.http.post("/kv/pin", json={"rid": "moving"})
    assert r.status_code == 200, r.text
    t.join(60)
    src.engine.resume_generation()
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    export = KVExport.model_validate(r.json()).model_copy(update={"source_url": src.url})
    return export, result


def used_tokens(s: Served) -> int:
    return s.http.get("/v1/loads").json()["loads"][0]["num_used_tokens"]


def test_migrated_request_continues_exactly_with_zero_recomputed_context(pair: tuple[Served, Served]) -> None:
    src, dst = pair
    ref = reference(src)
    before_src = used_tokens(src)
    export, part = cut_mid_decode(src, k=10)
    done = part["output_ids"]
    assert len(done) == 10
    # the pin holds the prompt and every emitted token but the last (its KV was never written)
    assert export.token_ids == (PROMPT + done)[:-1]
    assert export.layout.weight_version == "default" and export.nbytes > 0
    assert used_tokens(src) > before_src  # pinned blocks stay occupied after the request ended

    m0 = dst.http.get("/kv/migrations").json()
    r = dst.http.post("/kv/takeover", json={"export": export.model_dump(), "token_ids": PROMPT + done})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["status"] == "installed" and res["migrated_tokens"] == len(PROMPT) + 10 - 1
    assert res["nbytes"] == export.nbytes
    # acknowledged: the source released its pin and its pool is back where it was
    src_m = src.http.get("/kv/migrations").json()
    assert src_m["pins"] == [] and src_m["stats"]["pins_acked"] == 1
    assert used_tokens(src) == before_src

    rest = generate(dst, PROMPT + done, dict(SP, max_new_tokens=N_NEW - 10))
    m1 = dst.http.get("/kv/migrations").json()
    assert rest["meta_info"]["migrated_tokens"] == len(PROMPT) + 9
    assert rest["meta_info"]["cached_tokens"] == len(PROMPT) + 9
    assert m1["context_prefill_tokens_total"] - m0["context_prefill_tokens_total"] == 0
    # the emitted-but-unwritten token only
    assert m1["prefill_tokens_total"] - m0["prefill_tokens_total"] == 1
    assert m1["stats"]["migrated_tokens_used"] == len(PROMPT) + 9 and m1["adopted"] == []

    assert done + rest["output_ids"] == ref["output_ids"]
    got = logprobs(part) + logprobs(rest)
    assert max(abs(a - b) for a, b in zip(got, logprobs(ref), strict=True)) <= 1e-5


def test_without_migration_the_destination_recomputes_the_context(pair: tuple[Served, Served]) -> None:
    src, dst = pair
    ref = reference(src)
    export, part = cut_mid_decode(src, k=6)
    assert src.http.post("/kv/release", json={"migration_id": export.migration_id}).status_code == 200
    m0 = dst.http.get("/kv/migrations").json()
    rest = generate(dst, PROMPT + part["output_ids"], dict(SP, max_new_tokens=N_NEW - 6))
    m1 = dst.http.get("/kv/migrations").json()
    assert m1["context_prefill_tokens_total"] - m0["context_prefill_tokens_total"] == len(PROMPT) + 5
    assert part["output_ids"] + rest["output_ids"] == ref["output_ids"]
    assert src.http.post("/kv/ack", json={"migration_id": export.migration_id}).status_code == 404


@pytest.mark.parametrize("what", ["weight_version", "block_size", "token_ids"])
def test_mismatch_is_refused_and_the_request_recomputed(tiny_model: Path, what: str) -> None:
    dst_cfg = dict(SMALL, kv_block_size=8) if what == "block_size" else SMALL
    with serve(tiny_model, **SMALL) as src, serve(tiny_model, **dst_cfg) as dst:
        ref = reference(src)
        export, part = cut_mid_decode(src, k=5)
        ids = PROMPT + part["output_ids"]
        if what == "weight_version":
            dst.http.post("/update_weight_version", json={"new_version": "7"})
        if what == "token_ids":
            ids = [ids[0] + 1, *ids[1:]]
        used0 = used_tokens(dst)
        r = dst.http.post("/kv/takeover", json={"export": export.model_dump(), "token_ids": ids})
        assert r.status_code == 409 and r.json()["status"] == "refused", r.text
        assert what.split("_")[0] in r.json()["reason"]
        assert used_tokens(dst) == used0  # nothing taken
        # not acknowledged: the source still holds it
        assert src.http.get("/kv/migrations").json()["pins"] != []
        src.http.post("/kv/release", json={"migration_id": export.migration_id})
        if what != "token_ids":
            rest = generate(dst, ids, dict(SP, max_new_tokens=N_NEW - 5))
            assert rest["meta_info"].get("migrated_tokens", 0) == 0
            assert part["output_ids"] + rest["output_ids"] == ref["output_ids"]


def test_unacknowledged_pin_expires_and_occupancy_returns(tiny_model: Path) -> None:
    with serve(tiny_model, **SMALL, kv_pin_ttl_s=0.5) as src:
        ref = reference(src)
        before = used_tokens(src)
        released = threading.Event()
        how: list[str] = []
        src.engine.migrator.on_release.append(lambda mid, h: (how.append(h), released.set()))
        export, _ = cut_mid_decode(src, k=4)
        assert used_tokens(src) > before
        assert released.wait(30)
        assert how == ["expired"]
        assert used_tokens(src) == before
        m = src.http.get("/kv/migrations").json()
        assert m["pins"] == [] and m["stats"]["pins_expired"] == 1
        # an acknowledgement after expiry is refused: a destination never trusts what it read
        assert src.http.post("/kv/ack", json={"migration_id": export.migration_id}).status_code == 404
        # the engine still serves the same tokens
        assert generate(src, PROMPT, SP)["output_ids"] == ref["output_ids"]


def test_installed_but_unused_sequence_expires_at_the_destination(tiny_model: Path) -> None:
    with serve(tiny_model, **SMALL) as src, serve(tiny_model, **SMALL, kv_pin_ttl_s=0.5) as dst:
        reference(src)
        before = used_tokens(dst)
        export, _ = cut_mid_decode(src, k=3)
        gone = threading.Event()
        dst.engine.migrator.on_release.append(lambda mid, how: how == "adopted_expired" and gone.set())
        r = dst.http.post("/kv/takeover", json={"export": export.model_dump()})
        assert r.status_code == 200, r.text
        assert gone.wait(30)
        mig = dst.engine.migrator
        assert mig.stats.adopted_expired == 1
        assert used_tokens(dst) == before and mig.adopted == {}


def test_pin_of_unknown_rid_or_uncached_tokens(tiny_model: Path) -> None:
    with serve(tiny_model, **SMALL) as s:
        assert s.http.post("/kv/pin", json={"rid": "nope"}).status_code == 400
        assert s.http.post("/kv/pin", json={"token_ids": PROMPT}).status_code == 409
        assert s.http.post("/kv/pin", json={}).status_code == 400
        generate(s, PROMPT, SP)  # finished: its full blocks stay in the prefix cache
        r = s.http.post("/kv/pin", json={"token_ids": PROMPT, "ttl_s": 5})
        assert r.status_code == 200
        exp = KVExport.model_validate(r.json())
        assert exp.token_ids == PROMPT[: len(PROMPT) // 16 * 16]
        assert s.http.post("/kv/release", json={"migration_id": exp.migration_id}).status_code == 200
