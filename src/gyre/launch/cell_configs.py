"""The cell workers' configs: what each cell of a run is (its ranks, GPUs, engine and its server's launch), from the
run's config. Every launcher starts the same configs; `Launcher.restart_cell` starts one again with `restarted`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gyre.config import ConfigError, RunConfig, resolve_transports
from gyre_cell.engine.config import EngineConfig
from gyre_cell.ports import free_ports
from gyre_cell.sglang_launch import SGLangLaunchConfig
from gyre_cell.vllm_launch import VLLMLaunchConfig
from gyre_cell.worker_types import CellTrainingConfig, CellWorkerConfig

__all__ = ["cell_configs", "cell_name"]


def cell_name(wc: CellWorkerConfig) -> str:
    return f"cell-{wc.cell}" if wc.kind == "elastic" else f"standalone-{wc.cell}"


def cell_configs(cfg: RunConfig, run_dir: Path, model_dir: Path) -> list[CellWorkerConfig]:
    """Every worker's config on loopback: the K elastic cells first (index = cell), then the standalone engines.

    A launcher that places workers on other hosts rewrites the addresses (`host`, `port`, `mooncake`, the training
    rendezvous) once it knows each worker's node; everything else is the same for every launcher.
    """
    # A worker takes a transport, never "auto": `gyre run` resolved it at start (and said so); direct callers here.
    if "auto" in (cfg.weights.transport, cfg.weights.snapshot):
        cfg, _ = resolve_transports(cfg)
    c, s, t, dbg = cfg.cluster, cfg.scheduler, cfg.train, cfg.debug
    workers = c.cells + c.standalone_engines
    # an SGLang or vLLM server beside each worker, on a port of its own
    server = cfg.rollout.engine != "torch"
    # distinct: none is bound before the workers start (two independent draws once gave the same port twice)
    master, coordinator, *ports = free_ports(2 + workers * (2 if server else 1))
    worker_ports, server_ports = ports[:workers], ports[workers:]
    gpus = _local_gpus(cfg, workers)
    scripted = str(Path(cfg.rollout.scripted_replies).resolve()) if cfg.rollout.scripted_replies else None
    out = []
    for i in range(c.cells + c.standalone_engines):
        elastic = i < c.cells
        index = i if elastic else i - c.cells
        engine = EngineConfig(
            model_path=str(model_dir),
            device=c.device,
            weight_version="0",
            seed=t.seed + i,
            cpu_threads=c.cpu_threads_per_cell,
            scripted_replies=scripted,
        )
        training = None
        if elastic:
            training = CellTrainingConfig(
                group_size=s.N,
                batch_groups=s.B,
                steps_per_burst=s.mu,
                lr=t.lr,
                dtype=t.dtype,
                lr_warmup_steps=t.lr_warmup_steps,
                max_grad_norm=t.max_grad_norm,
                tokens_per_shard=t.tokens_per_shard,
                temperature=cfg.model.temperature,
                loss=t.loss,
                master_port=master,
                coordinator_port=coordinator,
                claim_timeout_s=t.claim_timeout_s,
                collective_timeout_s=t.collective_timeout_s,
                snapshot=cfg.weights.snapshot,
                dump_batches=dbg.dump_batches,
                hold_core_for_join=dbg.hold_core_for_join,
                hold_timeout_s=dbg.hold_timeout_s,
                stop_gate=dbg.stop_gate,
                backend=t.backend,
                device=c.device,
                tensor_parallel=t.tensor_parallel,
                pipeline_parallel=t.pipeline_parallel,
                context_parallel=t.context_parallel,
                expert_parallel=t.expert_parallel,
                checkpoint_keep=t.checkpoint_keep,
            )
        out.append(
            CellWorkerConfig(
                cell=index,
                kind="elastic" if elastic else "standalone",
                num_cells=c.cells,
                run_dir=str(run_dir),
                port=worker_ports[i],
                engine=engine,
                training=training,
                weights=cfg.weights.transport,
                mooncake=cfg.weights.mooncake,
                cpu_threads=c.cpu_threads_per_cell,
                visible_gpus=gpus[i] if gpus is not None else None,
                sglang=_sglang_launch(cfg, model_dir, server_ports[i], t.seed + i)
                if cfg.rollout.engine == "sglang"
                else None,
                vllm=_vllm_launch(cfg, model_dir, server_ports[i], t.seed + i)
                if cfg.rollout.engine == "vllm"
                else None,
            )
        )
    return out


def _local_gpus(cfg: RunConfig, workers: int) -> list[list[str]] | None:
    """The local launcher's GPUs for each worker in order: `gpus_per_cell` whole ids each, or one id shared by
    1/gpus_per_cell workers in a row; taken from this process's CUDA_VISIBLE_DEVICES (ids or UUIDs), counted from 0
    when it is unset. None when no GPU is handed out (CPU, or Ray, which sets each actor's own)."""
    per = cfg.launcher.gpus_per_cell
    if cfg.launcher.kind != "local" or per == 0:
        return None
    whole, share = (int(per), 1) if per >= 1 else (1, round(1 / per))  # the config refused anything else
    slots = (
        [list(range(w * whole, (w + 1) * whole)) for w in range(workers)]
        if share == 1
        else [[w // share] for w in range(workers)]
    )
    need = slots[-1][-1] + 1
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    pool = [g.strip() for g in listed.split(",") if g.strip()] if listed is not None else None
    if pool is not None and len(pool) < need:
        raise ConfigError(
            f"launcher.gpus_per_cell = {per:g} for {workers} worker(s) needs {need} GPUs; "
            f"CUDA_VISIBLE_DEVICES lists {len(pool)} ({listed!r})"
        )
    ids = pool if pool is not None else [str(g) for g in range(need)]
    return [[ids[g] for g in slot] for slot in slots]


def _sglang_launch(cfg: RunConfig, model_dir: Path, port: int, seed: int) -> SGLangLaunchConfig:
    """One worker's SGLang server, from `[rollout.sglang]`: the run's policy at version 0, on loopback (a launcher
    placing the worker elsewhere rebinds it)."""
    sg = cfg.rollout.sglang
    return SGLangLaunchConfig(
        model_path=str(model_dir),
        host="127.0.0.1",
        port=port,
        tp_size=sg.tp_size,
        mem_fraction_static=sg.mem_fraction_static,
        weight_version="0",
        random_seed=seed,
        python=sg.python or sys.executable,
        module=sg.module,
        extra_args=tuple(sg.extra_args),
    )


def _vllm_launch(cfg: RunConfig, model_dir: Path, port: int, seed: int) -> VLLMLaunchConfig:
    """One worker's vLLM server, from `[rollout.vllm]`: the run's policy at version 0, on loopback (a launcher
    placing the worker elsewhere rebinds it). Its compile caches stay in vLLM's default place (keyed by model and
    settings): a cold compile took 97 of a server's 237 s start."""
    v = cfg.rollout.vllm
    return VLLMLaunchConfig(
        model_path=str(model_dir),
        python=v.python or sys.executable,
        host="127.0.0.1",
        port=port,
        dtype=v.dtype,
        max_model_len=v.max_model_len,
        weight_version="0",
        seed=seed,
        enforce_eager=v.enforce_eager,
        stream_interval=v.stream_interval,
        enable_sleep_mode=v.enable_sleep_mode,
        gpu_memory_utilization=v.gpu_memory_utilization,
        cpu_kv_cache_gib=v.cpu_kv_cache_gib,
        extra_args=tuple(v.extra_args),
    )
