"""Assembly of a local Gyre run: model, engines, proxy, evaluator, trainer, controller; the whole loop for real.

`run_local(cfg)` is what `gyre demo` runs: on a machine without a GPU it builds the tiny offline Qwen3 model (unless
`model.path` names a local checkpoint), starts one CPU rollout engine per cell and the TITO proxy as subprocesses,
and lets the scheduler policy drive executions of the built-in agent through the proxy, assessments by gyre-eval,
GSPO steps and weight publications until `algorithm.steps` optimizer steps are done. The run directory ends up with
the layout of DESIGN §3.4.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

from gyre.config import RunConfig
from gyre.controller import Controller
from gyre.report import write_report
from gyre.services import LocalServices
from gyre.tasks import demo_queries, scoring_command
from gyre.training import LocalTraining
from gyre_cell.client import RolloutEngine
from gyre_cell.roles import CellRoleManager, CellRoleManagerConfig
from gyre_cell.tiny_model import build_tiny_model
from gyre_eval.config import ServiceConfig
from gyre_eval.exec_check import ExecCheckConfig
from gyre_eval.sandbox import SandboxConfig
from gyre_eval.service import AssessmentService
from gyre_eval.store import AssessmentStore
from gyre_sched.config import PolicyParams
from gyre_sched.policies import make_policy
from gyre_sched.runner import ExecutionRunner
from gyre_sched.trace import TraceWriter

log = logging.getLogger("gyre")

__all__ = ["RunDirError", "run_local"]


class RunDirError(ValueError):
    """The run directory cannot be used (it already holds a run)."""


def _policy_params(cfg: RunConfig) -> PolicyParams:
    c, a, g = cfg.cluster, cfg.algorithm, cfg.agent
    return PolicyParams(
        kind=c.policy, K=c.cells, C_e=c.executions_per_cell, N=a.group_size, B=a.batch_groups, phi=a.phi, mu=a.mu,
        rho_min=0.5, tau_s=1.0, async_train_cells=1, harness_timeout_s=g.harness_timeout_s,
        overall_budget_s=g.overall_budget_s,
    )  # fmt: skip


def _assessment_service(run_dir: Path, queries) -> AssessmentService:
    sandbox = SandboxConfig(timeout_s=30.0, cpu_s=30, memory_bytes=1 << 30)
    evaluators = {
        f"task-{q.query_id}": ExecCheckConfig(
            command=scoring_command(q), score_from="score_file", sandbox=sandbox
        )
        for q in queries
    }
    config = ServiceConfig(evaluators=evaluators, retry_wait_min_s=0.2, retry_wait_max_s=2.0)
    return AssessmentService(AssessmentStore(run_dir), config)


async def run_local(cfg: RunConfig) -> dict:
    if cfg.run_dir is None:
        cfg = cfg.model_copy(update={"run_dir": time.strftime("runs/%Y%m%d-%H%M%S", time.gmtime())})
    run_dir = Path(cfg.run_dir).resolve()
    if (run_dir / "trace.jsonl").exists():
        raise RunDirError(f"{run_dir} already holds a run (trace.jsonl); choose another --run-dir")
    for sub in ("records", "trajectories", "checkpoints", "metrics", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
    started = time.monotonic()

    model_dir = Path(cfg.model.path) if cfg.model.path else run_dir / "model"
    if cfg.model.path is None and not (model_dir / "config.json").exists():
        log.info("building the tiny offline Qwen3 model in %s", model_dir)
        build_tiny_model(model_dir)

    params = _policy_params(cfg)
    policy = make_policy(params)
    queries = demo_queries()
    services = LocalServices(run_dir)
    try:
        log.info("starting %d CPU rollout engine(s) and the TITO proxy", cfg.cluster.cells)
        await services.start_engines(model_dir, cfg.cluster.cells, cfg.algorithm.seed)
        await services.start_proxy(model_dir)
        log.info("loading %d training worker(s)", cfg.cluster.cells)
        training = LocalTraining(
            model_dir, run_dir, cells=cfg.cluster.cells, group_size=cfg.algorithm.group_size,
            batch_groups=cfg.algorithm.batch_groups, lr=cfg.algorithm.lr, temperature=cfg.model.temperature,
        )  # fmt: skip
        agent_argv = ["--max-turns", str(cfg.agent.max_turns), "--max-tokens", str(cfg.agent.max_tokens),
                      "--temperature", str(cfg.model.temperature)]  # fmt: skip
        harness = [sys.executable, "-m", "gyre.agent", "--workspace", "{workspace}", "--task", "{task}",
                   *agent_argv]  # fmt: skip
        runner = ExecutionRunner(
            run_dir, services.proxy_url, services.admin_token, harness, cfg.agent.harness_timeout_s
        )
        engines = [RolloutEngine(url) for url in services.engine_urls]
        states = training.cell_states()
        for state in states:  # every cell starts in rollout: its training state is off the device
            await state.offload()
        cells = [
            CellRoleManager(engine, state, CellRoleManagerConfig(cell=str(i)))
            for i, (engine, state) in enumerate(zip(engines, states, strict=True))
        ]
        assessments = _assessment_service(run_dir, queries)
        header = {"K": params.K, "C_e": params.C_e, "C_s": params.C_s, "N": params.N, "B": params.B,
                  "phi": params.phi, "mu": params.mu, "policy": params.kind, "real": True}  # fmt: skip
        # Unbuffered: every trace line reaches the file when written, so a crash loses no event.
        trace = TraceWriter((run_dir / "trace.jsonl").open("wb", buffering=0), header)
        controller = Controller(
            cfg, run_dir, policy, trace, runner, engines, cells, training, assessments, queries
        )
        log.info("running %d optimizer steps (policy %s, K=%d, N=%d, B=%d)", cfg.algorithm.steps,
                 params.kind, params.K, params.N, params.B)  # fmt: skip
        try:
            steps = await controller.run(cfg.algorithm.steps)
        finally:
            await controller.shutdown()
            await assessments.close()
            await runner.aclose()
            for engine in engines:
                await engine.aclose()
            trace.close()
    finally:
        services.stop()
    report = write_report(run_dir)
    return {
        "run_dir": str(run_dir),
        "steps": len(steps),
        "mean_reward_per_step": [s["mean_reward"] for s in steps],
        "wall_s": round(time.monotonic() - started, 1),
        "report": str(report),
    }


def run_local_sync(cfg: RunConfig) -> dict:
    return asyncio.run(run_local(cfg))
