"""The engine pool's translation to vLLM's token-in/token-out route (the live server: tests/test_vllm.py)."""

from types import SimpleNamespace
from typing import get_args

import pytest

from gyre_tito import vllm_wire
from gyre_tito.cli import ENGINE_APIS
from gyre_tito.engine_client import EngineAPI, EnginePoolConfig


def test_the_cli_offers_exactly_the_pools_engine_apis():
    assert list(get_args(EngineAPI)) == ENGINE_APIS


def test_a_vllm_pool_never_pins_kv():
    assert EnginePoolConfig(api="vllm").kv_migration is False
    assert EnginePoolConfig(api="sglang").kv_migration is True


def test_the_proxys_sampling_parameters_become_vllms():
    sp = {
        "max_new_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 5,
    }
    out = vllm_wire.sampling_params(sp)
    assert out == {
        "logprobs": 0,
        "n": 1,
        "max_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "seed": 5,
        "detokenize": False,
    }
    assert vllm_wire.sampling_params({"max_new_tokens": 1, "stop": ["\n"]})["detokenize"] is True
    with pytest.raises(ValueError, match="logprob_start_len"):
        vllm_wire.sampling_params({"logprob_start_len": -1})


def _chunk(ids, lps, finish=None, spans=None, reason=None):
    content = [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps, strict=True)]
    choice = {
        "token_ids": ids,
        "logprobs": {"content": content},
        "finish_reason": finish,
        "stop_reason": reason,
        "weight_versions": spans,
    }
    return {"choices": [choice]}


def test_streamed_chunks_take_their_versions_from_the_last_chunks_spans():
    att = SimpleNamespace(ids=[], logprobs=[], versions=[], finish=None, matched=None, cached_tokens=None)
    vllm_wire.apply_chunk(att, _chunk([5, 6], [-1.0, -2.0]), "3")
    assert att.versions == ["3", "3"] and att.finish is None
    spans = [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    vllm_wire.apply_chunk(att, _chunk([7], [-0.5], "stop", spans), "3")
    assert att.ids == [5, 6, 7] and att.logprobs == [-1.0, -2.0, -0.5] and att.versions == ["3", "4", "4"]
    # an EOS: vLLM gives no stop_reason, the last token is it
    assert att.finish == "stop" and att.matched == 7


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (_chunk([5], [None]), "non-finite"),
        (
            {"choices": [{"token_ids": [5], "logprobs": {"content": [{"token_id": 6, "logprob": -1.0}]}}]},
            "other",
        ),
        ({"choices": [{"token_ids": [5], "logprobs": None}]}, "no log-probs"),
        ({"error": {"message": "boom"}}, "boom"),
    ],
)
def test_a_bad_answer_is_an_engine_failure_never_a_record(chunk, message):
    att = SimpleNamespace(ids=[], logprobs=[], versions=[], finish=None, matched=None, cached_tokens=None)
    with pytest.raises(ValueError, match=message):
        vllm_wire.apply_chunk(att, chunk, "0")
