"""The run's engine sections: `[weights]` (how the core's weights reach the engines) and `[rollout]` (each cell's
rollout engine, with `[rollout.sglang]` and `[rollout.vllm]` for the servers a cell starts). Every section of the
run's config is built with `SECTION_CONFIG`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Only torch-free modules (see gyre.config).
from gyre_cell.transfer.mooncake import MooncakeConfig

__all__ = ["SECTION_CONFIG", "RolloutConfig", "SGLangSection", "VLLMSection", "WeightsConfig"]


SECTION_CONFIG = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
"""Every section of a run's config: frozen, no unknown key, and no infinities or NaN anywhere (`lr = inf` passed
and failed late, inside the trainer); attribute docstrings are the fields' descriptions (`gyre config --explain`,
the reference docs)."""


class _Section(BaseModel):
    model_config = SECTION_CONFIG


class WeightsConfig(_Section):
    transport: Literal["auto", "mooncake", "http", "disk"] = "auto"
    """Publication: engines pull the core's weights over Mooncake, or over HTTP from the core (no system library;
    the run's engine token authenticates), or load a checkpoint the core writes. auto: Mooncake where it loads on
    the controller's machine, else HTTP (`resolve_transports`; RUN/config.json records the one used)."""
    snapshot: Literal["auto", "mooncake", "http", "file"] = "auto"
    """How joining satellites pull the core's weight snapshot (the same choices; file: one machine only)."""
    mooncake: MooncakeConfig = MooncakeConfig()
    """Transfer engine settings: TCP on loopback here; protocol = "rdma" (+ device_name) on GPU clusters."""


class SGLangSection(_Section):
    """How each cell worker starts its SGLang server (`[rollout] engine = "sglang"`); model, port, seed, weight
    version and the engine token come from the run."""

    python: str | None = None
    """Interpreter with SGLang installed (None: the one running Gyre)."""
    module: str = "sglang.launch_server"
    """`gyre_cell.testing.sglang_stand_in` runs the CPU torch engine behind the same flags, where SGLang cannot run (tests)."""
    tp_size: int = Field(1, ge=1)
    """SGLang's tensor parallelism inside a cell (its GPUs: `[launcher] gpus_per_cell`)."""
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """GPU memory fraction for weights and KV (None: SGLang's default)."""
    extra_args: list[str] = []
    """Further flags, as-is (never a key: the token goes by file)."""


class VLLMSection(_Section):
    """How each cell worker starts its vLLM server (`[rollout] engine = "vllm"`); model, port, seed, weight version
    and the engine token come from the run. vLLM pins no KV for another engine: a call moved off it is recomputed."""

    python: str | None = None
    """Interpreter of an environment with vLLM (`gyre-cell vllm-env` makes one and prints it; None: the one running
    Gyre)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Model dtype in vLLM (`auto`: the checkpoint's). The trainer recomputes log-probs in `[train] dtype`."""
    max_model_len: int | None = Field(None, ge=1)
    """Context length (None: the model's)."""
    cpu_kv_cache_gib: int = Field(1, ge=1)
    """CPU: each server's KV cache in whole GiB (vLLM's default takes a share of the machine's memory)."""
    enforce_eager: bool = False
    """No compiled graphs: starts faster, runs slower."""
    stream_interval: int = Field(16, ge=1)
    """Tokens per streamed chunk: one event per token held 8 concurrent calls on 2 cores to a sixth of the rate."""
    enable_sleep_mode: bool = False
    """GPU: free weights and KV while the cell trains (`/sleep`); on CPU vLLM's sleep frees nothing."""
    gpu_memory_utilization: float | None = Field(None, gt=0, lt=1)
    """GPU memory fraction for weights and KV (None: vLLM's default)."""
    extra_args: list[str] = []
    """Further flags, as-is (never a key: the token goes by environment)."""


class RolloutConfig(_Section):
    engine: Literal["torch", "sglang", "vllm"] = "torch"
    """Each cell's rollout engine: the torch engine inside the cell worker, or an SGLang or vLLM server the worker
    starts, watches and updates (`gyre_cell.worker_engine`); standalone engines too."""
    sglang: SGLangSection = SGLangSection()
    """The SGLang server each cell starts when `engine = "sglang"`."""
    vllm: VLLMSection = VLLMSection()
    """The vLLM server each cell starts when `engine = "vllm"`."""
    scripted_replies: str | None = None
    """A script file (`gyre_cell.engine.script`: rules matched against each prompt) whose replies the torch engines
    produce instead of sampling, every token with the policy's own log-prob, so training stays exact: for a run
    whose harness needs replies the policy cannot give yet (a tiny model driving Claude Code's sub-agents and
    compaction). None: the engines sample."""

    @model_validator(mode="after")
    def _scripted_on_torch(self) -> RolloutConfig:
        if self.scripted_replies is not None and self.engine != "torch":
            raise ValueError(
                '[rollout] scripted_replies needs engine = "torch" (SGLang and vLLM cannot force replies)'
            )
        return self
