"""Weight transfer and role-switch times.

1. Move a random fp32 state dict (~50M parameters; `--quick`: 5M) from a publisher process to this process, the
   paths alternating each round: Mooncake TCP on loopback (`WeightSubscriber.read` + copy into same-shaped tensors:
   `mooncake_s`; read alone, the whole cost for a model bound to the buffer with `WeightSubscriber.bind`:
   `mooncake_bound_s`), the publisher's shared buffer mapped here (`read_apply` copying straight into the tensors:
   `shm_s`; holding its newest slot for a bound engine instead, no copy: `shm_lease_s`), and the baseline of safetensors written to disk by the publisher and loaded here (what
   `update_weights_from_disk` costs; it reads from the page cache, the file was just written, which flatters it).
   Beside them, raw TCP on loopback: the same bytes sent by another process into a preallocated buffer
   (`raw_tcp_s`; `mooncake_of_raw_tcp` = raw / Mooncake read time).
2. Publication from a core to 2 rollout engines (`publish` section), each a TorchEngine in its own process like a
   cell worker, on the tiny model and on a ~52M-parameter Qwen3 (`--quick`: ~4M): the core's `WeightPublisher.publish`
   then both engines `pull_into_engine` concurrently: bound to the core's newest shared buffer (shm, what engines on
   the core's host do: pointer swaps, no copy), copying from it (shm_copy, the path before binding, and what an
   engine of another dtype does), or over Mooncake TCP (what engines on other hosts do), vs the core's
   `save_pretrained` then both engines `TorchEngine.update_weights_from_disk` concurrently (disk). Timed until both
   engines serve the new version; the weights change before every publication and the copying paths start from
   engines with memory of their own (neither timed), and every engine's parameters are checked bit-equal to the
   core's after every publication. Paths alternate (shm, shm_copy, mooncake, disk, ...); medians; ratio = disk /
   shm, ratio_shm_copy = disk / shm_copy, ratio_mooncake_tcp = disk / mooncake; core_publish_s = the core's
   `publish` alone (copy into its buffer and finite check).
3. Role switches of one cell on the CPU torch engine (`gyre-cell engine serve` subprocess, Qwen3 built offline):
   rollout -> training and training -> rollout with `CellRoleManager` (paper: 8.52 s and 3.46 s at 122B, 4-node cells).
Each figure is the median of `--repeats` runs.

    uv run python bench/weight_transfer.py [--quick] [--sections transfer,publish,switch]

Last line: one JSON object (with the load average at start and end); ratio = baseline_disk_s / mooncake_s,
ratio_bound = baseline_disk_s / mooncake_bound_s, ratio_shm = baseline_disk_s / shm_s, publish_ratio_{tiny,large}
= publish disk / publish shm (2 engines); `--sections` picks sections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
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
from gyre_cell.transfer import SubscriberConfig, WeightManifest, WeightPublisher, WeightSubscriber
from gyre_cell.transfer.peer import PeerProcess, engine_process, params_digest, publisher_process


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


def _raw_tcp_sender(conn, nbytes: int) -> None:
    """Child: serve `nbytes` over one loopback TCP connection per request (the raw-TCP reference)."""
    payload = memoryview(bytearray(nbytes))
    with socket.create_server(("127.0.0.1", 0)) as srv:
        conn.send(srv.getsockname()[1])
        with srv.accept()[0] as sock:
            while sock.recv(1):  # one byte asks for the payload; EOF ends
                sock.sendall(payload)


def raw_tcp(nbytes: int, repeats: int) -> list[float]:
    """Seconds to move `nbytes` over loopback TCP from another process into a preallocated buffer."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_tcp_sender, args=(child, nbytes), daemon=True)
    proc.start()
    into = memoryview(bytearray(nbytes))
    times = []
    try:
        with socket.create_connection(("127.0.0.1", parent.recv())) as sock:
            for r in range(repeats + 1):  # the first warms up
                t0 = time.perf_counter()
                sock.sendall(b"x")
                got = 0
                while got < nbytes:
                    got += sock.recv_into(into[got:])
                if r:
                    times.append(time.perf_counter() - t0)
    finally:
        proc.join(timeout=20)
        if proc.is_alive():
            proc.kill()
    return times


def spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def bench_transfer(num_params: int, repeats: int, tmp: Path) -> dict:
    """Publisher in another process; into same-shaped tensors here: Mooncake TCP (read, then copy), the shared
    buffer (copy straight from it: `read_apply`), disk (save there, load here, copy); raw TCP beside them. ABAB."""
    peer = _Peer({"random": num_params, "seed": 0})
    # One thread, as an engine runs (`cpu_threads`): on this shared 2-core machine torch's 2-thread copy of 4 MB
    # tensors took 0.37 s for 200 MB against 0.03 s on one thread (its workers wait on each other under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        manifest = WeightManifest.model_validate_json(peer.call("manifest"))  # type: ignore[arg-type]
        target = {e.name: torch.empty(e.shape, dtype=torch.float32) for e in manifest.tensors}

        def copy_in(tensors: dict[str, torch.Tensor], _version: int = 0) -> None:
            for n, t in tensors.items():
                target[n].copy_(t)

        runs: dict[str, list[float]] = {
            "mooncake": [],
            "mooncake_read": [],
            "shm": [],
            "shm_lease": [],
            "disk": [],
        }
        tcp = WeightSubscriber(manifest, config=SubscriberConfig(shared_memory=False))
        shm = WeightSubscriber(manifest)
        assert shm.shared, "the publisher's buffer is not mapped here"
        with tcp, shm:
            tcp.read(), shm.read_apply(copy_in)  # warm-up: connection, handshake, first touch of the pages
            for i in range(repeats):
                t0 = time.perf_counter()
                snap = tcp.read()
                t1 = time.perf_counter()
                copy_in(snap.tensors)
                runs["mooncake"].append(time.perf_counter() - t0)
                runs["mooncake_read"].append(t1 - t0)
                mooncake_copy = {n: t.clone() for n, t in target.items()}
                t0 = time.perf_counter()
                shm.read_apply(copy_in)
                runs["shm"].append(time.perf_counter() - t0)
                same = all(torch.equal(mooncake_copy[n], target[n]) for n in target)
                t0 = time.perf_counter()
                held = shm.lease_newest()  # what a bound engine does instead of copying (then pointer swaps)
                runs["shm_lease"].append(time.perf_counter() - t0)
                same = same and all(torch.equal(mooncake_copy[n], held.tensors[n]) for n in target)
                held.lease.release()
                out = tmp / f"ckpt{i}"
                t0 = time.perf_counter()
                peer.call("save", str(out))
                copy_in(load_file(str(out / "model.safetensors")))
                runs["disk"].append(time.perf_counter() - t0)
                (out / "model.safetensors").unlink()
                same = same and all(torch.equal(mooncake_copy[n], target[n]) for n in target)
    finally:
        torch.set_num_threads(threads)
        peer.close()
    runs["raw_tcp"] = raw_tcp(manifest.data_bytes, repeats)
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "params": sum(t.numel() for t in target.values()),
        "bytes": manifest.data_bytes,
        "mooncake_s": med["mooncake"],
        "mooncake_read_s": med["mooncake_read"],
        "mooncake_gib_s": manifest.data_bytes / med["mooncake_read"] / 2**30,
        "shm_s": med["shm"],
        "shm_lease_s": med["shm_lease"],
        "raw_tcp_s": med["raw_tcp"],
        "raw_tcp_gib_s": manifest.data_bytes / med["raw_tcp"] / 2**30,
        "mooncake_of_raw_tcp": med["raw_tcp"] / med["mooncake_read"],
        "baseline_disk_s": med["disk"],
        "spread": {k: spread(v) for k, v in runs.items()},
        "bytes_equal": same,
    }


def bench_publish(label: str, model_cfg: TinyModelConfig, repeats: int, tmp: Path, engines: int = 2) -> dict:
    """One core, `engines` engine processes; per publication the shared buffer, a Mooncake TCP pull, or disk,
    alternating (shm, mooncake, disk, shm, ...)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(tmp / f"{label}-init", model_cfg)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    # The core runs on one thread, as a cell worker does (`cpu_threads`) and as the engines here do: on 2 shared
    # cores, two threads made its copies slower and erratic (0.16-1.0 s instead of 0.07 s for 52M parameters).
    torch.set_num_threads(1)
    params = sum(p.numel() for p in model.parameters())
    peers = [PeerProcess(engine_process, str(model_dir), 1, timeout_s=600) for _ in range(engines)]
    version = 0

    def all_call(*cmd: object) -> list:
        for p in peers:  # every engine works at once; the publication ends when the last one serves it
            p.conn.send(cmd)
        out = []
        for p in peers:
            if not p.conn.poll(600):
                raise TimeoutError(cmd[0])
            status, value = p.conn.recv()
            if status != "ok":
                raise RuntimeError(value)
            out.append(value)
        return out

    def change_weights() -> None:  # a new policy before every publication (not timed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)

    def check(v: int) -> None:
        want = params_digest(model)
        assert all_call("version") == [str(v)] * engines, v
        assert all_call("digest") == [want] * engines, f"engine weights differ from the core's after {v}"

    try:
        with WeightPublisher(model, version=0) as pub:
            manifest = pub.manifest().model_dump_json()
            assert all_call("subscribe", manifest, True) == [True] * engines  # they map the core's buffer
            assert all_call("subscribe", manifest, False) == [False] * engines  # they pull over Mooncake TCP

            def pull(shared: bool, bind: bool = False) -> tuple[float, float]:
                if not bind:  # memory of their own again, as an engine that never bound has (not timed)
                    all_call("unbind")
                t0 = time.perf_counter()
                pub.publish(model, version=version)
                t1 = time.perf_counter()
                assert all_call("pull", shared, bind) == [str(version)] * engines
                return time.perf_counter() - t0, t1 - t0

            def disk() -> tuple[float, float]:
                all_call("unbind")
                out = tmp / f"{label}-v{version}"
                t0 = time.perf_counter()
                model.save_pretrained(out)
                t1 = time.perf_counter()
                all_call("disk", str(out), version)
                dt = time.perf_counter() - t0, t1 - t0
                shutil.rmtree(out)
                return dt

            runs: dict[str, list[tuple[float, float]]] = {
                "shm": [],
                "shm_copy": [],
                "mooncake": [],
                "disk": [],
            }
            paths = (
                ("shm", lambda: pull(True, bind=True)),
                ("shm_copy", lambda: pull(True)),
                ("mooncake", lambda: pull(False)),
                ("disk", disk),
            )
            for r in range(repeats + 1):  # the first round warms up every path (connections, allocator)
                for name, fn in paths:
                    version += 1
                    change_weights()
                    dt = fn()
                    check(version)
                    if r:
                        runs[name].append(dt)
    finally:
        torch.set_num_threads(threads)
        for p in peers:
            p.close()
    mc = statistics.median(t for t, _ in runs["mooncake"])
    sh = statistics.median(t for t, _ in runs["shm"])
    sc = statistics.median(t for t, _ in runs["shm_copy"])
    dk = statistics.median(t for t, _ in runs["disk"])
    return {
        "params": params,
        "bytes": params * 4,
        "engines": engines,
        "repeats": repeats,
        "shm_s": round(sh, 4),
        "shm_copy_s": round(sc, 4),
        "mooncake_s": round(mc, 4),
        "core_publish_s": round(
            statistics.median(c for k in ("shm", "shm_copy", "mooncake") for _, c in runs[k]), 4
        ),
        "disk_s": round(dk, 4),
        "disk_save_s": round(statistics.median(c for _, c in runs["disk"]), 4),
        "ratio": round(dk / sh, 2),
        "ratio_shm_copy": round(dk / sc, 2),
        "ratio_mooncake_tcp": round(dk / mc, 2),
        "shm_runs_s": [round(t, 4) for t, _ in runs["shm"]],
        "shm_copy_runs_s": [round(t, 4) for t, _ in runs["shm_copy"]],
        "mooncake_runs_s": [round(t, 4) for t, _ in runs["mooncake"]],
        "disk_runs_s": [round(t, 4) for t, _ in runs["disk"]],
        "bytes_equal": True,  # check() asserted it after every publication
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
    p.add_argument(
        "--sections",
        default="transfer,publish,switch",
        help="comma-separated subset of transfer, publish, switch (default: all)",
    )
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    if bad := sections - {"transfer", "publish", "switch"}:
        p.error(f"unknown sections {sorted(bad)} (transfer, publish, switch)")
    num = args.params or (5_000_000 if args.quick else 50_000_000)
    repeats = args.repeats or (2 if args.quick else 3)
    model_cfg = (
        TinyModelConfig()
        if args.quick
        else TinyModelConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, head_dim=64)
    )
    large_cfg = (
        TinyModelConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, head_dim=64)
        if args.quick
        else TinyModelConfig(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=6,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
        )
    )
    result: dict = {
        "bench": "weight_transfer",
        "cpus": os.cpu_count(),
        "load_avg_1m_start": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="gyre-bench-wt-") as d:
        tmp = Path(d)
        if "transfer" in sections:
            transfer = bench_transfer(num, repeats, tmp)
            print(json.dumps({"transfer": transfer}), flush=True)
            result.update(
                {
                    "params": transfer["params"],
                    "bytes": transfer["bytes"],
                    "mooncake_s": round(transfer["mooncake_s"], 4),
                    "mooncake_gib_s": round(transfer["mooncake_gib_s"], 3),
                    "shm_s": round(transfer["shm_s"], 4),
                    "shm_lease_s": round(transfer["shm_lease_s"], 6),
                    "raw_tcp_s": round(transfer["raw_tcp_s"], 4),
                    "raw_tcp_gib_s": round(transfer["raw_tcp_gib_s"], 3),
                    "mooncake_of_raw_tcp": round(transfer["mooncake_of_raw_tcp"], 3),
                    "baseline_disk_s": round(transfer["baseline_disk_s"], 4),
                    "mooncake_bound_s": round(transfer["mooncake_read_s"], 4),
                    "ratio": round(transfer["baseline_disk_s"] / transfer["mooncake_s"], 2),
                    "ratio_bound": round(transfer["baseline_disk_s"] / transfer["mooncake_read_s"], 2),
                    "ratio_shm": round(transfer["baseline_disk_s"] / transfer["shm_s"], 2),
                    "spread": transfer["spread"],
                    "bytes_equal": transfer["bytes_equal"],
                }
            )
        if "publish" in sections:
            publish = {
                "tiny": bench_publish("tiny", TinyModelConfig(), repeats, tmp),
                "large": bench_publish("large", large_cfg, repeats, tmp),
            }
            print(json.dumps({"publish": publish}), flush=True)
            result["publish"] = {
                k: {
                    f: v[f]
                    for f in (
                        "params",
                        "engines",
                        "shm_s",
                        "shm_copy_s",
                        "mooncake_s",
                        "disk_s",
                        "core_publish_s",
                        "ratio",
                        "ratio_shm_copy",
                        "ratio_mooncake_tcp",
                        "shm_runs_s",
                        "shm_copy_runs_s",
                        "mooncake_runs_s",
                        "disk_runs_s",
                        "bytes_equal",
                    )
                }
                for k, v in publish.items()
            }
            result["publish_ratio_tiny"] = publish["tiny"]["ratio"]
            result["publish_ratio_large"] = publish["large"]["ratio"]
        if "switch" in sections:
            switch = bench_switch(model_cfg, repeats, tmp)
            print(json.dumps({"switch": switch}), flush=True)
            result.update(
                {
                    "to_training_s": round(switch["to_training_s"], 4),
                    "to_rollout_s": round(switch["to_rollout_s"], 4),
                    "switch_model_bytes": switch["switch_model_bytes"],
                    "paper_to_training_s": 8.52,
                    "paper_to_rollout_s": 3.46,
                }
            )
    result["load_avg_1m"] = os.getloadavg()[0]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
