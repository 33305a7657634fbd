"""The stage processes of a multi-rank cell (megatron, ``pipeline_parallel = P > 1``; gyre_train.megatron.cell).

The cell worker is the cell's stage 0: before the cells' rendezvous it starts one child process per other stage
(``python -m gyre_cell.worker_stages``), which joins the same gloo world, builds its stage of the model and then
follows the tokens the worker's stage 0 appends (pipeline items, drains, whole-cell operations such as gradient
gathers, optimizer steps, offload/restore), until ``stop``. Children die with their worker: each holds the read end
of a pipe whose only write end the worker holds (a lifeline: end of file when the worker is gone, however it died;
PDEATHSIG would follow the worker's set-up thread, which ends once the cell is built), and they stay in the worker's
process group. The other way round, a stage that exits before the worker closes the cell takes the worker down (its
leader would wait on it for good): the controller sees a dead cell.

A child logs to RUN/logs/cell-C-stage-S.log; every stage appends one line per drained batch (its pipeline counts
and pid) to RUN/metrics/pipeline/cell-C-stage-S.jsonl.
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

import torch

from gyre_cell.roles import TorchTrainingState
from gyre_cell.worker_types import CellWorkerConfig
from gyre_train.multicell import MultiCellConfig, PrefixGroups

log = logging.getLogger("gyre_cell.worker")

__all__ = ["CellStages", "PipelinedTrainingState", "main"]


def _multicell(cfg: CellWorkerConfig) -> MultiCellConfig:
    t = cfg.training
    assert t is not None
    return MultiCellConfig(
        num_cells=cfg.num_cells, master_port=t.master_port, control_port=t.coordinator_port,
        snapshot_dir=str(Path(cfg.run_dir) / "snapshots"), host=t.master_host or cfg.host,
        collective_timeout_s=t.collective_timeout_s,
    )  # fmt: skip


def _stats_path(cfg: CellWorkerConfig, stage: int) -> Path:
    return Path(cfg.run_dir) / "metrics" / "pipeline" / f"cell-{cfg.cell}-stage-{stage}.jsonl"


def _stage_hooks(state: TorchTrainingState) -> dict:
    return {"offload": state.offload_blocking, "restore": state.restore_blocking}


class PipelinedTrainingState:
    """The role manager's training side of a multi-rank cell: offload and restore run on every stage (an
    operation of the cell, applied by each stage to its own tensors)."""

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


class CellStages:
    """The worker's side: start the children, join the world as stage 0, drive the cell."""

    def __init__(self, cfg: CellWorkerConfig) -> None:
        t = cfg.training
        assert t is not None and t.backend == "megatron" and t.pipeline_parallel > 1
        self.cfg, self.size = cfg, t.pipeline_parallel
        self.procs: list[subprocess.Popen] = []
        conf = Path(cfg.run_dir) / "cells" / f"cell-{cfg.cell}-stages.json"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(cfg.model_dump_json())
        logs = Path(cfg.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        lifeline, self._lifeline = os.pipe()  # this process keeps the write end until it exits
        for stage in range(1, self.size):
            argv = [sys.executable, "-m", "gyre_cell.worker_stages", "--config", str(conf)]
            argv += ["--stage", str(stage), "--lifeline-fd", str(lifeline)]
            with open(logs / f"cell-{cfg.cell}-stage-{stage}.log", "ab") as out:
                self.procs.append(
                    subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, pass_fds=(lifeline,))
                )
        os.close(lifeline)
        self._closing = threading.Event()
        for stage, proc in enumerate(self.procs, start=1):
            _exit_if_stage_dies(proc, stage, cfg.cell, self._closing)
        self.backend = None  # PipelinedBackend, after attach
        self.worker = None
        self.state: PipelinedTrainingState | None = None

    def rendezvous(self) -> PrefixGroups:
        """Join the K * P world as this cell's stage 0 (instead of ``init_cell_process``)."""
        from gyre_train.megatron.cell import init_pipelined_cell

        return init_pipelined_cell(_multicell(self.cfg), self.cfg.cell, 0, self.size)

    def attach(self, stage_backend, loss):
        """Drive the cell from ``stage_backend`` (stage 0's MegatronBackend): returns the whole-cell backend."""
        from gyre_train.megatron.cell import PipelinedBackend, PipelinedWorker, open_channel

        own = TorchTrainingState(stage_backend.model, stage_backend.optimizer)
        channel = open_channel(self.cfg.training.master_host or self.cfg.host)
        self.backend = PipelinedBackend(
            stage_backend, channel, loss, cell=self.cfg.cell, stats_path=_stats_path(self.cfg, 0),
            hooks=_stage_hooks(own),
        )  # fmt: skip
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


def _exit_if_stage_dies(proc: subprocess.Popen, stage: int, cell: int, closing: threading.Event) -> None:
    """The other direction: a cell cannot train without one of its stages (its leader would wait on it for good),
    so a stage that ends before ``closing`` takes its worker down; the controller then sees a dead cell."""

    def watch() -> None:
        code = proc.wait()
        if not closing.is_set():
            log.error("cell %d: stage %d exited with %s; the cell cannot train without it: exiting", cell, stage,
                      code)  # fmt: skip
            logging.shutdown()
            os._exit(1)

    threading.Thread(target=watch, name=f"stage-{stage}-watch", daemon=True).start()


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
        prog="gyre-cell stage", description="one pipeline stage of a multi-rank cell"
    )
    parser.add_argument(
        "--config", required=True, type=Path, help="the cell worker's CellWorkerConfig as JSON"
    )
    parser.add_argument("--stage", required=True, type=int, help="pipeline stage of this process (>= 1)")
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
    if t is None or not 1 <= args.stage < t.pipeline_parallel:
        print(f"gyre-cell stage: --stage {args.stage} is not a follower stage of this cell", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s cell-{cfg.cell}/{args.stage}: %(message)s")
    torch.set_num_threads(cfg.cpu_threads)

    from gyre_train.backends import build_backend
    from gyre_train.megatron.cell import StageFollower, init_pipelined_cell, open_channel

    init_pipelined_cell(_multicell(cfg), cfg.cell, args.stage, t.pipeline_parallel)
    backend = build_backend(
        "megatron", model_path=cfg.engine.model_path, dtype=t.dtype, lr=t.lr, optimizer=cfg.cell == 0,
        pipeline_parallel=t.pipeline_parallel,
    )  # fmt: skip
    channel = open_channel(t.master_host or cfg.host)
    state = TorchTrainingState(backend.model, backend.optimizer)
    follower = StageFollower(
        backend, channel, t.loss, cell=cfg.cell, stats_path=_stats_path(cfg, args.stage),
        hooks=_stage_hooks(state),
    )  # fmt: skip
    log.info("stage %d of cell %d following (pid %d)", args.stage, cfg.cell, os.getpid())
    follower.serve()
    log.info("stopped")
    sys.stdout.flush()
    os._exit(0)  # gloo's threads must not keep a finished stage alive


if __name__ == "__main__":
    sys.exit(main())
