"""The torch engine over real HTTP: SGLang shapes, exact log-probs, batching, stops, streaming, errors."""

import threading

import orjson
import pytest
import torch

PROMPTS = [
    [1, 2, 3, 4, 5],
    list(range(10, 50)),
    [7, 7, 7],
    list(range(100, 120)),
    [300],
    list(range(200, 233)),
]


def _gen(http, ids, **sp):
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 16, "ignore_eos": True, **sp},
        "return_logprob": True,
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _concurrent(http, prompts, **sp):
    out = [None] * len(prompts)

    def run(i):
        out[i] = _gen(http, prompts[i], **sp)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def test_response_shape_and_logprobs_match_teacher_forcing(shared, tiny_model):
    from transformers import AutoModelForCausalLM  # slow to import: not at collection

    outs = _concurrent(shared.http, PROMPTS, temperature=0.7, top_p=0.9, top_k=50, sampling_seed=3)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        meta = out["meta_info"]
        assert set(out) == {"text", "output_ids", "meta_info"}
        assert meta["finish_reason"] == {"type": "length", "length": 16}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 16
        assert meta["weight_version"] == "default"
        assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(t[2] is None for t in meta["output_token_logprobs"])
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
        lp = torch.log_softmax(logits / 0.7, -1)
        expected = [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(out["output_ids"])]
        got = [t[0] for t in meta["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-5


def test_batched_greedy_equals_sequential(shared):
    seq = [_gen(shared.http, p, temperature=0.0)["output_ids"] for p in PROMPTS]
    batched = [o["output_ids"] for o in _concurrent(shared.http, PROMPTS, temperature=0.0)]
    assert batched == seq


def test_same_seed_same_sample(shared):
    a = _gen(shared.http, [5, 6, 7], temperature=1.0, sampling_seed=11)
    b = _gen(shared.http, [5, 6, 7], temperature=1.0, sampling_seed=11)
    assert a["output_ids"] == b["output_ids"]


def test_stop_token_ids_and_eos(shared):
    greedy = _gen(shared.http, [1, 2, 3], temperature=0.0)["output_ids"]
    stop_at = greedy[4]
    out = _gen(shared.http, [1, 2, 3], temperature=0.0, stop_token_ids=[stop_at])
    first = greedy.index(stop_at)
    assert out["output_ids"] == greedy[: first + 1]  # the matched token is part of the output, as in SGLang
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_stop_string_trims_text(shared, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    full = _gen(shared.http, [1, 2, 3], temperature=0.0, max_new_tokens=24)
    text = full["text"]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    out = _gen(shared.http, [1, 2, 3], temperature=0.0, max_new_tokens=24, stop=stop)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and text.startswith(out["text"])
    assert stop in tok.decode(out["output_ids"])


def test_streaming_frames_are_cumulative_then_done(shared):
    body = {
        "input_ids": [4, 5, 6],
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
    }
    with shared.http.stream("POST", "/generate", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    outs = [orjson.loads(f) for f in frames[:-1]]
    # Cumulative frames: each extends the one before it. How many frames is the reader's speed, not the contract: a
    # frame per token when the reader keeps up, fewer when tokens queue up meanwhile (only the newest is sent, as
    # SGLang does; a CI run under load read [1, 3, 4, 5]).
    lengths = [len(o["output_ids"]) for o in outs]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 5, lengths
    assert all(o["output_ids"] == outs[-1]["output_ids"][: len(o["output_ids"])] for o in outs)
    assert outs[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(o["meta_info"]["finish_reason"] is None for o in outs[:-1])
    assert (
        outs[-1]["output_ids"]
        == _gen(shared.http, [4, 5, 6], temperature=0.0, max_new_tokens=5)["output_ids"]
    )


def test_prefix_cache_reuses_an_execution_prefix(shared):
    first = _gen(shared.http, list(range(1, 41)), temperature=0.0)
    assert first["meta_info"]["cached_tokens"] == 0
    # the next call of the same execution extends the previous context + output
    nxt = list(range(1, 41)) + first["output_ids"] + [9, 9]
    second = _gen(shared.http, nxt, temperature=0.0)
    assert second["meta_info"]["cached_tokens"] == (len(nxt) - 1) // 16 * 16 >= 48


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [1, 512]}, "out of range"),
        ({"input_ids": [-1]}, "out of range"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": "abc"}, "input_ids"),
        ({"sampling_params": {}}, "input_ids"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "n > 1"),
    ],
)
def test_bad_input_is_400_and_server_stays_up(shared, body, needle):
    r = shared.http.post("/generate", json=body)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]
    assert _gen(shared.http, [1, 2], max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_malformed_json_and_unknown_rid(shared):
    r = shared.http.post("/generate", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = shared.http.post("/abort_request", json={"rid": "nope"})
    assert r.status_code == 400 and "unknown rid" in r.json()["error"]["message"]


def test_info_endpoints(shared):
    info = shared.http.get("/model_info").json()
    assert info["weight_version"] == "default" and info["model_type"] == "qwen3"
    assert shared.http.get("/health").status_code == 200
    assert shared.http.get("/health_generate").status_code == 200
    loads = shared.http.get("/v1/loads").json()["loads"][0]
    assert loads["num_running_reqs"] == 0 and loads["max_total_num_tokens"] == 65536
    assert shared.http.post("/flush_cache").status_code == 200
