"""The resolved configuration of a Gyre run: one typed tree, loaded from TOML/JSON, written first to RUN/config.json.

Each section that a package owns is that package's own config model, embedded as is: `[scheduler]` is gyre-sched's
`PolicyConfig`, `[train.loss]` gyre-train's `LossConfig`, `[weights.mooncake]` gyre-cell's `MooncakeConfig`. The
assembly reads them and hands them on; it hard-codes none of their values. Invalid combinations (for example
Colocate with phi > 0 and no standalone pool) are refused here, naming the fields.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from gyre.config_rollout import SECTION_CONFIG, RolloutConfig, WeightsConfig
from gyre_cell.stop_gate import StopGate

# Only torch-free modules: `gyre config` and `gyre --help` load this file, and tests/test_cli_door.py checks that
# they do not load torch (the worker's wire types and the loss itself do: their config models live apart).
from gyre_eval.sandbox import SandboxConfig
from gyre_sched.config import PolicyConfig, PolicyParams
from gyre_train.backends import check_backend
from gyre_train.loss_config import LossConfig

__all__ = ["ConfigError", "RunConfig", "check_model_path", "load_config", "resolve_transports"]


class _Section(BaseModel):
    model_config = SECTION_CONFIG


class ModelConfig(_Section):
    path: str | None = None
    """A local Hugging Face checkpoint; None copies the demo policy into RUN/model (a small Qwen3 model built
    offline and briefly trained on the demo's tasks on first use, cached under ~/.cache/gyre: gyre.demo.model)."""
    builtin: Literal["demo", "long-context"] = "demo"
    """Without `path`: the demo policy (2048 positions), or `long-context`: a random-init tiny Qwen3 with 65536
    positions built offline into RUN/model (gyre_cell.tiny_model), for harnesses whose prompts are far longer than
    the demo's context (Claude Code's real prompt is ~7k tokens with four tools, ~47k with all of them)."""
    temperature: float = Field(1.0, gt=0)
    """Rollout sampling temperature; the trainer computes log-probs at the same temperature."""


class ClusterConfig(_Section):
    cells: int = Field(2, ge=1)
    """K: elastic cells; cell 0 is the core (optimizer owner). Each cell is one worker process (engine + trainer)."""
    executions_per_cell: int = Field(4, ge=1)
    """C_e: concurrent executions one cell serves in rollout."""
    standalone_engines: int = Field(0, ge=0)
    """Rollout-only engine processes (the standalone pool); they never train."""
    standalone_capacity: int = Field(0, ge=0)
    """C_s: concurrent executions the whole standalone pool serves (0 with no pool)."""
    cpu_threads_per_cell: int = Field(1, ge=1)
    """torch intra-op threads of each cell process (1 is fastest for tiny models on a shared CPU)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where each cell's torch engine and torch trainer run. cuda: on the GPUs the cell is given
    (`[launcher] gpus_per_cell` > 0: by CUDA_VISIBLE_DEVICES on the local launcher, the placement group's
    own on Ray); a worker that sees none refuses to start. The megatron backend and SGLang servers use the cell's
    GPUs whatever this says."""

    @model_validator(mode="after")
    def _pool(self) -> ClusterConfig:
        if (self.standalone_engines == 0) != (self.standalone_capacity == 0):
            raise ValueError(
                "cluster.standalone_engines and cluster.standalone_capacity must both be 0 or both be > 0 "
                f"(got {self.standalone_engines} and {self.standalone_capacity})"
            )
        return self


_MOVED_TO_DEBUG = ("dump_batches", "hold_core_for_join", "hold_timeout_s", "stop_gate")


class TrainConfig(_Section):
    @model_validator(mode="before")
    @classmethod
    def _gates_moved(cls, data: Any) -> Any:
        moved = [k for k in _MOVED_TO_DEBUG if isinstance(data, dict) and k in data]
        if moved:
            raise ValueError(f"train.{moved[0]} moved to [debug]: set debug.{moved[0]}")
        return data

    steps: int = Field(40, ge=1)
    """Optimizer steps to run (the demo's 40 take a few minutes on 2 cores and show its reward rising)."""
    lr: float = Field(1e-3, gt=0)
    """Adam learning rate (the paper uses 1e-6 at 122B; the demo policy needs far more). For the demo it goes with
    `max_grad_norm` 0.3: at 1e-3 with a clip of 1.0 one seed of three collapsed, as at 1.4e-3; at 3e-3 it collapsed."""
    lr_warmup_steps: int = Field(10, ge=0)
    """Linear lr warm-up over the first optimizer steps (step k uses lr * k / lr_warmup_steps); 0: constant lr.
    Torch backend only for now (a megatron config sets 0)."""
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """Training parameter dtype (float64 for exactness checks)."""
    max_grad_norm: float = Field(0.3, gt=0)
    """Global gradient-norm clip, once per step. The demo's steps mostly have norms of 0.1-0.3; its collapses came
    after steps of 0.6-0.7 (a push on many clipped negative-advantage executions), which 0.3 bounds."""
    tokens_per_shard: int = Field(256, ge=8)
    """Token budget of one micro-step: a batch spans several micro-steps, which cells claim."""
    j_max: int = Field(5, ge=1)
    """Trajectories admitted per execution (docs/design/tito.md#provenance-mask-and-selection)."""
    advantage: Literal["grpo", "mean"] = "grpo"
    """Group-relative advantage: (r - mean) / (std + 1e-6) with the population std, or r - mean."""
    seed: int = 0
    """Seeds selection, sampling and the tiny model."""
    claim_timeout_s: float = Field(300.0, gt=0)
    """A satellite holding one micro-step longer than this is dropped and its work requeued."""
    collective_timeout_s: float = Field(300.0, gt=0)
    """Timeout of the end-of-batch reduce and broadcast between cells. A satellite that dies inside them fails
    them at once; one that hangs (a stopped host) fails them after this long. Either way the core runs the
    satellites' micro-steps of that batch itself and updates alone, and the world is re-formed at the next burst
    boundary. It must exceed the core's optimizer update, which satellites staying for the next batch wait for."""
    checkpoint_keep: int = Field(2, ge=0)
    """Step checkpoints kept under RUN/checkpoints/trainer (weights, optimizer, HF policy; one per step, the
    last this many): what `gyre run --resume RUN` continues from. 0: only the final save."""
    loss: LossConfig = LossConfig()
    """The GSPO objective; the loss and its metrics read this one config."""
    backend: Literal["torch", "megatron"] = "torch"
    """Training backend of every cell: Hugging Face torch, or megatron-core (`gyre-train[megatron]`)."""
    tensor_parallel: int = Field(1, ge=1)
    """TP inside a cell (megatron, float32): the cell worker is TP rank 0 and starts one process per other rank
    (with PP, per other TP rank and stage); heads, KV heads and vocab divide by it. CP and EP stay 1 in `gyre run`
    cells (torchrun layouts only)."""
    pipeline_parallel: int = Field(1, ge=1)
    """PP inside a cell (megatron, float32): the cell worker is stage 0 and starts one process per other stage;
    the cell runs its claimed micro-steps through one continuous 1F1B (gyre_train.megatron.cell)."""
    context_parallel: int = Field(1, ge=1)
    """CP inside a cell (megatron, Transformer Engine spec, bf16)."""
    expert_parallel: int = Field(1, ge=1)
    """EP inside a cell (megatron, Qwen3-MoE checkpoints)."""

    @model_validator(mode="after")
    def _backend(self) -> TrainConfig:
        check_backend(
            self.backend,
            dtype=self.dtype,
            tensor_parallel=self.tensor_parallel,
            pipeline_parallel=self.pipeline_parallel,
            context_parallel=self.context_parallel,
            expert_parallel=self.expert_parallel,
            lr_warmup_steps=self.lr_warmup_steps,
            one_process_cells=True,
            prefix="train.",
        )
        return self


class AgentConfig(_Section):
    max_turns: int = Field(6, ge=1)
    """Model calls per execution before the built-in agent gives up (without an answer)."""
    max_tokens: int = Field(40, ge=1)
    """max_tokens per model call."""
    context_chars: int = Field(150, ge=0)
    """The built-in agent resets its context (task + notes of its tool calls) once the conversation has grown by
    this many characters; the execution's tree then has another branch. 0: never."""
    harness_timeout_s: float = Field(120.0, gt=0)
    """The task's own deadline: the execution stops and its work is still assessed."""
    overall_budget_s: float = Field(300.0, gt=0)
    """From launch, execution plus evaluation retries; exhausted without a score = excluded."""
    stall_detect_s: float | None = Field(None, gt=0)
    """Stall watchdog: an execution with no model call and no output for this long ends `stalled` and is excluded
    without assessment (gyre_sched.runner). None: off (a hang then lasts until the harness timeout)."""


class DashboardConfig(_Section):
    enabled: bool = True
    """Serve the live dashboard during the run (read-only; its URL is logged and written to RUN/dashboard.url)."""
    host: str = "127.0.0.1"
    """Bind address. Loopback by default; any other address requires a token."""
    port: int = Field(0, ge=0, le=65535)
    """0: a free port."""
    token: str | None = None
    """Access token; None on a non-loopback host generates one (it is part of the printed URL)."""
    refresh_s: float = Field(1.0, gt=0)
    """How often the page asks for new data."""
    linger_s: float = Field(0.0, ge=0)
    """Keep serving this long after the run ends (the final state; SIGINT/SIGTERM still stop at once)."""


class MetricsConfig(_Section):
    tensorboard: bool = True
    """Write TensorBoard event files under RUN/metrics/ (per step and per interval)."""
    interval_s: float = Field(2.0, ge=1.0)
    """Interval of the scheduler/rollout metrics (executions, waterlevel, role shares, tokens/s, latency)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (needs `wandb` installed; WANDB_* variables apply)."""
    wandb_entity: str | None = None
    """The Weights & Biases entity (team or user) of `wandb_project` (None: the account's default)."""


class LauncherConfig(_Section):
    """Where the run's processes live (`gyre.launch`): local subprocesses, or Ray actors in placement groups."""

    kind: Literal["local", "ray"] = "local"
    """local: subprocesses on this machine (no Ray). ray: one placement group per cell, cell workers as actors."""
    address: str | None = None
    """Ray: the cluster to join (`auto`, `HOST:6379`); None starts a Ray instance on this machine."""
    num_cpus: int | None = None
    """Ray without an address: CPUs of the local instance (None: Ray's own count)."""
    cpus_per_cell: float | None = Field(None, gt=0)
    """Ray: CPUs of each cell's placement group (None: cluster.cpu_threads_per_cell)."""
    gpus_per_cell: float = Field(0.0, ge=0)
    """GPUs of each worker (0 on CPU). Ray: its placement group's. local: whole GPUs handed out in order (the K
    cells, then the standalone engines) from this process's CUDA_VISIBLE_DEVICES, or from GPU 0 when it is unset;
    each worker, its SGLang server included, sees only its own. 1/n: n workers in a row share one GPU."""
    cell_resources: list[dict[str, float]] = []
    """Ray: extra resources of cell i's bundle (standalone engines follow the K cells), e.g. a node's custom
    resource to pin a cell to it; shorter than the worker list = nothing extra for the rest."""
    bundles_per_cell: int = Field(1, ge=1)
    """Ray: bundles of each cell's placement group, so a cell can span nodes. Each bundle gets the cell's CPUs
    and gpus_per_cell / n GPUs; the worker runs in bundle 0 (where `cell_resources` pins it) with its first ranks,
    and a Megatron cell's T x P ranks are split over the bundles in order (rank r in bundle r * n // (T * P)), each
    further bundle's started by an actor on its node. Needs megatron, T x P >= n."""
    cell_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray: the placement strategy of a cell's bundles (STRICT_SPREAD: one node each)."""
    proxy_resources: dict[str, float] | None = None
    """Ray: run the TITO proxy as an actor on a node offering these resources (e.g. a node's custom resource; {}:
    any node; a "CPU" entry reserves CPUs, else none); None: a subprocess beside the controller. The agents reach it
    at its node's address."""
    eval_resources: dict[str, float] | None = None
    """Ray: the same for gyre-eval (its checks read the workspaces: the run directory is on a shared filesystem)."""
    controller_resources: dict[str, float] | None = None
    """Ray: run the controller (scheduler, execution runner and harnesses, the trainer's coordination) as the child
    of an actor on a node offering these resources (`gyre.launch.placed`); the `gyre run` that placed it follows its
    log and ends with it. None: the controller is the `gyre run` process itself."""
    start_timeout_s: float = Field(300.0, gt=0)
    """Ray: how long the placement groups may wait for resources."""
    cell_restarts: int = Field(1, ge=0)
    """Restarts of one satellite cell's worker after it died mid-run (gyre.run.cell_effects); past them it stays lost."""
    service_hang_s: float = Field(30.0, gt=0)
    """The proxy or gyre-eval answering no health probe (every 5 s) for this long is hung: killed, then handled as a
    dead one (gyre-eval restarted on its port; the proxy's death ends the run with one line naming it)."""
    cell_silence_s: float = Field(50.0, ge=2.0)
    """A cell whose event stream answers nothing for this long is lost (a stopped or hung host: no reset, no end of
    file, calls just hang). The stream's long poll is answered at least every min(20 s, half of this) while the cell
    lives, so a busy cell is not taken for a silent one."""
    reform_timeout_s: float = Field(120.0, gt=0)
    """A restarted satellite rejoins training when every cell re-forms the gloo world: how long the core waits for
    all K cells there. A cell that dies or hangs inside it costs this long, not gloo's 30 minutes."""

    @model_validator(mode="after")
    def _placement_needs_ray(self) -> LauncherConfig:
        for name in ("proxy_resources", "eval_resources", "controller_resources"):
            if getattr(self, name) is not None and self.kind != "ray":
                raise ValueError(
                    f"{name} places a process on a Ray cluster: it needs kind = 'ray' (or --ray)"
                )
        return self


DEMO_SCHEDULER = PolicyConfig(
    kind="elastic", N=4, B=4, phi=0.5, mu=2, rho_min=0.5, tau_s=1.0, async_train_cells=1
)
"""The demo's scheduler: small groups and batches so a CPU machine finishes steps in seconds; bursts of two steps
so that a satellite joins the core's batches once the burst's rollouts are done."""


class TasksConfig(_Section):
    file: str | None = None
    """A task file (JSONL, Parquet or dataset folder; `gyre tasks validate FILE`, format in gyre.datasets), or a Harbor
    task folder or a folder of them (gyre.harbor_tasks). None: the demo's task family."""
    limit: int | None = Field(None, ge=1)
    """Use the first `limit` tasks of the file (groups take them in order, cycling)."""


class HarnessConfig(_Section):
    kind: Literal["builtin", "command", "claude-code"] = "builtin"
    """The run's harness (gyre_sched.harness); a task's own `harness` field overrides it for that task."""
    command: list[str] | None = None
    """`command`: argv template ({workspace}, {task}, {base_url}, {model}; a leading `~/` in the program is the home
    directory); base URL and key in the environment."""
    binary: str | None = None
    """`claude-code`: the CLI (default: the repository's pinned node_modules/.bin/claude)."""
    allowed_tools: list[str] = ["Bash", "Read", "Write", "Edit", "Glob", "Grep"]
    """`claude-code`: --allowedTools."""
    tools: list[str] | None = None
    """`claude-code`: --tools, the built-in tools the model is offered (None: the CLI's default set of 24)."""
    max_turns: int = Field(30, ge=1)
    """`claude-code`: --max-turns."""
    max_output_tokens: int | None = Field(None, ge=1)
    """`claude-code`: CLAUDE_CODE_MAX_OUTPUT_TOKENS."""
    env: dict[str, str] = {}
    """`command`, `claude-code`: further environment variables of the harness (e.g. Claude Code's
    CLAUDE_CODE_AUTO_COMPACT_WINDOW); the proxy's address and the execution's key are always Gyre's own."""
    sandbox: bool = False
    """Run each harness in the launch sandbox (gyre_sched.sandbox: own namespaces, network only to the proxy, limits)."""
    ro_paths: list[str] = []
    """Further host paths the sandboxed harness sees read-only, beside Gyre's own interpreter and packages: a harness
    from an environment of its own (mini-swe-agent's, say) needs that environment."""
    sandbox_runtime: Literal["bubblewrap", "oci"] = "bubblewrap"
    """What makes the sandbox: bubblewrap, or the OCI container runtime `oci_runtime` (needs root)."""
    oci_runtime: str = "runc"
    """`sandbox_runtime = "oci"`: the runtime's binary (runc; crun where the host's cgroups are pure v1 or v2)."""

    def spec(self) -> dict:
        """The gyre_sched.harness.make_harness spec of the run's harness (None for the built-in agent's argv)."""
        if self.kind == "command":
            argv = list(self.command or [])
            if argv:  # `~/...` as a shell would read it: a program in the user's own environment
                argv[0] = os.path.expanduser(argv[0])
            return {"kind": "command", "command": argv, "extra_env": dict(self.env)}
        if self.kind == "claude-code":
            out = {
                "kind": "claude-code",
                "allowed_tools": tuple(self.allowed_tools),
                "max_turns": self.max_turns,
                "max_output_tokens": self.max_output_tokens,
                "extra_env": dict(self.env),
                "tools": tuple(self.tools) if self.tools is not None else None,
            }
            return out | ({"binary": self.binary} if self.binary else {})
        return {"kind": "builtin"}

    @model_validator(mode="after")
    def _command_given(self) -> HarnessConfig:
        if self.kind == "command" and not self.command:
            raise ValueError("[harness] kind = 'command' needs command = [argv...]")
        return self


class JudgeSection(_Section):
    """The model scoring tasks whose scoring rule is a judge rubric (gyre-eval's judge; see gyre.run.judging)."""

    base_url: str | None = None
    """An OpenAI-compatible endpoint root (http://host:port/v1). None: the run's own TITO proxy, where the judge is
    one more execution (id `judge`, its own credential; its calls are recorded and never trained on)."""
    model: str = "gyre-policy"
    """The model name asked of the endpoint (the run's own proxy serves the policy under any name)."""
    api_key_env: str | None = None
    """`base_url`'s key, read from this environment variable."""
    temperature: float = Field(0.0, ge=0)
    """Asked of the endpoint (the run's proxy pins every call to the run's temperature)."""
    max_tokens: int = Field(256, ge=1)
    """max_tokens of each judge call."""
    max_artifact_chars: int = Field(20_000, ge=100)
    """Workspace text shown to the judge (larger artifacts are truncated, and the prompt says so)."""


class AssessmentSection(_Section):
    """gyre-eval's service for the run: how many evaluations run at once, how failed attempts are retried, and the
    limits of the built-in tasks' executable checks (a task file's own rule brings its own)."""

    max_concurrent: int = Field(4, ge=1)
    """Evaluations running at once; the rest wait (their execution's budget keeps running)."""
    retry_wait_min_s: float = Field(0.2, ge=0)
    """First wait after a failed attempt (exponential backoff)."""
    retry_wait_max_s: float = Field(2.0, ge=0)
    """Longest wait between attempts."""
    check_sandbox: SandboxConfig = SandboxConfig(timeout_s=30.0, cpu_s=30, memory_bytes=1 << 30)
    """gyre-eval's sandbox of the built-in tasks' scoring check (wall time, CPU seconds, memory, ...)."""

    @model_validator(mode="after")
    def _waits(self) -> AssessmentSection:
        if self.retry_wait_max_s < self.retry_wait_min_s:
            raise ValueError("[assessment] retry_wait_max_s must be >= retry_wait_min_s")
        return self


class DebugConfig(_Section):
    """Test gates and checks: what makes a timing-dependent scenario certain in a short run, or dumps what a check
    compares. None of it belongs in a production run."""

    dump_batches: list[int] = []
    """Batches whose micro-steps, weights and summed gradients are written to RUN/metrics/batches (checks)."""
    hold_core_for_join: int | None = None
    """Test gate: before its second micro-step of a batch the core waits (at most `hold_timeout_s`) for this
    satellite to join and claim an item, until it has once; makes a mid-batch join that trains certain in short
    runs. While any satellite's worker restarts no batch opens, and the wait applies again once this cell
    rejoined."""
    hold_timeout_s: float = Field(30.0, gt=0)
    """How long the `hold_core_for_join` gate holds the core before it goes on alone (a loaded machine can take
    longer to move a restarted cell back into training)."""
    stop_gate: StopGate | None = None
    """Test gate: satellite `cell` stops itself (SIGSTOP) the first time it reaches `at`: right before its
    end-of-batch reduce (`reduce`) or when asked to re-form the world (`reform`), as a host that stops answering
    there does (`gyre_cell.worker_types.StopGate`)."""


class RunConfig(_Section):
    run_dir: str | None = None
    """None: runs/<UTC timestamp>. Where config.json, trace.jsonl, records/, assessments.sqlite, trajectories/, checkpoints/, report.html go."""
    model: ModelConfig = ModelConfig()
    """The policy: a local Hugging Face checkpoint or a builtin model, and its sampling temperature."""
    cluster: ClusterConfig = ClusterConfig()
    """The cells and the standalone rollout pool: how many, how many executions each serves, on which device."""
    scheduler: PolicyConfig = DEMO_SCHEDULER
    """gyre-sched's policy config: kind (elastic/async/colocate), N, B, phi, mu, rho_min, tau_s, k_spare, dispatch..."""
    train: TrainConfig = TrainConfig()
    """The optimizer, the GSPO loss, micro-steps, checkpoints and the training backend."""
    weights: WeightsConfig = WeightsConfig()
    """How the core's new weights reach the rollout engines and joining satellites."""
    rollout: RolloutConfig = RolloutConfig()
    """The rollout engine of every cell: in-process torch (default) or a supervised SGLang or vLLM server."""
    agent: AgentConfig = AgentConfig()
    """The built-in agent's limits and every execution's deadlines."""
    dashboard: DashboardConfig = DashboardConfig()
    """The live dashboard served during the run."""
    metrics: MetricsConfig = MetricsConfig()
    """TensorBoard files and, optionally, Weights & Biases."""
    launcher: LauncherConfig = LauncherConfig()
    """local subprocesses (default) or a Ray cluster (`gyre run --ray ADDRESS`)."""
    tasks: TasksConfig = TasksConfig()
    """The task file (None: the demo's tasks)."""
    harness: HarnessConfig = HarnessConfig()
    """The program each execution runs: the built-in agent, a command, or Claude Code."""
    judge: JudgeSection = JudgeSection()
    """Scores judge-rubric tasks: the run's proxy (its own execution, never trained) or another endpoint."""
    assessment: AssessmentSection = AssessmentSection()
    """gyre-eval's service: concurrency, retries, the built-in checks' limits."""
    debug: DebugConfig = DebugConfig()
    """Test gates and checks (holding the core for a join, stopping a satellite at a point, dumping batches)."""

    @model_validator(mode="after")
    def _policy_valid(self) -> RunConfig:
        try:
            self.policy_params()
        except ValueError as exc:
            raise ValueError(f"[scheduler]/[cluster]: {exc}") from None
        return self

    @model_validator(mode="after")
    def _bundles_fit(self) -> RunConfig:
        n, t = self.launcher.bundles_per_cell, self.train
        if n == 1:
            return self
        if self.launcher.kind != "ray":
            raise ValueError(
                f"launcher.bundles_per_cell = {n} spreads a cell over nodes: it needs kind = 'ray'"
            )
        ranks = t.tensor_parallel * t.pipeline_parallel
        if t.backend != "megatron" or ranks < n:
            raise ValueError(
                f"launcher.bundles_per_cell = {n}: a cell fills its bundles with its Megatron ranks, and it has "
                f"{ranks} (train.backend = {t.backend!r}, tensor_parallel x pipeline_parallel)"
            )
        return self

    @model_validator(mode="after")
    def _gpus_given(self) -> RunConfig:
        gpus = self.launcher.gpus_per_cell
        if self.cluster.device == "cuda" and gpus == 0:
            raise ValueError(
                "cluster.device = 'cuda' needs launcher.gpus_per_cell > 0 (the GPUs each cell runs on)"
            )
        shares = 1 / gpus if 0 < gpus < 1 else 1.0
        if self.launcher.kind == "local" and (gpus != int(gpus) if gpus >= 1 else shares != round(shares)):
            raise ValueError(
                f"launcher.gpus_per_cell = {gpus}: the local launcher hands out whole GPUs, or equal shares of "
                "one (1/2, 1/3, ...)"
            )
        return self

    def policy_params(self) -> PolicyParams:
        """The scheduler policy's parameters: gyre-sched's config plus the cluster's shape and the task budgets."""
        return self.scheduler.params(
            K=self.cluster.cells,
            C_e=self.cluster.executions_per_cell,
            C_s=self.cluster.standalone_capacity,
            harness_timeout_s=self.agent.harness_timeout_s,
            overall_budget_s=self.agent.overall_budget_s,
        )


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the field."""


def load_config(
    path: Path | None, overrides: dict | None = None, sources: dict[str, str] | None = None
) -> RunConfig:
    """Read `path` (TOML/JSON) over the demo preset (the defaults), apply `--set` overrides, validate.

    A partial section overrides the preset field by field: `[scheduler] kind = "async"` keeps the preset's N and
    B, it does not fall back to the scheduler package's own paper-scale defaults. `sources`, when given, receives
    the dotted key of every value the file set (`file`) and of every override (`--set`): gyre.config_view.
    """
    data: dict = RunConfig().model_dump(mode="json")
    if path is not None:
        try:
            text = path.read_text()
            loaded = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be an object of sections, not a {type(loaded).__name__}"
            )
        _merge(data, loaded)
        if sources is not None:
            sources.update(dict.fromkeys(_leaf_keys(loaded), "file"))
    for dotted, value in (overrides or {}).items():
        if sources is not None:
            sources[dotted] = "--set"
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {dotted}: {part} is not a section")
        node[leaf] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        where = f"{path}: " if path else ""
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise ConfigError(f"{where}{problems}") from exc


def check_model_path(cfg: RunConfig) -> None:
    """Refuse a `[model] path` the run cannot load, before any process starts (`gyre run`, `gyre demo`).

    The path must be a local Hugging Face checkpoint folder: the cells load it with `from_pretrained`, and the TITO
    proxy reads its `tokenizer.json` from it, so a hub name (even one in the local cache) fails there. Unset, the
    run builds or copies its builtin model itself. With `[launcher] proxy_resources` on Ray nothing on this machine
    reads the model (the cells and the proxy run on cluster nodes, where the path may be node-local), so it is not
    checked here.
    """
    raw = cfg.model.path
    if raw is None or (cfg.launcher.kind == "ray" and cfg.launcher.proxy_resources is not None):
        return
    path = Path(raw)  # as the pipeline reads it: relative to the working directory
    if not path.is_dir():
        what = "not a folder" if path.exists() else "no such folder"
        raise ConfigError(
            f"model.path {raw!r}: {what}; it must be a local Hugging Face checkpoint folder (config.json, "
            "tokenizer.json, weights), or unset for the builtin model"
        )
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if missing:
        raise ConfigError(
            f"model.path {raw!r}: no {' or '.join(missing)} in this folder; it must be a Hugging Face checkpoint "
            "folder (config.json, tokenizer.json, weights)"
        )


def resolve_transports(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """`[weights] transport` and `snapshot` as the run uses them, and the one line to say when `auto` fell back.

    auto is Mooncake where `import mooncake.engine` works on this machine (the controller's: the local launcher's
    cells run here), else HTTP from the core, which needs no system library. Mooncake asked for by name where it
    cannot load is refused here, in one line naming what to install, before any process starts (the local
    launcher only: Ray's cells run on other machines). Probes in a child interpreter (~0.1 s) only when needed.
    """
    w = cfg.weights
    local = cfg.launcher.kind == "local"
    if "auto" not in (w.transport, w.snapshot) and not (local and "mooncake" in (w.transport, w.snapshot)):
        return cfg, None
    from gyre_cell.transfer.choice import choose, install_hint, mooncake_problem

    problem = mooncake_problem()
    if problem is not None and local and "mooncake" in (w.transport, w.snapshot):
        raise ConfigError(
            f"weights: Mooncake is asked for but cannot load here ({problem}); install it "
            f'({install_hint(problem)}) or set [weights] transport and snapshot to "auto" or "http"'
        )
    choice = choose(problem)
    update = {k: choice.transport for k in ("transport", "snapshot") if getattr(w, k) == "auto"}
    weights = w.model_copy(update=update)
    return cfg.model_copy(update={"weights": weights}), choice.note if update else None


def _leaf_keys(data: dict, prefix: str = "") -> list[str]:
    """Dotted keys of the values in nested tables (a table's own key when it is empty)."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out += _leaf_keys(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
