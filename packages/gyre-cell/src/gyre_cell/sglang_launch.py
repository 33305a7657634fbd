"""How an SGLang server is started (`gyre_cell.sglang_adapter` starts and talks to it): its config and argv.

Apart from the adapter (which imports torch): a run's config embeds `SGLangLaunchConfig`, and the controller that
validates it starts without torch.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["STAND_IN", "SGLangLaunchConfig", "build_launch_command", "write_api_key_config"]


class SGLangLaunchConfig(BaseModel):
    """How to start one SGLang server for rollout (one flag per field; extra_args for the rest)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    """Local Hugging Face checkpoint directory."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 30000
    """HTTP port."""
    tp_size: int = 1
    """Tensor-parallel size (one serialized tensor payload per TP rank in from_tensor updates)."""
    mem_fraction_static: float | None = None
    """GPU memory fraction for weights + KV (None: SGLang's default)."""
    enable_memory_saver: bool = True
    """Required for /release_memory_occupation (role switching)."""
    enable_weights_cpu_backup: bool = False
    """Keep a CPU copy of released weights (resume restores them without an update)."""
    skip_tokenizer_init: bool = True
    """Token-in/token-out: Gyre sends input_ids and reads output_ids; no `text` in responses."""
    tool_call_parser: str | None = "qwen25"
    """Parser for the OpenAI endpoints (qwen25 = Qwen2.5/Qwen3 JSON tool calls; qwen3_coder = XML form)."""
    reasoning_parser: str | None = "qwen3"
    """Reasoning parser for `<think>` blocks."""
    served_model_name: str | None = None
    """Name reported by /model_info."""
    weight_version: str = "default"
    """Initial weight version."""
    random_seed: int | None = None
    """Server sampling seed."""
    load_format: Literal["auto", "dummy", "safetensors"] | None = None
    """`dummy` skips reading weights (a publication follows immediately)."""
    extra_args: tuple[str, ...] = ()
    """Further raw flags appended as-is (not `--api-key`: see `api_key_config`; not `--config`)."""
    api_key_config: str | None = None
    """A YAML file (mode 600) holding `api-key: ...`, passed as `--config` (`write_api_key_config` makes it)."""
    python: str = sys.executable
    """Interpreter that has sglang installed."""
    module: str = "sglang.launch_server"
    """The module `python -m` runs: SGLang's server, or `gyre_cell.testing.sglang_stand_in` (``STAND_IN``) where SGLang
    cannot run (no GPU): the CPU torch engine behind the same flags, whose tensor updates take the torch engine's
    format, so `SGLangServer.client()` gives a `TorchEngineClient` for it."""


STAND_IN = "gyre_cell.testing.sglang_stand_in"


def write_api_key_config(folder: str | os.PathLike[str], api_key: str) -> str:
    """Write SGLang's `--config` YAML holding only `api-key` (mode 600, in `folder`); returns its path."""
    if not api_key or any(c in api_key for c in "\r\n"):
        raise ValueError("an API key must be one non-empty line")
    path = os.path.join(folder, "sglang-api-key.yaml")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"api-key: {json.dumps(api_key)}\n")  # the flag's spelling; a JSON string is a YAML string
    return path


def build_launch_command(cfg: SGLangLaunchConfig) -> list[str]:
    """argv of `python -m sglang.launch_server ...` for `cfg`."""
    for flag in ("--api-key", "--admin-api-key", "--config"):
        if any(a == flag or a.startswith(flag + "=") for a in cfg.extra_args):
            raise ValueError(
                f"extra_args: {flag} would put a key in argv (readable by every local process); "
                "give the key to SGLangServer(api_key=...), which passes it by file"
            )
    cmd = [cfg.python, "-m", cfg.module, "--model-path", cfg.model_path]
    cmd += ["--host", cfg.host, "--port", str(cfg.port), "--tp-size", str(cfg.tp_size)]
    cmd += ["--weight-version", cfg.weight_version]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.enable_weights_cpu_backup:
        cmd.append("--enable-weights-cpu-backup")
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if cfg.tool_call_parser:
        cmd += ["--tool-call-parser", cfg.tool_call_parser]
    if cfg.reasoning_parser:
        cmd += ["--reasoning-parser", cfg.reasoning_parser]
    if cfg.served_model_name:
        cmd += ["--served-model-name", cfg.served_model_name]
    if cfg.random_seed is not None:
        cmd += ["--random-seed", str(cfg.random_seed)]
    if cfg.load_format is not None:
        cmd += ["--load-format", cfg.load_format]
    if cfg.api_key_config is not None:
        cmd += ["--config", cfg.api_key_config]
    return cmd + list(cfg.extra_args)
