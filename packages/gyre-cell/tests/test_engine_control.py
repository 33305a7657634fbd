"""Abort, pause modes, memory release/resume and weight updates of the torch engine over HTTP."""

import threading
import time

import pytest
import torch

from gyre_cell.client import TorchEngineClient
from gyre_cell.tensor_codec import encode_named_tensors
from gyre_cell.weight_sync import GroupSpec, join_group, send_weights


def _body(ids, n=400, **extra):
    return {
        "input_ids": ids,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True},
        **extra,
    }


def _background(http, body):
    box = {}
    t = threading.Thread(target=lambda: box.update(r=http.post("/generate", json=body)))
    t.start()
    return t, box


def _held(event: threading.Event) -> None:
    """Until the request reaches its gate (conftest's Served.hold_after): running, k tokens out, the engine paused."""
    assert event.wait(60), "the request never reached its gate"


def _greedy(http, ids=(3, 1, 4, 1, 5), n=12):
    r = http.post("/generate", json=_body(list(ids), n))
    assert r.status_code == 200, r.text
    return r.json()


def test_abort_returns_partial_output(served):
    held = served.hold_after("long", 7)
    t, box = _background(served.http, _body([1, 2, 3], 4000, rid="long"))
    _held(held)
    assert served.http.post("/abort_request", json={"rid": "long"}).status_code == 200
    t.join(10)
    out = box["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) == 7  # the partial output, as far as it went
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def _assert_teacher_forced(model_dir, prompt, out):
    """Every returned log-prob equals a teacher-forced float32 forward over prompt + output."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
    lp = torch.log_softmax(logits, -1)  # greedy requests report unscaled log-probs
    expected = [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(out["output_ids"])]
    got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-4


PROMPT = [3, 1, 4, 1, 5]


def test_pause_in_place_then_continue_completes(served, tiny_model):
    held = served.hold_after("p", 5)
    t, box = _background(served.http, _body(PROMPT, 1500, rid="p"))
    _held(held)
    assert served.http.post("/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
    assert len(served.engine.running[0].output_ids) == 5 and served.engine.running[0].seq is not None
    # release refuses while a request holds KV, like SGLang
    r = served.http.post("/release_memory_occupation", json={})
    assert r.status_code == 400 and "idle" in r.json()["error"]["message"]
    served.http.post("/continue_generation", json={})
    t.join(120)
    out = box["r"].json()
    assert len(out["output_ids"]) == 1500 and out["meta_info"]["num_retractions"] == 0
    _assert_teacher_forced(tiny_model, PROMPT, out)


def test_pause_retract_recomputes_and_release_resume_roundtrip(served, tiny_model):
    held = served.hold_after("r", 5)
    t, box = _background(served.http, _body(PROMPT, 1500, rid="r"))
    _held(held)
    served.http.post("/pause_generation", json={"mode": "retract"})
    assert not served.engine.running and len(served.engine.waiting) == 1
    w_bytes = served.engine.weights.nbytes()
    assert (
        served.http.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}).status_code
        == 200
    )
    assert served.engine.weights.nbytes() == 0 and served.engine.kv.nbytes() == 0
    assert all(p.numel() == 0 for p in served.engine.model.parameters())
    assert served.http.get("/v1/loads").json()["loads"][0]["memory"] == {
        "weights_bytes": 0,
        "kv_cache_bytes": 0,
    }
    assert served.http.get("/health_generate").status_code == 503
    served.http.post("/continue_generation", json={})  # still released: nothing may run
    time.sleep(0.2)
    assert not served.engine.running
    served.http.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]})
    assert served.engine.weights.nbytes() == w_bytes
    t.join(120)
    out = box["r"].json()
    assert len(out["output_ids"]) == 1500 and out["meta_info"]["num_retractions"] == 1
    _assert_teacher_forced(tiny_model, PROMPT, out)


def test_pause_abort_and_bad_tags(served):
    held = served.hold_after("a", 3)
    t, box = _background(served.http, _body([1, 2], 4000, rid="a"))
    _held(held)
    served.http.post("/pause_generation", json={"mode": "abort"})
    t.join(10)
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    r = served.http.post("/release_memory_occupation", json={"tags": ["gpu"]})
    assert r.status_code == 400 and "unknown memory tags" in r.json()["error"]["message"]
    assert served.http.post("/release_memory_occupation").status_code == 200  # no body = all tags
    assert served.http.post("/resume_memory_occupation").status_code == 200
    served.http.post("/continue_generation", json={})
    assert _greedy(served.http)["meta_info"]["finish_reason"]["type"] == "length"


def test_update_weights_from_disk_changes_outputs_and_version(served, tiny_model, tiny_model_b):
    before = _greedy(served.http)["output_ids"]
    r = served.http.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_model_b), "weight_version": "v1"}
    )
    assert r.status_code == 200 and r.json()["success"] is True
    after = _greedy(served.http)
    assert after["output_ids"] != before and after["meta_info"]["weight_version"] == "v1"
    assert served.http.get("/model_info").json()["weight_version"] == "v1"
    served.http.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_model), "weight_version": "v2"}
    )
    assert _greedy(served.http)["output_ids"] == before
    r = served.http.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["success"] is False


def test_update_weights_from_tensor_needs_session_and_valid_tensors(served, tiny_model_b):
    from safetensors.torch import load_file

    new = load_file(str(tiny_model_b / "model.safetensors"))
    before = _greedy(served.http)["output_ids"]
    client = TorchEngineClient(served.url)
    body = client.tensor_update_body(new.items(), weight_version="t1")
    r = served.http.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]
    assert served.http.post("/begin_weight_update", json={"selector": "all"}).json()["success"]
    bad_name = {"serialized_named_tensors": [encode_named_tensors({"nope.weight": torch.zeros(2)})]}
    r = served.http.post("/update_weights_from_tensor", json=bad_name)
    assert r.status_code == 400 and "unknown parameter" in r.json()["message"]
    bad_shape = {"serialized_named_tensors": [encode_named_tensors({"model.norm.weight": torch.zeros(3)})]}
    assert served.http.post("/update_weights_from_tensor", json=bad_shape).status_code == 400
    garbage = {"serialized_named_tensors": ["not base64!"]}
    assert served.http.post("/update_weights_from_tensor", json=garbage).status_code == 400
    assert _greedy(served.http)["output_ids"] == before  # failed updates changed nothing
    assert served.http.post("/update_weights_from_tensor", json=body).status_code == 200
    assert served.http.post("/end_weight_update", json={}).json()["success"]
    assert served.http.post("/end_weight_update", json={}).status_code == 400
    out = _greedy(served.http)
    assert out["output_ids"] != before and out["meta_info"]["weight_version"] == "t1"


def test_update_weights_from_distributed_gloo(served, tiny_model_b, port_factory):
    from safetensors.torch import load_file

    new = load_file(str(tiny_model_b / "model.safetensors"))
    port = port_factory()
    spec = GroupSpec(master_address="127.0.0.1", master_port=port, world_size=2, group_name="g")
    trainer = {}
    t = threading.Thread(target=lambda: trainer.update(pg=join_group(spec, rank=0)))
    t.start()
    r = served.http.post(
        "/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "gloo",
        },
    )
    t.join(30)
    assert r.status_code == 200 and r.json()["success"], r.text
    served.http.post("/begin_weight_update", json={})
    body = TorchEngineClient.distributed_update_body(
        [(n, x.dtype, tuple(x.shape)) for n, x in new.items()], group_name="g", weight_version="d1"
    )
    sender = threading.Thread(target=send_weights, args=(trainer["pg"], list(new.items())))
    sender.start()
    r = served.http.post("/update_weights_from_distributed", json=body)
    sender.join(30)
    served.http.post("/end_weight_update", json={})
    assert r.status_code == 200, r.text
    for name, p in served.engine.model.named_parameters():
        assert torch.equal(p.detach(), new[name])
    assert served.http.get("/model_info").json()["weight_version"] == "d1"
    r = served.http.post(
        "/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "nccl",
        },
    )
    assert r.status_code == 400 and "gloo" in r.json()["message"]


def test_weight_version_spans_when_updated_mid_generation(served, tiny_model_b):
    held = served.hold_after("w", 9)
    t, box = _background(served.http, _body([1, 2, 3], 1500, rid="w"))
    _held(held)
    served.http.post("/pause_generation", json={"mode": "in_place"})
    served.http.post(
        "/update_weights_from_disk", json={"model_path": str(tiny_model_b), "weight_version": "v9"}
    )
    served.http.post("/continue_generation", json={})
    t.join(30)
    meta = box["r"].json()["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v9"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == 9 == spans[1]["start"] and spans[1]["end"] == 1500
    assert meta["weight_version"] == "v9"


@pytest.mark.parametrize("backup", ["cpu", "none"])
def test_release_backup_modes(tiny_model, backup, serve_engine):
    with serve_engine(tiny_model, weights_backup=backup) as s:
        before = _greedy(s.http)["output_ids"]
        s.http.post("/release_memory_occupation", json={"tags": ["weights"]})
        s.http.post("/resume_memory_occupation", json={"tags": ["weights"]})
        zeros = all(float(p.detach().abs().sum()) == 0 for p in s.engine.model.parameters())
        assert zeros == (backup == "none")  # without a backup an update must follow (like SGLang)
        if backup == "none":
            s.http.post("/update_weights_from_disk", json={"model_path": str(tiny_model)})
        assert _greedy(s.http)["output_ids"] == before
