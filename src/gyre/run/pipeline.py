"""Assembly of a run: model, cell workers, standalone engines, proxy, evaluator, controller; the whole loop for real.

`run(cfg)` is what `gyre run CONFIG` and `gyre demo` (a preset of it) execute. Without `model.path` it uses the demo
policy (`gyre.demo.model`: a small Qwen3 model built offline on first use, then cached); it starts one cell worker
process per cell (rollout engine + training side, `gyre-cell worker`), the standalone engines and the TITO proxy,
then lets the scheduler policy drive executions of the built-in agent through the proxy, assessments by gyre-eval,
streamed GSPO steps claimed by the training cells and weight publications, until `train.steps` optimizer steps are
done. It then publishes and saves the final weights. The run directory ends up with the layout of docs/design/architecture.md#run-directory-and-trace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from gyre.config import AssessmentSection, HarnessConfig, RunConfig, resolve_transports
from gyre.datasets import task_queries
from gyre.demo import agent
from gyre.demo.model import demo_policy
from gyre.launch import Launcher, make_launcher
from gyre.launch.base import cell_configs
from gyre.observe.monitor import RunMonitor
from gyre.observe.report import write_report
from gyre.run.controller import Controller
from gyre.run.judging import judge_endpoint, judge_evaluator
from gyre.run.resume import ResumePoint
from gyre.tasks import demo_queries, scoring_command
from gyre_eval.config import PluginConfig, ServiceConfig
from gyre_eval.exec_check import ExecCheckConfig
from gyre_sched.policies import make_policy
from gyre_sched.runner import ExecutionRunner
from gyre_sched.sandbox import LaunchSandbox, default_ro_paths
from gyre_sched.trace import TraceWriter, policy_header

log = logging.getLogger("gyre")

__all__ = ["RunDirError", "run"]


LONG_CONTEXT = 65536
"""Positions of the `model.builtin = "long-context"` model (the engine's KV pool holds as many tokens)."""


class RunDirError(ValueError):
    """The run directory cannot be used (it already holds a run)."""


def _launch_sandbox(cfg: HarnessConfig) -> LaunchSandbox | None:
    """The run's execution sandbox, or None when `[harness] sandbox` is off."""
    if not cfg.sandbox:
        return None
    extra = [str(Path(p).expanduser().resolve()) for p in cfg.ro_paths]
    return LaunchSandbox(
        runtime=cfg.sandbox_runtime, oci_runtime=cfg.oci_runtime, ro_paths=[*default_ro_paths(), *extra]
    )


def _assessment_config(
    run_dir: Path, queries, judge: dict | None = None, settings: AssessmentSection | None = None
) -> ServiceConfig:
    """gyre-eval's config for this run: one exec check or judge (`judge`: its endpoint, gyre.run.judging) per task;
    artifacts only from the run's workspaces; `settings`: the run's `[assessment]`."""
    settings = settings or AssessmentSection()
    sandbox = settings.check_sandbox
    evaluators = {}
    for q in queries:
        if hasattr(q, "evaluator"):  # a task file's scoring rule (gyre.datasets)
            spec = q.evaluator()
            if spec["kind"] == "judge":
                evaluators[f"task-{q.query_id}"] = judge_evaluator(q.query_id, spec, judge)
            elif spec["kind"] == "plugin":  # a Python evaluator (gyre-eval builds it in its own process)
                evaluators[f"task-{q.query_id}"] = PluginConfig.model_validate(spec)
            else:
                evaluators[f"task-{q.query_id}"] = ExecCheckConfig.model_validate(spec)
            continue
        evaluators[f"task-{q.query_id}"] = ExecCheckConfig(
            command=scoring_command(q), score_from="score_file", sandbox=sandbox
        )
    (run_dir / "workspaces").mkdir(exist_ok=True)
    return ServiceConfig(
        evaluators=evaluators,
        max_concurrent=settings.max_concurrent,
        retry_wait_min_s=settings.retry_wait_min_s,
        retry_wait_max_s=settings.retry_wait_max_s,
        artifact_roots=[str(run_dir / "workspaces")],
    )


def prepare_run_dir(cfg: RunConfig) -> tuple[RunConfig, Path]:
    if cfg.run_dir is None:
        cfg = cfg.model_copy(update={"run_dir": time.strftime("runs/%Y%m%d-%H%M%S", time.gmtime())})
    run_dir = Path(cfg.run_dir).resolve()
    if (run_dir / "trace.jsonl").exists():
        raise RunDirError(f"{run_dir} already holds a run (trace.jsonl); choose another --run-dir")
    cfg, note = resolve_transports(cfg)  # config.json records the transport actually used
    if note is not None:
        log.warning(note)
    # 0700: the run holds credentials (tokens, the dashboard's URL) and every execution's work, which no other
    # local user, nor a check dropped to its own uid, may read (a sibling's answer was one symlink away)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    run_dir.chmod(0o700)
    for sub in ("records", "trajectories", "checkpoints", "metrics", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
    return cfg, run_dir


async def run(cfg: RunConfig, services: Launcher | None = None, resume: ResumePoint | None = None) -> dict:
    """One run; `services` lets the caller stop the processes from a signal handler (see gyre.cli); `resume`
    continues an interrupted one (gyre.run.resume; `cfg` is then its config)."""
    cfg, run_dir = (resume.cfg, resume.run_dir) if resume else prepare_run_dir(cfg)
    started = time.monotonic() - process_age_s()  # wall_s counts interpreter start and imports too
    model_dir = Path(cfg.model.path) if cfg.model.path else run_dir / "model"
    if cfg.model.path is None and not (model_dir / "config.json").exists():
        if cfg.model.builtin == "long-context":  # a seeded random init: the same bytes on every machine
            from gyre_cell.tiny_model import TinyModelConfig, build_tiny_model  # torch: only when needed

            shape = TinyModelConfig(max_position_embeddings=LONG_CONTEXT, seed=cfg.train.seed)
            build_tiny_model(model_dir, shape)
        else:
            shutil.copytree(demo_policy(), model_dir)  # built on first use, then cached (gyre.demo.model)

    params = cfg.policy_params()
    policy = make_policy(params) if resume is None else resume.policy(make_policy(params))
    queries = (
        task_queries(cfg.tasks.file, cfg.tasks.limit) if cfg.tasks.file else demo_queries(cfg.train.seed)
    )
    # Group n works on dataset item n mod len: the ledger names that item (q<item>), so a query id recurs each
    # epoch and the policy's launch order can learn its durations (`scheduler.launch_order = "predicted"`).
    count = len(queries)
    policy.ledger.query_of = lambda seq: f"q{seq % count}"
    services = services or make_launcher(cfg, run_dir)
    services.warm_up(cfg)
    services.run_dir = run_dir
    # Async assigns its training cells here: the header records the initial roles. A resumed run starts where its
    # trace left off.
    start = policy.start(resume.t_end if resume else 0.0)
    header = {**policy_header(params), "real": True, "initial_roles": [r.value for r in policy.roles]}
    # Unbuffered: every trace line reaches the file when written, so a crash loses no event.
    if resume is None:
        trace = TraceWriter((run_dir / "trace.jsonl").open("wb", buffering=0), header)
    else:
        trace = resume.trace(header["initial_roles"])
    monitor: RunMonitor | None = None
    try:
        log.info(
            "starting %d cell worker(s), %d standalone engine(s) and the TITO proxy",
            cfg.cluster.cells,
            cfg.cluster.standalone_engines,
        )
        if resume is None:
            await services.start_cells(cell_configs(cfg, run_dir, model_dir))
        else:
            await services.start_cells(resume.cell_configs(cell_configs(cfg, run_dir, resume.model_dir)))
        await services.start_proxy(model_dir, temperature=cfg.model.temperature)
        # -I -S: the built-in agent needs only the standard library, so it starts without site-packages (~30 ms)
        agent_argv = [
            sys.executable,
            "-I",
            "-S",
            agent.__file__,
            "--workspace",
            "{workspace}",
            "--task",
            "{task}",
            "--max-turns",
            str(cfg.agent.max_turns),
            "--max-tokens",
            str(cfg.agent.max_tokens),
            "--temperature",
            str(cfg.model.temperature),
            "--context-chars",
            str(cfg.agent.context_chars),
        ]
        harness = agent_argv if cfg.harness.kind == "builtin" else cfg.harness.spec()
        runner = ExecutionRunner(
            run_dir,
            services.proxy_url,
            services.admin_token,
            harness,
            cfg.agent.harness_timeout_s,
            overall_budget_s=cfg.agent.overall_budget_s,
            stall_detect_s=cfg.agent.stall_detect_s,
            sandbox=_launch_sandbox(cfg.harness),
        )
        judged = any(hasattr(q, "evaluator") and q.evaluator()["kind"] == "judge" for q in queries)
        judge = None
        if judged:  # the run's proxy (its own execution) or [judge] base_url
            private = run_dir / "private"
            judge = await judge_endpoint(cfg.judge, services.proxy_url, runner.admin_call, private)
        assessments = await services.start_eval(_assessment_config(run_dir, queries, judge, cfg.assessment))
        published = (await services.cells[0].status()).published
        controller = Controller(
            cfg,
            run_dir,
            policy,
            trace,
            runner,
            services.cells,
            services.standalone,
            assessments,
            queries,
            published,
        )
        if resume is not None:
            resume.continue_clock(controller)
            resume.carry_into(controller)
        monitor = RunMonitor(cfg, run_dir, controller)  # metrics sink, live dashboard, progress bar
        controller.on_step = monitor.on_step
        # a dead satellite starts again (gyre.run.cell_effects)
        controller.enable_restarts(services.restart_cell)
        await monitor.start()
        log.info(
            "running %d optimizer steps (policy %s, K=%d, N=%d, B=%d, phi=%g, mu=%d)",
            cfg.train.steps,
            params.kind,
            params.K,
            params.N,
            params.B,
            params.phi,
            params.mu,
        )
        try:
            steps = await services.supervise(controller.run(cfg.train.steps, start))
            final = await services.supervise(controller.finish())
            state = controller.scheduler_state()
            state = json.dumps(resume.scheduler_state(state) if resume else state, indent=1)
            (run_dir / "metrics" / "scheduler.json").write_text(state + "\n")
        finally:
            await monitor.end_run()
            await controller.shutdown()
            await assessments.aclose()
            await runner.aclose()
    except BaseException:
        if monitor is not None:
            await monitor.close()
        raise
    finally:
        trace.close()
        await services.aclose_clients()
        services.stop()
    report = write_report(run_dir)
    try:
        await monitor.linger()  # [dashboard] linger_s: the final state stays up
    finally:
        await monitor.close()
    return {
        "run_dir": str(run_dir),
        "steps": len(steps),
        "mean_reward_per_step": [s["mean_reward"] for s in steps],
        "microsteps_by_cell": [s["microsteps_by_cell"] for s in steps],
        "final_weights": final.path,
        "transport": {"weights": cfg.weights.transport, "snapshot": cfg.weights.snapshot},
        "wall_s": round(time.monotonic() - started, 1),
        "report": str(report),
    }


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0.0 elsewhere)."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_at = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, ticks since boot
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - started_at)
    except (OSError, ValueError, IndexError):
        return 0.0


def run_sync(cfg: RunConfig) -> dict:
    return asyncio.run(run(cfg))
