"""SGLang adapter: launch an SGLang server with the flags RL needs, and talk to it as a RolloutEngine.

SGLang (0.5.23) cannot run on CPU machines; everything here that needs a live server is exercised under
the `gpu` marker. The request bodies are checked against SGLang's own request classes in CPU CI.

An API key (`SGLangServer(cfg, api_key=...)`) reaches SGLang by file: a mode-600 YAML file `api-key: ...` in a
private folder, given as SGLang's `--config FILE` (never `--api-key KEY`: argv is readable by every process of the
user through /proc/PID/cmdline). SGLang then requires `Authorization: Bearer KEY` on everything but /health*.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from typing import Any

import httpx
import torch

from .client import RolloutEngine, TorchEngineClient
from .protocol import UpdateFromTensorBody
from .server_process import die_with_parent, stop_process
from .sglang_launch import STAND_IN, SGLangLaunchConfig, build_launch_command, write_api_key_config


class SGLangServer:
    """A launched SGLang server process (start, stop); talk to it through `client()`."""

    def __init__(self, cfg: SGLangLaunchConfig, *, api_key: str | None = None) -> None:
        self.cfg = cfg
        self.api_key = api_key
        self.proc: subprocess.Popen[bytes] | None = None
        self._secret_dir: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def start(self, *, log_path: str | None = None) -> None:
        cfg = self.cfg
        if self.api_key is not None:
            self._secret_dir = tempfile.mkdtemp(prefix="gyre-sglang-")  # mode 700
            cfg = cfg.model_copy(
                update={"api_key_config": write_api_key_config(self._secret_dir, self.api_key)}
            )
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (lives with the process)
        self.proc = subprocess.Popen(
            build_launch_command(cfg), stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )

    async def wait_healthy(self, timeout_s: float = 900.0) -> None:
        """Poll /health until it answers 200; fail at once if the server process exits."""
        client = self.client()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while loop.time() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"SGLang server exited with code {self.proc.returncode} before becoming healthy"
                    )
                if await client.health():
                    return
                await asyncio.sleep(1.0)
        finally:
            await client.aclose()
        raise TimeoutError(f"SGLang server at {self.base_url} not healthy after {timeout_s} s")

    def client(self) -> RolloutEngine:
        if self.cfg.module == STAND_IN:  # the torch engine's tensor format (see `SGLangLaunchConfig.module`)
            return TorchEngineClient(self.base_url, api_key=self.api_key)
        return SGLangEngine(self.base_url, tp_size=self.cfg.tp_size, api_key=self.api_key)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._secret_dir is not None:
            shutil.rmtree(self._secret_dir, ignore_errors=True)
            self._secret_dir = None
        stop_process(self.proc, timeout_s)


class SGLangEngine(RolloutEngine):
    """RolloutEngine over an SGLang server. `update_weights_from_tensor` uses SGLang's own serializer
    (CUDA IPC handles: the caller must be on the same node and keep the tensors alive until it returns)."""

    kind = "sglang"
    supports_kv_migration = False
    """SGLang 0.5.23 has no endpoint that pins one request's KV for another engine to read: a request moved off an
    SGLang engine is recomputed at its destination (see the README, "KV-cache migration", for what an integration
    through HiCache and the Mooncake store would need)."""

    def __init__(
        self,
        base_url: str,
        *,
        tp_size: int = 1,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__(base_url, timeout_s=timeout_s, transport=transport, api_key=api_key)
        self.tp_size = tp_size

    def tensor_update_body(
        self, named: Iterable[tuple[str, torch.Tensor]], *, weight_version: str | None
    ) -> dict[str, Any]:
        from sglang.srt.utils import MultiprocessingSerializer  # the [sglang] extra

        payload = MultiprocessingSerializer.serialize(list(named), output_str=True)
        fields: dict[str, Any] = {"serialized_named_tensors": [payload] * self.tp_size}
        if weight_version is not None:
            fields["weight_version"] = weight_version
        return UpdateFromTensorBody(**fields).body()

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        # SGLang answers 200 (empty) even for an unknown rid; nothing else to adapt.
        await super().abort(rid, abort_all=abort_all)
