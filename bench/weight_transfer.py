"""Weight transfer and role-switch times.

1. Move a random fp32 state dict (~50M parameters; `--quick`: 5M) from a publisher process to this process:
   Mooncake TCP on loopback (`WeightSubscriber.read` + copy into same-shaped tensors: `mooncake_s`; read alone,
   which is the whole cost for a model bound to the buffer with `WeightSubscriber.bind`: `mooncake_bound_s`) vs the baseline of
   safetensors written to disk by the publisher and loaded here (what `update_weights_from_disk` costs).
   The baseline's load reads from the page cache (the file was just written), so it flatters the disk path.
2. Role switches of one cell on the CPU torch engine (`gyre-cell engine serve` subprocess, Qwen3 built offline):
   rollout -> training and training -> rollout with `CellRoleManager` (paper: 8.52 s and 3.46 s at 122B, 4-node cells).
Each figure is the median of `--repeats` runs.

    uv run python bench/weight_transfer.py [--quick]

Last line: one JSON object; ratio = baseline_disk_s / mooncake_s, ratio_bound = baseline_disk_s / mooncake_bound_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from gyre_cell.client import TorchEngineClient
from gyre_cell.roles import CellRoleManager, DiskWeights, TorchTrainingState
from gyre_cell.tiny_model import TinyModelConfig, build_tiny_model
from gyre_cell.transfer import WeightManifest, WeightSubscriber
from gyre_cell.transfer.peer import publisher_process


class _Peer:
    def __init__(self, source: dict) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=publisher_process, args=(child, source, 1), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *cmd: object) -> object:
        self.conn.send(cmd)
        if not self.conn.poll(600):
            raise TimeoutError(cmd[0])
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.proc.join(timeout=20)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


def bench_transfer(num_params: int, repeats: int, tmp: Path) -> dict:
    peer = _Peer({"random": num_params, "seed": 0})
    try:
        manifest = WeightManifest.model_validate_json(peer.call("manifest"))  # type: ignore[arg-type]
        target = {e.name: torch.empty(e.shape, dtype=torch.float32) for e in manifest.tensors}
        mc, mc_read = [], []
        with WeightSubscriber(manifest) as sub:
            sub.read()  # warm-up: connection and handshake
            for _ in range(repeats):
                t0 = time.perf_counter()
                snap = sub.read()
                t1 = time.perf_counter()
                for n, t in snap.tensors.items():
                    target[n].copy_(t)
                mc.append(time.perf_counter() - t0)
                mc_read.append(t1 - t0)
            mooncake_copy = {n: t.clone() for n, t in target.items()}
        disk = []
        for i in range(repeats):
            out = tmp / f"ckpt{i}"
            t0 = time.perf_counter()
            peer.call("save", str(out))
            loaded = load_file(str(out / "model.safetensors"))
            for n, t in loaded.items():
                target[n].copy_(t)
            disk.append(time.perf_counter() - t0)
            (out / "model.safetensors").unlink()
        same = all(torch.equal(mooncake_copy[n], target[n]) for n in target)
    finally:
        peer.close()
    return {
        "params": sum(t.numel() for t in target.values()),
        "bytes": manifest.data_bytes,
        "mooncake_s": statistics.median(mc),
        "mooncake_read_s": statistics.median(mc_read),
        "mooncake_gib_s": manifest.data_bytes / statistics.median(mc_read) / 2**30,
        "baseline_disk_s": statistics.median(disk),
        "bytes_equal": same,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_switch(model_cfg: TinyModelConfig, repeats: int, tmp: Path) -> dict:
    model_dir = build_tiny_model(tmp / "model", model_cfg)
    port = _free_port()
    cmd = [sys.executable, "-m", "gyre_cell.cli", "engine", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--weights-backup", "none", "--max-total-tokens", "65536"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        trainer = torch.nn.Linear(1024, 1024)  # a training state of the same order as the engine's weights
        opt = torch.optim.Adam(trainer.parameters())
        trainer(torch.randn(2, 1024)).sum().backward()
        opt.step()

        async def run() -> tuple[list, list, int]:
            async with TorchEngineClient(url) as client:
                info = await client.loads()
                weights_bytes = info["loads"][0]["memory"]["weights_bytes"]
                state = TorchTrainingState(trainer, opt)
                await state.offload()
                mgr = CellRoleManager(client, state)
                to_t, to_r = [], []
                for i in range(repeats):
                    await client.generate([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True})
                    to_t.append(await mgr.to_training())
                    to_r.append(await mgr.to_rollout(DiskWeights(model_dir, f"v{i}")))
                return to_t, to_r, weights_bytes

        to_t, to_r, weights_bytes = asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    def phases(reps: list) -> dict:
        return {
            p.name: round(statistics.median(r.phases[i].seconds for r in reps), 4)
            for i, p in enumerate(reps[0].phases)
        }

    return {
        "switch_model_bytes": weights_bytes,
        "to_training_s": statistics.median(r.total_s for r in to_t),
        "to_rollout_s": statistics.median(r.total_s for r in to_r),
        "to_training_phases": phases(to_t),
        "to_rollout_phases": phases(to_r),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="5M parameters, smallest engine model")
    p.add_argument("--params", type=int, default=None, help="parameters to transfer (default 50M; quick 5M)")
    p.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3; quick 2)")
    args = p.parse_args(argv)
    num = args.params or (5_000_000 if args.quick else 50_000_000)
    repeats = args.repeats or (2 if args.quick else 3)
    model_cfg = (
        TinyModelConfig()
        if args.quick
        else TinyModelConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, head_dim=64)
    )
    with tempfile.TemporaryDirectory(prefix="gyre-bench-wt-") as d:
        tmp = Path(d)
        transfer = bench_transfer(num, repeats, tmp)
        print(json.dumps({"transfer": transfer}), flush=True)
        switch = bench_switch(model_cfg, repeats, tmp)
        print(json.dumps({"switch": switch}), flush=True)
    result = {
        "bench": "weight_transfer",
        "params": transfer["params"],
        "bytes": transfer["bytes"],
        "mooncake_s": round(transfer["mooncake_s"], 4),
        "mooncake_gib_s": round(transfer["mooncake_gib_s"], 3),
        "baseline_disk_s": round(transfer["baseline_disk_s"], 4),
        "mooncake_bound_s": round(transfer["mooncake_read_s"], 4),
        "ratio": round(transfer["baseline_disk_s"] / transfer["mooncake_s"], 2),
        "ratio_bound": round(transfer["baseline_disk_s"] / transfer["mooncake_read_s"], 2),
        "bytes_equal": transfer["bytes_equal"],
        "to_training_s": round(switch["to_training_s"], 4),
        "to_rollout_s": round(switch["to_rollout_s"], 4),
        "switch_model_bytes": switch["switch_model_bytes"],
        "paper_to_training_s": 8.52,
        "paper_to_rollout_s": 3.46,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
