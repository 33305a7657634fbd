"""Scripted replies inside the real engine (`EngineConfig.scripted_replies`): the script picks the tokens, the model
gives their log-probs, exactly what teacher forcing the model on them gives."""

import json

import pytest
import torch

from gyre_cell.engine.script import ReplyScript

PROMPT = "<|im_start|>user\nWhat is the weather like?<|im_end|>\n<|im_start|>assistant\n"
OTHER = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def script_file(tmp_path):
    path = tmp_path / "script.json"
    rules = [{"contains": ["weather"], "reply": "It is sunny and warm."}]
    path.write_text(json.dumps({"rules": rules, "default_reply": "Blue."}))
    return path


def _generate(served, ids, **sp):
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.7, **sp},
        "return_logprob": True,
    }
    r = served.http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_engine_produces_the_scripted_reply_with_the_models_own_logprobs(
    serve_engine, tiny_model, script_file
):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow to import: not at collection

    tok = AutoTokenizer.from_pretrained(tiny_model)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    reply = [*tok.encode("It is sunny and warm.", add_special_tokens=False), end]
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with serve_engine(tiny_model, scripted_replies=str(script_file)) as served:
        out = _generate(served, prompt)
        assert out["output_ids"] == reply
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + reply])).logits[0].float()
        lp = torch.log_softmax(logits / 0.7, -1)
        expected = [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(reply)]
        got = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-5
        assert len(set(round(x, 3) for x in got)) > 1  # the model's values, not a constant

        # A continued output (its input ends with part of the reply) gets the rest; a prompt no rule matches the
        # default reply; max_new_tokens still cuts a reply short.
        assert _generate(served, prompt + reply[:3])["output_ids"] == reply[3:]
        other = tok.encode(OTHER, add_special_tokens=False)
        assert _generate(served, other)["output_ids"] == [*tok.encode("Blue.", add_special_tokens=False), end]
        short = _generate(served, prompt, max_new_tokens=2)
        assert short["output_ids"] == reply[:2] and short["meta_info"]["finish_reason"]["type"] == "length"


def test_a_script_needs_a_chat_tokenizer(script_file):
    with pytest.raises(ValueError, match="tokenizer"):
        ReplyScript(script_file, None)


def test_a_held_prompt_is_never_answered_until_it_is_aborted(serve_engine, tiny_model, tmp_path):
    import threading

    from transformers import AutoTokenizer

    from gyre_cell.engine.request import SamplingSpec

    path = tmp_path / "script.json"
    path.write_text(json.dumps({"default_reply": "Blue.", "hold": ["weather"]}))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with serve_engine(tiny_model, scripted_replies=str(path)) as served:
        engine = served.engine
        ended: list[dict] = []
        done = threading.Event()

        def sink(out, finished):
            if finished:
                ended.append(out)
                done.set()

        spec = SamplingSpec(max_new_tokens=16)
        prompt = tok.encode(PROMPT, add_special_tokens=False)
        engine.submit(
            rid="stalled", input_ids=prompt, sampling=spec, return_logprob=True, stream=False, sink=sink
        )
        # another request is served while the held one waits
        other = _generate(served, tok.encode(OTHER, add_special_tokens=False))
        assert other["meta_info"]["finish_reason"]["type"] == "stop" and not ended
        assert engine.abort("stalled") == 1
        assert done.wait(30)
        assert ended[0]["output_ids"] == [] and ended[0]["meta_info"]["finish_reason"]["type"] == "abort"
