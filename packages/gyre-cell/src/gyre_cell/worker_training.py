"""The training side of a cell worker: gyre-train's multi-cell trainer inside a long-lived cell process.

Every elastic cell joins one gloo process group at start-up (rank = cell index) and builds the K-1 prefix groups
once; they stay alive across role changes. The core (cell 0) owns the trajectory buffer, the trainer, the optimizer
and the micro-step coordinator; satellites hold a backend without optimizer and claim micro-steps through the core's
coordinator while the scheduler has them in training. Everything here blocks: the worker runs it in threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from gyre_cell.binds import confine_gloo
from gyre_cell.errors import CommandRefused
from gyre_cell.roles import TorchTrainingState
from gyre_cell.step_checkpoint import load_step_checkpoint, write_step_checkpoint
from gyre_cell.transfer.publisher import WeightPublisher
from gyre_cell.worker_stages import CellStages, RankSpawner, is_multi_rank
from gyre_cell.worker_types import CellWorkerConfig, PublishedWeights
from gyre_train.backends import build_backend
from gyre_train.buffer import TrajectoryBuffer
from gyre_train.cell import CellWorker
from gyre_train.checkpoint import save_checkpoint
from gyre_train.multicell import (
    CoreRunner,
    MultiCellConfig,
    coordinator_key,
    init_cell_process,
    reform_cell_world,
)
from gyre_train.packing import PackingConfig
from gyre_train.satellite import SatelliteRunner
from gyre_train.snapshot import FileSnapshotChannel
from gyre_train.trainer import Trainer, TrainerConfig
from gyre_train.types import ReadyGroupMessage, StepReport

log = logging.getLogger("gyre_cell.worker")

__all__ = ["CellTraining"]

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

Emit = Callable[..., None]


def _snapshot_channel(cfg: CellWorkerConfig, secret: str | None):
    assert cfg.training is not None
    if cfg.training.snapshot == "file":
        return FileSnapshotChannel(Path(cfg.run_dir) / "snapshots")
    if cfg.training.snapshot == "http":  # Mooncake cannot load here (gyre.config.resolve_transports)
        from gyre_cell.transfer.http_snapshot_channel import HttpSnapshotChannel

        return HttpSnapshotChannel(cfg.host, secret=secret or "")
    from gyre_cell.transfer.snapshot_channel import MooncakeSnapshotChannel

    return MooncakeSnapshotChannel(cfg.mooncake)


class CellTraining:
    """Backend, training state and (core) trainer + coordinator, or (satellite) the claiming runner."""

    def __init__(
        self,
        cfg: CellWorkerConfig,
        emit: Emit,
        rendezvous_timeout_s: float | None = None,
        members: list[int] | None = None,
        rank_spawner: RankSpawner | None = None,
        run_secret: str | None = None,
    ) -> None:
        """``rendezvous_timeout_s``: this (restarted) cell joins a re-formed world generation, whose rendezvous is
        bounded (`reform_cell_world`), of the cells ``members`` (None: all K); None: the run's first world.
        ``rank_spawner``: how a multi-rank cell starts its other ranks (None: children on this machine).
        ``run_secret``: the run's engine token, which every cell holds: the HTTP weight transport's requests carry
        it, and the coordinator's key is derived from it, so only the run's cells can act as one. A lone cell (K = 1)
        may go without: its coordinator gets a random key."""
        if cfg.training is None:
            raise ValueError("a cell without a [training] section has no training side")
        if run_secret is None and cfg.num_cells > 1:
            raise ValueError("a multi-cell run needs the run's secret (--api-key-fd or --api-key-file)")
        self.cfg, self.emit = cfg, emit
        t = cfg.training
        self.is_core = cfg.cell == 0
        self.mc = mc = MultiCellConfig(
            num_cells=cfg.num_cells,
            master_port=t.master_port,
            control_port=t.coordinator_port,
            snapshot_dir=str(Path(cfg.run_dir) / "snapshots"),
            steps_per_burst=t.steps_per_burst,
            host=t.master_host or cfg.host,
            claim_timeout_s=t.claim_timeout_s,
            starve_timeout_s=float("inf"),
            collective_timeout_s=t.collective_timeout_s,
            **({"authkey": coordinator_key(run_secret)} if run_secret is not None else {}),
        )
        confine_gloo(cfg.host)  # before the first gloo pair: they listen on this cell's interface only
        # gloo rendezvous of all K cells, prefix groups built once; before the backend, because a megatron
        # backend builds its groups over this world (collectively, every cell at this point).
        # A multi-rank cell (megatron, TP or PP > 1): this process is its rank 0; its children, started now, the
        # others.
        self.stages = CellStages(cfg, rank_spawner) if is_multi_rank(cfg) else None
        if self.stages is not None:
            self.groups = self.stages.rendezvous()
        elif rendezvous_timeout_s is not None:
            self.groups = reform_cell_world(mc, cfg.cell, mc.master_port, rendezvous_timeout_s, members)
        else:
            self.groups = init_cell_process(mc, cfg.cell)
        self.backend = build_backend(
            t.backend,
            model_path=cfg.engine.model_path,
            dtype=t.dtype,
            lr=t.lr,
            optimizer=self.is_core,
            lr_warmup_steps=t.lr_warmup_steps,
            device=t.device,
            tensor_parallel=t.tensor_parallel,
            pipeline_parallel=t.pipeline_parallel,
            context_parallel=t.context_parallel,
            expert_parallel=t.expert_parallel,
        )
        if self.stages is not None:  # the whole cell as one backend (gyre_train.megatron.cell)
            self.backend = self.stages.attach(self.backend, t.loss)
        # A resumed run: weights (also the engine's model_path) and optimizer state of the last checkpointed step.
        self.version = 0
        if self.is_core and t.resume_from is not None:
            self.version = load_step_checkpoint(Path(t.resume_from), self.backend)
        self.state = TorchTrainingState(self.backend.model, self.backend.optimizer)
        self.worker = CellWorker(cfg.cell, self.backend, t.loss)
        if self.stages is not None:  # items through the cell's pipeline; offload/restore on every stage
            self.worker, self.state = self.stages.worker, self.stages.state
        self.publisher: WeightPublisher | None = None
        self.published = PublishedWeights(version=self.version, path=cfg.engine.model_path)
        # weights = "http": Mooncake cannot load here (gyre.config.resolve_transports); the core serves its buffer
        if self.is_core and cfg.weights == "http":
            from gyre_cell.transfer.http_publisher import HttpWeightPublisher

            self.publisher = HttpWeightPublisher(
                self.backend.hf_state_dict(), version=self.version, secret=run_secret or ""
            )
        elif self.is_core and cfg.weights == "mooncake":
            # Layout fixed now, from the initial model; refreshed in place at each publication.
            self.publisher = WeightPublisher(
                self.backend.hf_state_dict(), version=self.version, config=cfg.mooncake
            )
        if self.publisher is not None:
            url = self.publisher.serve_manifest(cfg.host)
            self.published = PublishedWeights(
                version=self.version, manifest_url=url, path=cfg.engine.model_path
            )
        self.state.offload_blocking()  # every cell starts in rollout: the engine has the memory
        self.snapshots = _snapshot_channel(cfg, run_secret)
        self.abort = threading.Event()
        self.leave = threading.Event()
        self._burst_lock = threading.Lock()
        self._may_join = False
        self._thread: threading.Thread | None = None
        self.core: CoreRunner | None = None
        self._held_until_joined = False
        self.satellite: SatelliteRunner | None = None
        self._stopped: set[str] = set()  # the stop test gate's points reached
        if self.is_core:
            self.buffer = TrajectoryBuffer(t.group_size)
            packing = PackingConfig(
                group_size=t.group_size,
                batch_groups=t.batch_groups,
                tokens_per_shard=t.tokens_per_shard,
                temperature=t.temperature,
                window_shards=1,
            )
            trainer_cfg = TrainerConfig(
                packing=packing, loss=t.loss, max_grad_norm=t.max_grad_norm, queue_ahead=t.queue_ahead
            )
            self.trainer = Trainer(trainer_cfg, self.worker, self.buffer)
            self.trainer.version = self.version
            self.trainer.on_event = self._on_trainer_event
            self.core = CoreRunner(mc, self.trainer, self.groups, snapshots=self.snapshots)
        else:
            self.satellite = SatelliteRunner(mc, self.worker, self.groups, snapshots=self.snapshots)
            if self._gated("reduce"):
                self.satellite.before_collective = self._stop_before_reduce

    # ---- events ------------------------------------------------------------------------------------------------
    def _on_trainer_event(self, kind: str, fields: dict) -> None:
        if kind in ("group_assigned", "microstep_claim"):
            self.emit(kind, **fields)

    def _background(self, name: str, fn: Callable[[], None]) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"cell {self.cfg.cell}: {self._thread.name} is still running")

        def guarded() -> None:
            try:
                fn()
            except Exception as exc:  # reported to the controller, which stops the run loudly
                log.exception("cell %d: %s failed", self.cfg.cell, name)
                self.emit("error", where=name, message=f"{type(exc).__name__}: {exc}")

        # Started before it is published: a concurrent wait_idle (to_rollout) must never see an unstarted thread.
        thread = threading.Thread(target=guarded, name=name, daemon=True)
        thread.start()
        self._thread = thread

    def wait_idle(self) -> None:
        """Block until the step (core) or the burst (satellite) thread has returned."""
        if self._thread is not None:
            self._thread.join()

    # ---- core ----------------------------------------------------------------------------------------------------
    def add_group(self, message: ReadyGroupMessage) -> None:
        self.buffer.add_group_message(message)

    def open_batch(self, version: int, final: bool) -> None:
        assert self.core is not None
        if version != self.trainer.version:  # the controller's view is stale: refused (409), nothing opened
            raise CommandRefused(
                409, f"batch for version {version}, but the trainer is at version {self.trainer.version}"
            )
        # The trainer is at `version`: the previous step's thread has emitted its step_end and is only returning
        # (the controller can ask for the next batch within that window).
        self.wait_idle()
        dump = Path(self.cfg.run_dir) / "metrics" / "batches" / f"batch-{version}"
        dump_dir = str(dump) if version in self.cfg.training.dump_batches else None

        def run() -> None:
            report: StepReport = self.core.step(
                before_core_item=self._hold_for_join, final=final, abort=self.abort, dump_dir=dump_dir
            )
            self.version = report.policy_version
            row = report.model_dump(mode="json")
            # Before step_end: a step the controller recorded always has its checkpoint.
            if self.cfg.training.checkpoint_keep:
                root = Path(self.cfg.run_dir) / "checkpoints" / "trainer"
                write_step_checkpoint(
                    root, self.trainer, self._save_hf_to, row, self.cfg.training.checkpoint_keep
                )
            self.emit("step_end", report=row)

        self._background(f"step-{version}", run)

    def _hold_for_join(self, done_by_core: int) -> None:
        """The `hold_core_for_join` test gate (see CellTrainingConfig)."""
        cell = self.cfg.training.hold_core_for_join
        if cell is None or done_by_core != 1 or self._held_until_joined:
            return
        try:
            self.core.coordinator.wait_claimed(cell, timeout=self.cfg.training.hold_timeout_s)
            self._held_until_joined = True
        except TimeoutError:
            log.info("cell %d did not join batch %d within the hold; going on", cell, self.trainer.version)

    @contextlib.contextmanager
    def _resident(self):
        """Training state on the device for the block (restored if the cell is in rollout, offloaded again)."""
        offloaded = self.state.offloaded
        if offloaded:
            self.state.restore_blocking()
        try:
            yield
        finally:
            if offloaded:
                self.state.offload_blocking()

    def publish(self, version: int, save: bool) -> PublishedWeights:
        """Expose `version` to rollout engines: refresh the Mooncake buffer in place, and/or write a checkpoint."""
        t0 = time.perf_counter()
        path = None
        with self._resident():
            if self.publisher is not None:
                try:  # it refuses NaN/inf weights, which the engines then need not check
                    self.publisher.publish(self.backend.hf_state_dict(), version=version)
                except ValueError as exc:
                    raise CommandRefused(
                        409, f"cell {self.cfg.cell}: version {version} not published: {exc}"
                    ) from exc
            if save or self.publisher is None:
                path = str(self._save_hf(version))
        self.published = PublishedWeights(
            version=version,
            manifest_url=self.published.manifest_url if self.publisher is not None else None,
            path=path,
            seconds=time.perf_counter() - t0,
        )
        return self.published

    def _save_hf(self, version: int) -> Path:
        out = Path(self.cfg.run_dir) / "checkpoints" / f"policy-v{version}"
        self._save_hf_to(out)
        return out

    def _save_hf_to(self, out: Path) -> None:
        """The policy as a checkpoint engines and backends load: weights + the tokenizer files of the model."""
        self.backend.save_hf_pretrained(out)
        src = Path(self.cfg.engine.model_path)
        for name in _TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, out / name)

    def save(self, version: int) -> PublishedWeights:
        """The final save: the policy as a checkpoint engines can load, and the trainer state."""
        with self._resident():
            path = self._save_hf(version)
            root = Path(self.cfg.run_dir) / "checkpoints" / "trainer"
            if not (root / f"step-{self.trainer.version}" / "meta.json").exists():  # else: the step's own
                save_checkpoint(root, self.trainer)
        return PublishedWeights(version=version, path=str(path))

    def published_tensors(self) -> dict[str, torch.Tensor] | None:
        """The core's own engine loads the published version straight from its buffer (no transfer)."""
        return self.publisher.tensors() if self.publisher is not None else None

    # ---- satellite -----------------------------------------------------------------------------------------------
    def arm(self) -> None:
        """The cell is in training now: joins may start bursts until the next `stop_burst`."""
        with self._burst_lock:
            self._may_join = True

    def join(self) -> bool:
        """Start a burst; False when the cell left training first (a join that raced a `to_rollout`)."""
        assert self.satellite is not None
        self.wait_idle()  # a burst that just ended is still emitting its satellite_done
        with self._burst_lock:  # against stop_burst: never clear its leave, never start after it
            if not self._may_join:
                return False
            self.leave.clear()

            def run() -> None:
                result = self.satellite.run_burst(self.leave)
                self.emit("satellite_done", cell=self.cfg.cell, result=result)

            self._background("burst", run)
        return True

    def stop_burst(self) -> None:
        """Leave training: the burst thread returns at its next safe point (never inside a claimed item)."""
        with self._burst_lock:
            self._may_join = False
            self.leave.set()
        self.wait_idle()

    # ---- the stop test gate --------------------------------------------------------------------------------------
    def _gated(self, at: str) -> bool:
        gate = self.cfg.training.stop_gate
        return gate is not None and gate.cell == self.cfg.cell and gate.at == at and not self.cfg.restarted

    def _stop_before_reduce(self, kind: str, batch: int | None) -> None:
        if kind == "reduce":
            self._stop_at("reduce", f"the reduce of batch {batch}")

    def _stop_at(self, at: str, where: str) -> None:
        """The `stop_gate` test gate: SIGSTOP this process the first time it reaches `at`."""
        if at not in self._stopped:
            self._stopped.add(at)
            log.warning("test gate stop_gate: cell %d stops before %s", self.cfg.cell, where)
            os.kill(os.getpid(), signal.SIGSTOP)

    # ---- a new world generation ----------------------------------------------------------------------------------
    def reform(
        self,
        master_port: int,
        rejoining: list[int],
        rendezvous_timeout_s: float,
        members: list[int] | None = None,
    ) -> None:
        """Join the next generation of the gloo world (a restarted cell takes its rank again; ``members``: its
        cells, None for all K); at a burst boundary: no step or burst runs here. The core lets the rejoining cells
        join batches (and its `hold_core_for_join` gate applies again to a rejoining hold cell)."""
        if self.stages is not None:
            raise ValueError(
                "a pipelined cell (PP > 1) cannot re-form the training world: its stages are one group"
            )
        if self._gated("reform"):
            self._stop_at("reform", f"the re-form on port {master_port}")
        # A satellite that stays in training (Async) waits for the next batch in its burst thread: it leaves the
        # wait (it holds no claim: no batch is open at a boundary) and waits again in the new world.
        waiting = self.satellite is not None and self._may_join
        if waiting:
            self.stop_burst()
        self.wait_idle()
        self.groups = reform_cell_world(self.mc, self.cfg.cell, master_port, rendezvous_timeout_s, members)
        # A megatron backend built its groups over the old world: it re-creates them now, at the point where the
        # restarted cell builds its backend (after its own reform_cell_world), so the collective calls match.
        self.backend.regroup()
        self.mc = replace(self.mc, master_port=master_port)
        if self.core is not None:
            self.core.groups = self.groups
            self.core.coordinator.new_world()  # satellites of a failed collective may train again
            for cell in rejoining:
                self.core.coordinator.revive(cell)
            if self.cfg.training.hold_core_for_join in rejoining:
                self._held_until_joined = False
        else:
            self.satellite.groups = self.groups
            if waiting:
                self.arm()
                self.join()

    def close(self) -> None:
        self.abort.set()
        self.leave.set()
        if self.core is not None:
            self.core.stop()
        with contextlib.suppress(Exception):
            self.snapshots.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.stages is not None:
            self.stages.close()
