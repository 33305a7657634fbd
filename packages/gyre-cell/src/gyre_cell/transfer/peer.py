"""A publisher living in its own process, driven over a multiprocessing pipe (tests, benchmarks, demos).

Start with `multiprocessing.get_context("spawn").Process(target=publisher_process, args=(conn, source))`;
`source` is `{"dir": PATH}` (a Hugging Face checkpoint directory) or `{"random": NUM_PARAMS, "seed": S}`.
Commands are tuples; every command gets one reply `("ok", value)` or `("error", message)`.
`snapshot_core_process(conn)` is the same for a `MooncakeSnapshotChannel` core (flat parameters per batch).
`engine_process(conn, model_dir)` is an in-process TorchEngine taking publications (Mooncake pull or disk).
`PeerProcess(target, *args)` starts any of them and drives it.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch


class PeerProcess:
    """A spawned child running `target(conn, *args)`, driven over a pipe (one reply per command)."""

    def __init__(self, target: Callable[..., None], *args: Any, timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def ask(self, *cmd: Any) -> tuple[str, Any]:
        """Send one command; its reply `("ok", value)` or `("error", message)`."""
        self.conn.send(cmd)
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"peer process did not answer {cmd[0]!r} within {self.timeout_s} s")
        return self.conn.recv()

    def call(self, *cmd: Any) -> Any:
        """Send one command; its value, or RuntimeError with the child's message."""
        status, value = self.ask(*cmd)
        if status != "ok":
            raise RuntimeError(f"peer process failed {cmd[0]!r}: {value}")
        return value

    def close(self) -> None:
        """Ask the child to close (it unregisters and frees its ports), then join it; kill if it hangs."""
        try:
            if self.proc.is_alive():
                self.call("close")
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        finally:
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)
            self.conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def random_state_dict(num_params: int, seed: int, *, width: int = 1024) -> dict[str, torch.Tensor]:
    """A float32 state dict of about `num_params` parameters in HF-like names (benchmarks)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    layer, left = 0, num_params
    while left > 0:
        rows = max(1, min(width, left // width))
        out[f"model.layers.{layer}.mlp.up_proj.weight"] = torch.randn(rows, width, generator=g)
        left -= rows * width
        layer += 1
    return out


def load_source(source: dict[str, Any]) -> dict[str, torch.Tensor]:
    if "dir" in source:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in sorted(Path(source["dir"]).glob("*.safetensors")):
            out.update(load_file(str(f)))
        if not out:
            raise ValueError(f"no *.safetensors in {source['dir']!r}")
        return out
    return random_state_dict(int(source["random"]), int(source.get("seed", 0)))


def publisher_process(conn: Connection, source: dict[str, Any], version: int = 0) -> None:
    """Child-process main: publish `source` at `version`, then serve commands until `("close",)`.

    Commands: ("manifest",) -> WeightManifest JSON; ("serve_manifest",) -> URL; ("publish", source, version);
    ("churn", source_a, source_b, start, gap_s) publishes a/b alternately in a thread (even version = a, a pause
    of gap_s after each) until ("churn_stop",), which returns the last version;
    ("begin_write",) leaves a write open (sequence odd); ("end_write", version); ("save", dir) writes the
    current tensors as safetensors (baseline of the benchmark); ("close",).
    """
    from .publisher import WeightPublisher

    pub = WeightPublisher(load_source(source), version=version)
    churner: threading.Thread | None = None
    stop = threading.Event()
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "close":
                    conn.send(("ok", None))
                    return
                if cmd == "manifest":
                    value: Any = pub.manifest().model_dump_json()
                elif cmd == "serve_manifest":
                    value = pub.serve_manifest()
                elif cmd == "publish":
                    pub.publish(load_source(args[0]), version=int(args[1]))
                    value = pub.version
                elif cmd == "churn":  # a, b, a, ... until churn_stop (even version = a); see gap_s
                    states = [load_source(args[0]), load_source(args[1])]
                    stop.clear()

                    def churn(states=states, v=int(args[2]), gap_s=float(args[3])) -> None:
                        while not stop.is_set():
                            pub.publish(states[v % 2], version=v)
                            v += 1
                            stop.wait(gap_s)  # back-to-back writes would starve every reader (seqlock)

                    churner = threading.Thread(target=churn, daemon=True)
                    churner.start()
                    value = None
                elif cmd == "churn_stop":
                    stop.set()
                    if churner is not None:
                        churner.join()
                    value = pub.version
                elif cmd == "begin_write":
                    pub.begin_write()
                    value = None
                elif cmd == "end_write":
                    pub.end_write(int(args[0]))
                    value = pub.version
                elif cmd == "save":
                    from safetensors.torch import save_file

                    Path(args[0]).mkdir(parents=True, exist_ok=True)
                    tensors = {n: t.clone() for n, t in pub.tensors().items()}  # tied names share bytes
                    save_file(tensors, str(Path(args[0]) / "model.safetensors"))
                    value = str(args[0])
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(("ok", value))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        pub.close()
        conn.close()


def random_flat(num_params: int, seed: int) -> torch.Tensor:
    """Deterministic float32 flat parameters (tests and benchmarks rebuild them to compare bytes)."""
    return torch.randn(num_params, generator=torch.Generator().manual_seed(seed))


def snapshot_core_process(conn: Connection, mooncake_json: str | None = None) -> None:
    """Child-process main for a snapshot-channel core; commands until `("close",)`.

    ("publish", batch, num_params, seed) -> ref of `random_flat(num_params, seed)` published as `batch`;
    ("load", ref) -> the flat tensor (the core reading its own ref); ("begin_write",) leaves a write open;
    ("end_write", batch) closes it; ("close",).
    """
    from .mooncake import MooncakeConfig
    from .snapshot_channel import MooncakeSnapshotChannel

    cfg = MooncakeConfig.model_validate_json(mooncake_json) if mooncake_json else None
    channel = MooncakeSnapshotChannel(cfg)
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "close":
                    conn.send(("ok", None))
                    return
                if cmd == "publish":
                    value: Any = channel.publish(int(args[0]), random_flat(int(args[1]), int(args[2])))
                elif cmd == "load":
                    value = channel.load(str(args[0]))
                # leave a write open (sequence odd), as a core dying mid-publish would
                elif cmd == "begin_write":
                    channel._publisher.begin_write()  # type: ignore[union-attr]
                    value = None
                elif cmd == "end_write":
                    channel._publisher.end_write(int(args[0]))  # type: ignore[union-attr]
                    value = None
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(("ok", value))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        channel.close()
        conn.close()


def params_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's bytes in name order (compares weights across processes)."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def engine_process(conn: Connection, model_dir: str, cpu_threads: int | None = 1) -> None:
    """Child-process main: a TorchEngine on `model_dir` (not served over HTTP) that takes weight publications.

    ("subscribe", manifest_json[, shared_memory]) opens a WeightSubscriber -> whether it maps the publisher's
    buffer; ("pull"[, shared_memory[, bind]]) -> version (`pull_into_engine`, with that kind of subscriber if it has
    one; bind=False copies even where it could bind); ("unbind",) gives bound parameters memory of their own;
    ("disk", path, version) -> version (`TorchEngine.update_weights_from_disk`); ("digest",) -> `params_digest`
    of the engine's model; ("version",) -> the served weight version; ("close",).
    """
    from ..engine import EngineConfig, TorchEngine
    from .engine_loader import pull_into_engine
    from .manifest import WeightManifest
    from .subscriber import SubscriberConfig, WeightSubscriber

    engine = TorchEngine(
        EngineConfig(model_path=model_dir, device="cpu", cpu_threads=cpu_threads, max_total_tokens=1024)
    )
    subs: dict[bool, WeightSubscriber] = {}  # by shared_memory: one of each kind at most
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "close":
                    conn.send(("ok", None))
                    return
                if cmd == "subscribe":  # optional second argument: False reads over Mooncake even on one host
                    shared = bool(args[1]) if len(args) > 1 else True
                    if shared in subs:
                        subs.pop(shared).close()
                    subs[shared] = WeightSubscriber(
                        WeightManifest.model_validate_json(args[0]),
                        config=SubscriberConfig(shared_memory=shared),
                    )
                    value: Any = subs[shared].shared
                elif cmd == "pull":
                    sub = subs.get(bool(args[0]) if args else True) or next(iter(subs.values()), None)
                    if sub is None:
                        raise RuntimeError("no subscriber: send ('subscribe', manifest_json) first")
                    value = pull_into_engine(engine, sub, bind=bool(args[1]) if len(args) > 1 else True)
                elif cmd == "unbind":
                    with engine.between_steps():
                        engine.weights.unbind()
                    value = None
                elif cmd == "disk":
                    engine.update_weights_from_disk(
                        str(args[0]), weight_version=str(args[1]), flush_cache=True
                    )
                    value = engine.weight_version
                elif cmd == "digest":
                    value = params_digest(engine.model)
                elif cmd == "version":
                    value = engine.weight_version
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(("ok", value))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        for sub in subs.values():
            sub.close()
        engine.close()
        conn.close()
