"""The rank processes of a multi-rank cell (megatron, ``tensor_parallel * pipeline_parallel > 1``;
gyre_train.megatron.cell).

The cell worker is the cell's rank 0 (TP rank 0 of stage 0): before the cells' rendezvous it starts one child
process per other rank of the cell (``python -m gyre_cell.worker_stages --rank R``, R = tp + T * stage), which
joins the same gloo world, builds its shard of the model and then follows the tokens the worker appends (pipeline items, drains, whole-cell operations such as gradient
gathers, optimizer steps, offload/restore), until ``stop``. Children die with their worker: each holds the read end
of a pipe whose only write end the worker holds (a lifeline: end of file when the worker is gone, however it died;
PDEATHSIG would follow the worker's set-up thread, which ends once the cell is built), and they stay in the worker's
process group. The other way round, a stage that exits before the worker closes the cell takes the worker down (its
leader would wait on it for good): the controller sees a dead cell.

A child logs to RUN/logs/cell-C-stage-S[-tp-T].log (the TP suffix when T > 1); every rank appends one line per
drained batch (its pipeline counts and pid) to RUN/metrics/pipeline/cell-C-stage-S[-tp-T].jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Protocol

import torch

from gyre_cell.binds import confine_gloo
from gyre_cell.roles import TorchTrainingState
from gyre_cell.worker_types import CellWorkerConfig
from gyre_train.multicell import MultiCellConfig, PrefixGroups

log = logging.getLogger("gyre_cell.worker")

__all__ = [
    "CellStages",
    "LocalRanks",
    "PipelinedTrainingState",
    "RankProcess",
    "RankSpawner",
    "is_multi_rank",
    "main",
]


def _multicell(cfg: CellWorkerConfig) -> MultiCellConfig:
    t = cfg.training
    assert t is not None
    return MultiCellConfig(
        num_cells=cfg.num_cells,
        master_port=t.master_port,
        control_port=t.coordinator_port,
        snapshot_dir=str(Path(cfg.run_dir) / "snapshots"),
        host=t.master_host or cfg.host,
        collective_timeout_s=t.collective_timeout_s,
    )


def _rank_name(cfg: CellWorkerConfig, local: int) -> str:
    """cell-C-stage-S, with -tp-T when the cell is tensor-parallel: the name of its log and pipeline counts."""
    from gyre_train.megatron.cell import cell_position

    assert cfg.training is not None
    size = cfg.training.tensor_parallel
    tp, stage = cell_position(local, size)
    return f"cell-{cfg.cell}-stage-{stage}" + (f"-tp-{tp}" if size > 1 else "")


def _stats_path(cfg: CellWorkerConfig, local: int) -> Path:
    return Path(cfg.run_dir) / "metrics" / "pipeline" / f"{_rank_name(cfg, local)}.jsonl"


def _stage_hooks(state: TorchTrainingState) -> dict:
    return {"offload": state.offload_blocking, "restore": state.restore_blocking}


class PipelinedTrainingState:
    """The role manager's training side of a multi-rank cell: offload and restore run on every rank (an
    operation of the cell, applied by each rank to its own tensors)."""

    def __init__(self, own: TorchTrainingState, cell) -> None:
        self.own, self.cell = own, cell

    @property
    def offloaded(self) -> bool:
        return self.own.offloaded

    def nbytes(self) -> int:
        return self.own.nbytes()

    def offload_blocking(self) -> None:
        self.cell.call("offload")

    def restore_blocking(self) -> None:
        self.cell.call("restore")

    async def offload(self) -> None:
        await asyncio.to_thread(self.offload_blocking)

    async def restore(self) -> None:
        await asyncio.to_thread(self.restore_blocking)


class RankProcess(Protocol):
    """What the worker holds of one of its cell's other ranks (the part of ``subprocess.Popen`` it uses)."""

    pid: int

    def wait(self, timeout: float | None = None) -> int:
        """The exit status once the rank ended; ``subprocess.TimeoutExpired`` after ``timeout``."""
        ...

    def kill(self) -> None: ...


class RankSpawner(Protocol):
    """Starts a cell's other ranks: :class:`LocalRanks` by default; a launcher that places a cell's ranks on other
    nodes hands the worker its own (``gyre.launch.ray``: the ranks of the cell's further placement-group bundles,
    each started by an actor on that bundle's node)."""

    def spawn(self, local: int, argv: list[str], log_path: Path) -> RankProcess: ...


class LocalRanks:
    """The cell's other ranks as children of the worker, on its machine, tied to it by the lifeline pipe."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # this process keeps the write end until it exits

    def spawn(self, local: int, argv: list[str], log_path: Path) -> RankProcess:
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                [*argv, "--lifeline-fd", str(self._read)],
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(self._read,),
            )


class CellStages:
    """The worker's side: start the other ranks, join the world as the cell's rank 0, drive the cell."""

    def __init__(self, cfg: CellWorkerConfig, spawner: RankSpawner | None = None) -> None:
        t = cfg.training
        assert t is not None and is_multi_rank(cfg)
        self.cfg, self.size = cfg, t.tensor_parallel * t.pipeline_parallel
        self.procs: list[RankProcess] = []
        conf = Path(cfg.run_dir) / "cells" / f"cell-{cfg.cell}-stages.json"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(cfg.model_dump_json())
        logs = Path(cfg.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        spawner = spawner if spawner is not None else LocalRanks()
        for local in range(1, self.size):
            argv = [
                sys.executable,
                "-m",
                "gyre_cell.worker_stages",
                "--config",
                str(conf),
                "--rank",
                str(local),
            ]
            self.procs.append(spawner.spawn(local, argv, logs / f"{_rank_name(cfg, local)}.log"))
        self._closing = threading.Event()
        for local, proc in enumerate(self.procs, start=1):
            _exit_if_stage_dies(proc, _rank_name(cfg, local), self._closing)
        self.backend = None  # PipelinedBackend, after attach
        self.worker = None
        self.state: PipelinedTrainingState | None = None

    def rendezvous(self) -> PrefixGroups:
        """Join the K * T * P world as this cell's rank 0 (instead of ``init_cell_process``)."""
        from gyre_train.megatron.cell import init_pipelined_cell

        t = self.cfg.training
        return init_pipelined_cell(
            _multicell(self.cfg), self.cfg.cell, 0, t.pipeline_parallel, 0, t.tensor_parallel
        )

    def attach(self, stage_backend, loss):
        """Drive the cell from ``stage_backend`` (stage 0's MegatronBackend): returns the whole-cell backend."""
        from gyre_train.megatron.cell import PipelinedBackend, PipelinedWorker, open_channel

        own = TorchTrainingState(stage_backend.model, stage_backend.optimizer)
        # Hosted by this process on its own node's address (the core's, master_host, is another node's on Ray).
        channel = open_channel(self.cfg.host)
        self.backend = PipelinedBackend(
            stage_backend,
            channel,
            loss,
            cell=self.cfg.cell,
            stats_path=_stats_path(self.cfg, 0),
            hooks=_stage_hooks(own),
        )
        self.worker = PipelinedWorker(self.backend)
        self.state = PipelinedTrainingState(own, self.backend)
        return self.backend

    def close(self, timeout_s: float = 10.0) -> None:
        self._closing.set()
        if self.backend is not None:
            with contextlib.suppress(Exception):
                self.backend.stop()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()


def _exit_if_stage_dies(proc: RankProcess, name: str, closing: threading.Event) -> None:
    """The other direction: a cell cannot train without one of its ranks (its leader would wait on it for good),
    so a rank that ends before ``closing`` takes its worker down; the controller then sees a dead cell."""

    def watch() -> None:
        code = proc.wait()
        if not closing.is_set():
            log.error("%s exited with %s; the cell cannot train without it: exiting", name, code)
            logging.shutdown()
            os._exit(1)

    threading.Thread(target=watch, name=f"{name}-watch", daemon=True).start()


def is_multi_rank(cfg: CellWorkerConfig) -> bool:
    """Whether the cell has ranks besides its worker (megatron with TP or PP > 1)."""
    t = cfg.training
    return t is not None and t.backend == "megatron" and t.tensor_parallel * t.pipeline_parallel > 1


def _die_with_worker(fd: int) -> None:
    """Exit as soon as the worker's end of the lifeline closes (the worker is gone, however it ended)."""

    def watch() -> None:
        while os.read(fd, 1):  # nothing is ever written: returns b"" at end of file
            pass
        log.info("the cell worker is gone: exiting")
        os._exit(1)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gyre-cell stage", description="one rank (TP rank, pipeline stage) of a multi-rank cell"
    )
    parser.add_argument(
        "--config", required=True, type=Path, help="the cell worker's CellWorkerConfig as JSON"
    )
    parser.add_argument(
        "--rank", required=True, type=int, help="rank in the cell (>= 1): TP rank + T * pipeline stage"
    )
    parser.add_argument("--lifeline-fd", type=int, help="read end of the worker's lifeline pipe")
    args = parser.parse_args(argv)
    if args.lifeline_fd is not None:
        _die_with_worker(args.lifeline_fd)
    try:
        cfg = CellWorkerConfig.model_validate_json(args.config.read_text())
    except (OSError, ValueError) as exc:
        print(f"gyre-cell stage: {args.config}: {exc}", file=sys.stderr)
        return 2
    t = cfg.training
    if t is None or not is_multi_rank(cfg) or not 1 <= args.rank < t.tensor_parallel * t.pipeline_parallel:
        print(f"gyre-cell stage: --rank {args.rank} is not a follower rank of this cell", file=sys.stderr)
        return 2
    name = _rank_name(cfg, args.rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name}: %(message)s")
    torch.set_num_threads(cfg.cpu_threads)

    from gyre_train.backends import build_backend
    from gyre_train.megatron.cell import StageFollower, cell_position, init_pipelined_cell, open_channel

    tp, stage = cell_position(args.rank, t.tensor_parallel)
    confine_gloo(cfg.host)  # no-op where the worker or the rank host named the interface already
    init_pipelined_cell(_multicell(cfg), cfg.cell, stage, t.pipeline_parallel, tp, t.tensor_parallel)
    backend = build_backend(
        "megatron",
        model_path=cfg.engine.model_path,
        dtype=t.dtype,
        lr=t.lr,
        optimizer=cfg.cell == 0,
        tensor_parallel=t.tensor_parallel,
        pipeline_parallel=t.pipeline_parallel,
    )
    channel = open_channel(cfg.host)  # the leader's address reaches this rank through the channel's broadcast
    state = TorchTrainingState(backend.model, backend.optimizer)
    follower = StageFollower(
        backend,
        channel,
        t.loss,
        cell=cfg.cell,
        stats_path=_stats_path(cfg, args.rank),
        hooks=_stage_hooks(state),
    )
    log.info("%s following (pid %d)", name, os.getpid())
    follower.serve()
    log.info("stopped")
    sys.stdout.flush()
    os._exit(0)  # gloo's threads must not keep a finished stage alive


if __name__ == "__main__":
    sys.exit(main())
