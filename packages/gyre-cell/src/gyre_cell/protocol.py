"""Request bodies of the SGLang HTTP protocol subset Gyre uses (field names and defaults of SGLang 0.5.23).

These mirror `sglang.srt.managers.io_struct` (checked by the contract tests); they are SGLang's protocol,
not Gyre wire types, so they carry no schema_version. Unknown fields are ignored, as SGLang does. Both the
torch engine (parsing) and the engine clients (building bodies) use them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def body(self) -> dict[str, Any]:
        """JSON body as sent on the wire (defaults omitted, so SGLang applies its own)."""
        return self.model_dump(exclude_unset=True)


class SamplingParams(_Body):
    """`sampling_params` of /generate."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    sampling_seed: int | None = None


class GenerateBody(_Body):
    """POST /generate."""

    rid: str | None = None
    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class AbortBody(_Body):
    rid: str = ""
    abort_all: bool = False


class PauseBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(_Body):
    torch_empty_cache: bool = True


class MemoryTagsBody(_Body):
    """/release_memory_occupation and /resume_memory_occupation; no tags = weights, kv_cache, cuda_graph."""

    tags: list[str] | None = None


class UpdateFromDiskBody(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateFromTensorBody(_Body):
    serialized_named_tensors: list[str]
    """One entry per TP rank: SGLang = base64 pickled handles; Gyre torch engine = base64 safetensors."""
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitGroupBody(_Body):
    master_address: str = Field(max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=1)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyGroupBody(_Body):
    group_name: str = "weight_update_group"


class UpdateFromDistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class BeginWeightUpdateBody(_Body):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateBody(_Body):
    pass


class UpdateWeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = True
