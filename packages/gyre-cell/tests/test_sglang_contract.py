"""The SGLang adapter against SGLang 0.5.23's own request classes (`sglang.srt.managers.io_struct`) and
recorded response shapes. SGLang's server cannot run here, so a recording transport answers; every body
the adapter sends is validated the way SGLang's FastAPI layer validates it (pydantic over the io_struct
class) plus a check that it carries no field SGLang does not know."""

import argparse
import asyncio
import dataclasses
import json
import os
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from gyre_cell.sglang_adapter import (
    SGLangEngine,
    SGLangLaunchConfig,
    SGLangServer,
    build_launch_command,
    write_api_key_config,
)
from gyre_cell.types import GenerationResult

pytestmark = pytest.mark.slow  # importing sglang's io_struct takes 15-40 s on these machines

RECORDED = json.loads((Path(__file__).parent / "data" / "sglang_0.5.23_responses.json").read_text())


@pytest.fixture(scope="module")
def io():
    return pytest.importorskip("sglang.srt.managers.io_struct")


def _validate(cls, body: dict) -> object:
    from pydantic import TypeAdapter

    if dataclasses.is_dataclass(cls):
        known = {f.name for f in dataclasses.fields(cls)}
    else:
        known = {f.name for f in msgspec.structs.fields(cls)}
    unknown = set(body) - known
    assert not unknown, f"{cls.__name__} has no fields {unknown}"
    return TypeAdapter(cls).validate_python(body)


class Recorder:
    """httpx transport that records request bodies and answers with SGLang's recorded shapes."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []
        self.generate_variant = "POST /generate"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        key = f"{request.method} {request.url.path}"
        body = json.loads(request.content) if request.content else {}
        self.sent.append((request.url.path, body))
        if key == "POST /generate" and body.get("stream"):
            rec = RECORDED["POST /generate stream"]
            sse = "".join(f"data: {json.dumps(f)}\n\n" for f in rec["sse"]) + "data: [DONE]\n\n"
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        rec = RECORDED[self.generate_variant if key == "POST /generate" else key]
        if "json" in rec:
            return httpx.Response(rec["status"], json=rec["json"])
        return httpx.Response(rec["status"], text=rec["body"])


def test_every_request_body_validates_against_sglang_io_struct(io):
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    rec = Recorder()
    eng = SGLangEngine("http://sglang", transport=httpx.MockTransport(rec))
    named = [("model.norm.weight", torch.ones(4))]

    async def drive():
        await eng.generate(
            [1, 2, 3, 4],
            {
                "max_new_tokens": 3,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
                "stop_token_ids": [13],
                "stop": ["</tool_call>"],
            },
            rid="rid-1",
        )
        [s async for s in eng.generate_stream([1, 2, 3, 4], {"max_new_tokens": 3})]
        await eng.abort("rid-1")
        await eng.abort(abort_all=True)
        for mode in ("abort", "retract", "in_place"):
            await eng.pause(mode)
        await eng.continue_generation()
        await eng.release_memory(["weights", "kv_cache", "cuda_graph"])
        await eng.release_memory()
        await eng.resume_memory(["weights"])
        await eng.update_weights_from_disk("/models/tiny", weight_version="step-1")
        async with eng.weight_update_session():
            await eng.update_weights_from_tensor(named, weight_version="step-2")
        await eng.init_weights_update_group(
            master_address="10.0.0.1",
            master_port=29500,
            rank_offset=1,
            world_size=2,
            group_name="wug",
            backend="nccl",
        )
        async with eng.weight_update_session():
            await eng.update_weights_from_distributed(
                [("model.norm.weight", torch.bfloat16, (4,))], group_name="wug", weight_version="step-3"
            )
        await eng.update_weight_version("step-3")
        await eng.flush_cache()

    asyncio.run(drive())
    classes = {
        "/generate": io.GenerateReqInput,
        "/abort_request": io.AbortReq,
        "/pause_generation": io.PauseGenerationReqInput,
        "/continue_generation": io.ContinueGenerationReqInput,
        "/release_memory_occupation": io.ReleaseMemoryOccupationReqInput,
        "/resume_memory_occupation": io.ResumeMemoryOccupationReqInput,
        "/update_weights_from_disk": io.UpdateWeightFromDiskReqInput,
        "/update_weights_from_tensor": io.UpdateWeightsFromTensorReqInput,
        "/init_weights_update_group": io.InitWeightsUpdateGroupReqInput,
        "/update_weights_from_distributed": io.UpdateWeightsFromDistributedReqInput,
        "/begin_weight_update": io.BeginWeightUpdateReqInput,
        "/end_weight_update": io.EndWeightUpdateReqInput,
        "/update_weight_version": io.UpdateWeightVersionReqInput,
        "/flush_cache": io.FlushCacheReqInput,
    }
    paths = [p for p, _ in rec.sent]
    assert set(paths) == set(classes)
    # 0.5.23: the tensor and distributed updates sit inside begin ... end
    for path in ("/update_weights_from_tensor", "/update_weights_from_distributed"):
        i = paths.index(path)
        assert paths[i - 1] == "/begin_weight_update" and paths[i + 1] == "/end_weight_update"
    sampling_fields = {f.name for f in msgspec.structs.fields(SGLangSamplingParams)}
    for path, body in rec.sent:
        obj = _validate(classes[path], body)
        if path == "/generate":
            assert generate_contract_error(body) is None
            assert set(body["sampling_params"]) <= sampling_fields
            SGLangSamplingParams(**body["sampling_params"]).verify(512)
            assert obj.input_ids == [1, 2, 3, 4] and obj.return_logprob is True
        if path == "/update_weights_from_tensor":
            # base64 decoded like SGLang's HTTP layer
            assert isinstance(obj.serialized_named_tensors[0], bytes)
        if path == "/update_weights_from_distributed":
            assert obj.dtypes == ["bfloat16"] and obj.shapes == [[4]] and obj.weight_version == "step-3"
        if path == "/pause_generation":
            assert obj.mode in ("abort", "retract", "in_place")
    first_abort = next(b for p, b in rec.sent if p == "/abort_request")
    assert _validate(io.AbortReq, first_abort).rid == "rid-1"


def test_recorded_responses_parse():
    rec = Recorder()
    eng = SGLangEngine("http://sglang", transport=httpx.MockTransport(rec))

    async def drive():
        res = await eng.generate([1, 2, 3, 4], {"max_new_tokens": 3})
        snaps = [s async for s in eng.generate_stream([1, 2, 3, 4], {"max_new_tokens": 3})]
        rec.generate_variant = "POST /generate aborted"
        aborted = await eng.generate([1, 2, 3, 4], {"max_new_tokens": 3})
        rec.generate_variant = "POST /generate error"
        with pytest.raises(Exception, match="max_new_tokens"):
            await eng.generate([1], {"max_new_tokens": 0})
        return res, snaps, aborted, await eng.weight_version(), await eng.loads(), await eng.health()

    res, snaps, aborted, version, loads, healthy = asyncio.run(drive())
    assert res.output_ids == [11, 12, 13] and res.output_logprobs == [-1.25, -0.5, -2.0]
    assert res.finish_reason.type == "length" and res.finish_reason.length == 3 and res.text is None
    assert res.weight_versions[0].end == 3
    assert [s.output_ids for s in snaps] == [[11], [11, 12, 13]] and snaps[0].finish_reason is None
    assert snaps[-1].finish_reason.matched == 13
    assert aborted.finish_reason.type == "abort" and aborted.finish_reason.message == "Abort in waiting queue"
    assert version == "step-3" and loads["loads"][0]["num_running_reqs"] == 2 and healthy
    # slime's fallback: ids from the logprob triples when output_ids is missing
    meta = RECORDED["POST /generate"]["json"]["meta_info"]
    assert GenerationResult.from_sglang({"meta_info": meta}).output_ids == [11, 12, 13]


def test_launch_command_parses_with_sglang_server_args():
    from sglang.srt.server_args import ServerArgs

    cfg = SGLangLaunchConfig(
        model_path="/models/tiny",
        port=31000,
        tp_size=2,
        mem_fraction_static=0.6,
        enable_weights_cpu_backup=True,
        served_model_name="policy",
        random_seed=7,
        weight_version="v0",
        extra_args=("--context-length", "8192"),
    )
    cmd = build_launch_command(cfg)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(cmd[3:])
    assert ns.model_path == "/models/tiny" and ns.port == 31000 and ns.tp_size == 2
    assert ns.enable_memory_saver and ns.enable_weights_cpu_backup and ns.skip_tokenizer_init
    assert ns.tool_call_parser == "qwen25" and ns.reasoning_parser == "qwen3"
    assert ns.weight_version == "v0" and ns.mem_fraction_static == 0.6 and ns.context_length == 8192


def test_api_key_reaches_sglang_by_file_never_argv(tmp_path):
    """SGLang's own argv handling (`--config` YAML merged, then parsed) finds the key; argv never holds it."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    key = "k-3x_Y-123"  # digits and dashes: a YAML parser must still read a string
    path = write_api_key_config(tmp_path, key)
    assert os.stat(path).st_mode & 0o777 == 0o600
    cmd = build_launch_command(SGLangLaunchConfig(model_path="/models/tiny", api_key_config=path))
    assert all(key not in a for a in cmd)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(cmd[3:]))
    assert ns.api_key == key and ns.model_path == "/models/tiny"
    for flag in ("--api-key", "--config", "--admin-api-key=x"):
        with pytest.raises(ValueError, match="argv"):
            build_launch_command(SGLangLaunchConfig(model_path="/m", extra_args=(flag, "x")))
    server = SGLangServer(SGLangLaunchConfig(model_path="/m"), api_key=key)
    assert server.client()._http.headers["authorization"] == f"Bearer {key}"
