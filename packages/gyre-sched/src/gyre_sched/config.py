"""Configuration: the policy parameters the core needs, and the simulator's cluster, workload and cost models.

``PolicyParams`` is all the policy core sees (K, C_e, C_s, N, B, phi, mu, ...). ``SimConfig`` is what ``gyre-sched
simulate`` reads (TOML or JSON); ``SimConfig.policy_params()`` derives the core's parameters once, explicitly, from the
cluster shape (cell size regroups the same nodes: C_e and training speed scale with nodes per cell).
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PolicyKind = Literal["elastic", "async", "colocate"]
ExclusionModel = Literal["per_execution", "per_query"]
SpareLaunch = Literal["eager", "idle"]
PlannerKind = Literal["fixed", "adaptive"]
ExclusionKnown = Literal["budget", "stall"]
DispatchMode = Literal["boundary", "continuous"]
LaunchOrder = Literal["dispatch", "predicted"]


class _Cfg(BaseModel):
    # Attribute docstrings are the fields' descriptions (`gyre config --explain`, the reference docs).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyParams:
    """Everything the event-driven policy core needs; derived from SimConfig or built by a real controller."""

    kind: PolicyKind
    K: int
    """Elastic cells (cell 0 is the core)."""
    C_e: int
    """Concurrent executions one cell serves in rollout."""
    C_s: int = 0
    """Concurrent executions of the standalone rollout pool (0 = no pool)."""
    N: int = 16
    """Valid rewards per group."""
    B: int = 32
    """Groups per optimizer step."""
    phi: float = 0.0
    """Extra dispatch in units of B groups."""
    mu: int = 1
    """Steps per burst (between publications)."""
    rho_min: float = 0.5
    """Supply check: fraction of B the ready unassigned groups must cover."""
    tau_s: float = 60.0
    """Supply check: how long it must hold before a transition begins."""
    k_spare: int = 0
    """Oversampling: spare executions per group (N_d = N + k_spare)."""
    streaming: bool = True
    """True: groups join the batch lazily as they become ready; False: a step starts only with all B groups ready."""
    dispatch: DispatchMode = "boundary"
    q_c: int | None = None
    """Continuous dispatch: unfinished groups kept in flight (default (phi + mu) * B)."""
    async_train_cells: int = 1
    """Async only: cells 0..async_train_cells-1 train for the whole run."""
    harness_timeout_s: float = 4 * 3600.0
    overall_budget_s: float = 5 * 3600.0
    spares: SpareLaunch = "eager"
    """eager: spares launch with their group; idle: only on capacity nothing else wants, or at once when an exclusion
    makes one count (still replacing excluded executions in dispatch-index order)."""
    planner: PlannerKind = "fixed"
    """fixed: every burst uses (phi, mu, k_spare); adaptive: ``gyre_sched.planner`` chooses each burst's mu, dispatch
    and spares to hold ``target_staleness`` (boundary dispatch only)."""
    target_staleness: float | None = None
    """adaptive: the realized mean staleness to hold (default: eq. 2 of phi and mu)."""
    mu_max: int | None = None
    """adaptive: the largest mu a burst may use (default floor(2 * target + 1))."""
    launch_order: LaunchOrder = "dispatch"
    """dispatch: queued executions launch in dispatch order (refills first); predicted: those of queries predicted
    to run longest launch first (``gyre_sched.launch_order``: from the durations this policy observed for the same
    query, never from a plan). Which executions count (eq. 2's accounting) never depends on it."""

    def __post_init__(self) -> None:
        errs = []
        if self.K < 1 or self.C_e < 1 or self.C_s < 0:
            errs.append(f"need K >= 1, C_e >= 1, C_s >= 0 (K={self.K}, C_e={self.C_e}, C_s={self.C_s})")
        if self.N < 1 or self.B < 1 or self.mu < 1 or self.k_spare < 0:
            errs.append(
                f"need N >= 1, B >= 1, mu >= 1, k_spare >= 0 (N={self.N}, B={self.B}, mu={self.mu}, "
                f"k_spare={self.k_spare})"
            )
        if self.phi < 0 or abs(self.phi * self.B - round(self.phi * self.B)) > 1e-9:
            errs.append(f"phi * B must be a non-negative whole number (phi={self.phi}, B={self.B})")
        if not 0 < self.rho_min <= 1:
            errs.append(f"rho_min must be in (0, 1] (rho_min={self.rho_min})")
        if self.tau_s < 0:
            errs.append(f"tau_s must be >= 0 (tau_s={self.tau_s})")
        if self.kind == "async" and not 1 <= self.async_train_cells < self.K + (1 if self.C_s > 0 else 0):
            errs.append(
                f"async_train_cells must be in [1, K-1] (or K with a standalone pool, C_s > 0) "
                f"(async_train_cells={self.async_train_cells}, K={self.K}, C_s={self.C_s})"
            )
        if self.kind == "colocate" and self.phi > 0 and self.C_s == 0:
            errs.append(
                f"colocate with phi > 0 needs a standalone pool (C_s > 0) to serve executions while it trains "
                f"(kind=colocate, phi={self.phi}, C_s=0)"
            )
        if self.kind == "colocate" and self.dispatch == "continuous":
            errs.append(
                "colocate waits for its admitted executions to finish: continuous dispatch never lets it "
                "(kind=colocate, dispatch=continuous)"
            )
        if self.kind == "elastic" and self.dispatch == "continuous":
            # Elastic moves a cell to training when the outstanding work fits the cells that stay in rollout (eq. 5),
            # which boundary dispatch lets happen as a burst drains. Continuous dispatch refills every finished
            # group at once, so with more than that in flight the core may never train (the run spins in rollout).
            groups = self.q_c if self.q_c is not None else self.phi_B + self.mu * self.B
            rest = (self.K - 1) * self.C_e + self.C_s
            if groups * self.N_d > rest:
                fix = f"set q_c <= {rest // self.N_d} or " if rest >= self.N_d else ""
                errs.append(
                    f"elastic trains only when the outstanding executions fit the other cells (eq. 5), and continuous "
                    f"dispatch keeps q_c groups of N_d executions outstanding: {groups} * {self.N_d} > (K-1)*C_e + "
                    f"C_s = {rest}, so training might never start; {fix}use dispatch=boundary (kind=elastic, "
                    f"dispatch=continuous, q_c={self.q_c}, N_d={self.N_d}, K={self.K}, C_e={self.C_e}, C_s={self.C_s})"
                )
        if self.dispatch == "continuous" and self.q_c is not None and self.q_c < 1:
            errs.append(f"q_c must be >= 1 (q_c={self.q_c})")
        if self.planner == "adaptive" and self.dispatch != "boundary":
            errs.append(
                "the adaptive planner chooses boundary dispatches (planner=adaptive, dispatch=continuous)"
            )
        if self.target_staleness is not None and self.target_staleness < 0:
            errs.append(f"target_staleness must be >= 0 (target_staleness={self.target_staleness})")
        if self.mu_max is not None and self.mu_max < 1:
            errs.append(f"mu_max must be >= 1 (mu_max={self.mu_max})")
        if not self.harness_timeout_s > 0 or self.overall_budget_s < self.harness_timeout_s:
            errs.append(
                "need 0 < harness_timeout_s <= overall_budget_s (the overall budget covers execution plus "
                f"evaluation) (harness_timeout_s={self.harness_timeout_s}, overall_budget_s={self.overall_budget_s})"
            )
        if errs:
            raise ValueError("; ".join(errs))

    @property
    def N_d(self) -> int:
        return self.N + self.k_spare

    @property
    def phi_B(self) -> int:
        return round(self.phi * self.B)

    @property
    def expected_staleness(self) -> float:
        """Equation 2."""
        return self.phi + (self.mu - 1) / 2

    @property
    def staleness_target(self) -> float:
        """What the adaptive planner holds: target_staleness, else eq. 2."""
        return self.expected_staleness if self.target_staleness is None else self.target_staleness


class PolicyConfig(_Cfg):
    """The algorithm and scheduling knobs: the simulator's TOML table [policy], a real run's [scheduler].

    ``params(K=..., C_e=..., C_s=..., harness_timeout_s=..., overall_budget_s=...)`` builds the core's PolicyParams."""

    kind: PolicyKind = "elastic"
    """The policy: elastic (cells move between rollout and training), async (a fixed split) or colocate."""
    N: int = Field(16, ge=1)
    """Valid rewards per group."""
    B: int = Field(32, ge=1)
    """Groups per optimizer step."""
    phi: float = Field(0.5, ge=0)
    """Extra dispatch, in units of B groups (phi * B must be whole)."""
    mu: int = Field(3, ge=1)
    """Steps per burst."""
    rho_min: float = Field(0.5, gt=0, le=1)
    """Supply check fraction of B."""
    tau_s: float = Field(60.0, ge=0)
    """Supply check hold time in seconds."""
    k_spare: int = Field(0, ge=0)
    """Oversampling spares per group."""
    streaming: bool = True
    """False: a step starts only when all B groups are ready."""
    dispatch: DispatchMode = "boundary"
    """boundary (the paper) or continuous (appendix Q_c)."""
    q_c: int | None = Field(None, ge=1)
    """Continuous dispatch depth in groups (default (phi + mu) * B)."""
    async_train_cells: int = Field(2, ge=1)
    """Async: the fixed number of training cells."""
    spares: SpareLaunch = "eager"
    """eager: spares launch with their group; idle: on spare capacity, or at once when an exclusion needs one."""
    planner: PlannerKind = "fixed"
    """fixed (phi, mu, k_spare every burst) or adaptive (each burst's mu, dispatch and spares chosen to hold
    target_staleness)."""
    target_staleness: float | None = Field(None, ge=0)
    """adaptive: the realized mean staleness to hold (default: eq. 2 of phi, mu)."""
    mu_max: int | None = Field(None, ge=1)
    """adaptive: the largest mu of a burst (default floor(2 * target + 1))."""
    launch_order: LaunchOrder = "dispatch"
    """dispatch (the paper) or predicted: queries that ran longest before launch first (``gyre_sched.launch_order``)."""

    def params(
        self, *, K: int, C_e: int, C_s: int, harness_timeout_s: float, overall_budget_s: float
    ) -> PolicyParams:
        """The policy core's parameters: these knobs plus the cluster's shape and the task budgets, which the
        embedding config owns (the simulator's ``[cluster]``/``[workload]``, a real run's cluster and agent).
        ValueError names the fields of an invalid combination (e.g. colocate with phi > 0 and C_s = 0)."""
        # Derived, not copied: every knob is a PolicyParams field of the same name (test_config checks it).
        knobs = {name: getattr(self, name) for name in type(self).model_fields}
        return PolicyParams(
            **knobs,
            K=K,
            C_e=C_e,
            C_s=C_s,
            harness_timeout_s=harness_timeout_s,
            overall_budget_s=overall_budget_s,
        )


class ClusterConfig(_Cfg):
    """The cluster shape (TOML table [cluster]); cell size regroups the same nodes."""

    nodes: int = Field(32, ge=1)
    """Nodes forming the elastic cells."""
    nodes_per_cell: int = Field(4, ge=1)
    """Cell size; K = nodes // nodes_per_cell."""
    slots_per_node: int = Field(36, ge=1)
    """Concurrent executions one node serves in rollout (C_e = nodes_per_cell * slots_per_node)."""
    standalone_nodes: int = Field(0, ge=0)
    """Rollout-only nodes (C_s = standalone_nodes * slots_per_node unless C_s is given)."""
    C_s: int | None = Field(None, ge=0)
    """Explicit standalone capacity (overrides standalone_nodes)."""

    @model_validator(mode="after")
    def _whole_cells(self) -> ClusterConfig:
        if self.nodes % self.nodes_per_cell:
            raise ValueError(
                f"nodes ({self.nodes}) must be a multiple of nodes_per_cell ({self.nodes_per_cell})"
            )
        return self

    @property
    def K(self) -> int:
        return self.nodes // self.nodes_per_cell

    @property
    def C_e(self) -> int:
        return self.nodes_per_cell * self.slots_per_node

    @property
    def C_s_resolved(self) -> int:
        return self.C_s if self.C_s is not None else self.standalone_nodes * self.slots_per_node


_WORKLOAD_TIMES = (
    "query_median_s",
    "harness_timeout_s",
    "overall_budget_s",
    "failed_at_s",
    "stall_detect_s",
    "eval_latency_s",
    "cancel_latency_s",
    "tool_latency_s",
)
"""WorkloadConfig's durations (what `scaled` multiplies)."""


class WorkloadConfig(_Cfg):
    """Execution durations and outcomes (TOML table [workload]); see README for the model."""

    query_median_s: float = Field(5400.0, gt=0)
    """Median per-query difficulty (median execution duration of a typical query)."""
    query_sigma: float = Field(0.6, ge=0)
    """Lognormal sigma of per-query difficulty across queries."""
    exec_sigma: float = Field(0.35, ge=0)
    """Lognormal sigma of executions within one query (the within-group tail)."""
    hard_query_rate: float = Field(0.0, ge=0, le=1)
    """Share of queries that are much harder (their executions mostly hit the harness timeout together)."""
    hard_query_factor: float = Field(1.0, ge=1)
    """Difficulty multiplier of a hard query."""
    harness_timeout_s: float = Field(4 * 3600.0, gt=0)
    """Common timeout budget: longer executions stop here (clustered terminations), assessed and trained."""
    overall_budget_s: float = Field(5 * 3600.0, gt=0)
    """Overall budget from launch: execution + evaluation retries."""
    failed_rate: float = Field(0.0, ge=0, le=1)
    """Executions that fail completely (no_work placeholder, a valid zero)."""
    failed_at_s: float = Field(300.0, ge=0)
    """When a complete failure terminates (e.g. an image pull error)."""
    overall_timeout_rate: float = Field(0.0, ge=0, le=1)
    """Share of executions that hang (excluded), over all queries."""
    exclusion: ExclusionModel = "per_execution"
    """How hangs spread over queries: ``per_execution`` (each execution hangs independently with
    ``overall_timeout_rate``) or ``per_query`` (only a share ``hang_query_rate`` of queries can hang; their executions
    hang with ``overall_timeout_rate / hang_query_rate`` each, so hangs cluster in few groups)."""
    hang_query_rate: float = Field(1.0, gt=0, le=1)
    """per_query: share of queries whose executions can hang."""
    exclusion_known: ExclusionKnown = "budget"
    """When a hang becomes known: ``budget`` (it runs to the overall budget, then terminates as overall_timeout; the
    paper's setting) or ``stall`` (it stops making model calls at a uniform point of the run it would have had; the
    run's stall watchdog ends it ``stall_detect_s`` later as ``stalled``, excluded without assessment)."""
    stall_detect_s: float = Field(1800.0, gt=0)
    """exclusion_known = stall: seconds without a model call before the watchdog ends an execution."""
    eval_latency_s: float = Field(120.0, ge=0)
    """Mean evaluator latency per attempt (exponential)."""
    eval_failure_rate: float = Field(0.0, ge=0, lt=1)
    """Probability one evaluator attempt fails (retried within the overall budget)."""
    cancel_latency_s: float = Field(0.0, ge=0)
    """Time between a cancel order and the runner's termination report."""
    query_pool: int = Field(0, ge=0)
    """0: every group runs a fresh query (drawn from the fitted model). Q > 0: groups run the queries of a pool of Q
    drawn once from the same model, each epoch of Q groups a fresh permutation; a query keeps its difficulty, hardness
    and hang-proneness across epochs (executions still vary), as a dataset's tasks do over epochs."""
    trace: str | None = None
    """Replay the execution durations/outcomes of a recorded trace.jsonl instead of sampling."""
    tool_latency_s: float = Field(0.0, ge=0)
    """Mean tool time between two model calls (exponential), for the workload harness that plays this workload in a
    real run (`gyre_sched.workload_harness`); the simulator models an execution's duration, not its calls."""
    call_tokens: int = Field(8, ge=1)
    """max_tokens of each model call the workload harness makes: with the calls per execution, what one execution
    gives the trainer (the simulator's training cost is `[cost]`'s, calibrated from a real run)."""

    def scaled(self, factor: float) -> WorkloadConfig:
        """The same workload on a clock `factor` times as fast (every duration times `factor`; shares, sigmas and
        rates unchanged): the paper's hours as seconds, for real runs on a small machine."""
        if not factor > 0:
            raise ValueError(f"a time scale must be > 0, not {factor}")
        return self.model_copy(update={k: getattr(self, k) * factor for k in _WORKLOAD_TIMES})

    @model_validator(mode="after")
    def _hangs(self) -> WorkloadConfig:
        if self.exclusion == "per_query" and self.overall_timeout_rate > self.hang_query_rate:
            raise ValueError(
                f"per_query hangs: overall_timeout_rate ({self.overall_timeout_rate}) cannot exceed "
                f"hang_query_rate ({self.hang_query_rate})"
            )
        return self

    def hang_rate_in_query(self, prone: bool = True) -> float:
        """Probability that one execution of a (hang-prone) query hangs."""
        if self.exclusion == "per_execution":
            return self.overall_timeout_rate
        return self.overall_timeout_rate / self.hang_query_rate if prone else 0.0


@dataclass(frozen=True, slots=True)
class Costs:
    """Every cost in seconds, as the simulator uses it (``CostConfig.resolve``)."""

    train_node_s_per_group: float
    """Node-seconds to train one group."""
    cell_train_s_per_group: float
    """Seconds one cell of ``nodes_per_cell`` nodes trains one group (compute only)."""
    microsteps_per_group: int
    microstep_s: float
    """One cell's micro-step: its compute share plus the fixed per-micro-step overhead."""
    pipeline_startup_s: float
    pipeline_drain_s: float
    optimizer_s: float
    broadcast_s: float
    switch_to_training_s: float
    switch_to_rollout_s: float
    satellite_join_s: float
    publish_s: float
    reroute_penalty_s: float
    warmup_s: float = 0.0
    """One-off per cell, before its first micro-step of the run (model load, first kernels)."""


class CostConfig(_Cfg):
    """Training, switching and publication costs (TOML table [cost]), each a function of the model's size, the tokens
    trained and the hardware; an explicit ``*_s`` value (a measurement, e.g. from ``predict``) overrides its formula.

    - training: an execution trains ``trajectories_per_execution`` selected trajectories, each a row of
      ``trajectory_tokens`` (its whole context: forward and backward run over all of it, only the policy's tokens are
      targets), so a group trains N * J * L tokens. Each token costs 6 * active parameters FLOPs (the matrices) plus
      6 * ``attention_layers`` * ``attention_width`` * L (causal softmax attention over a row of L: 4 * width * t
      FLOPs forward at position t, L / 2 on average, backward twice the forward), at ``node_train_tflops`` per node
      (``gpus_per_node`` * ``gpu_peak_tflops`` * ``mfu`` unless given); a cell of n nodes runs n**train_scaling nodes'
      worth; the group is packed into ceil(tokens / microstep_tokens) micro-steps, each plus
      ``microstep_overhead_s``; 1F1B start-up and drain cost ``pipeline_*_microsteps`` of that cell's micro-step;
    - weight moves (bytes = model_params_b * weight_bytes GB, sharded over the cell's nodes): switches restore or
      reshard them over host links (``host_gbps`` per node) plus a fixed part; a satellite joining pulls the core's
      weights, the broadcast after a non-final step pushes them, the optimizer step reduces gradients of the same size,
      a publication sends them to every rollout engine, all over RDMA (``network_gbps`` per node) plus fixed parts;
    - a rerouted execution re-prefills ``reroute_context_tokens`` of context at its destination (2 * active FLOPs per
      token on one cell)."""

    model_params_b: float = Field(122.0, gt=0)
    """Model parameters, billions: what switches, joins, broadcasts and publications move."""
    active_params_b: float | None = Field(None, gt=0)
    """Parameters active per token (MoE), billions; None: model_params_b (dense)."""
    weight_bytes: float = Field(2.0, gt=0)
    """Bytes per parameter moved (bf16: 2)."""
    trajectories_per_execution: float = Field(1.0, gt=0)
    """J: selected trajectories trained per execution, on average (at most J_max)."""
    trajectory_tokens: float = Field(200_000.0, gt=0)
    """L: tokens of one selected trajectory's row, its whole context (what forward and backward run over)."""
    tokens_per_execution: float | None = Field(None, gt=0)
    """Override: tokens trained per execution; None: J * L."""
    attention_layers: int = Field(0, ge=0)
    """Layers with full causal softmax attention (0: attention's cost left out, fair only for short rows)."""
    attention_width: int = Field(0, ge=0)
    """Query heads x head dimension of those layers."""
    microstep_tokens: float = Field(800_000.0, gt=0)
    """Tokens per micro-step (one claim: a cell's data-parallel ranks' share)."""
    gpus_per_node: int = Field(8, ge=1)
    gpu_peak_tflops: float = Field(989.0, gt=0)
    """Dense bf16 peak of one GPU, TFLOP/s (H100 and H200 SXM: 989)."""
    mfu: float = Field(0.2, gt=0, le=1)
    """Model FLOPs utilization of training: the share of the peak the FLOPs above run at."""
    node_train_tflops: float | None = Field(None, gt=0)
    """Override: effective training TFLOP/s of one node; None: gpus_per_node * gpu_peak_tflops * mfu."""
    train_scaling: float = Field(1.0, gt=0, le=1)
    """A cell of n nodes trains as n**train_scaling nodes."""
    microstep_overhead_s: float = Field(0.0, ge=0)
    """Fixed cost per micro-step (claim, data load, launch)."""
    pipeline_startup_microsteps: float = Field(0.67, ge=0)
    """1F1B start-up per cell per batch, in that cell's micro-steps ((p-1)/p of one for p stages, roughly)."""
    pipeline_drain_microsteps: float = Field(0.67, ge=0)
    """1F1B drain per cell per batch, in that cell's micro-steps."""
    optimizer_fixed_s: float = Field(20.0, ge=0)
    """Optimizer update on the core, besides the gradient reduction."""
    host_gbps: float = Field(25.0, gt=0)
    """Host <-> GPU weight bandwidth per node, GB/s (switches)."""
    network_gbps: float = Field(25.0, gt=0)
    """Effective RDMA bandwidth per node, GB/s (join, broadcast, gradient reduction, publication)."""
    switch_to_training_fixed_s: float = Field(6.08, ge=0)
    """Rollout -> training besides moving weights (pause, flush, release KV); 8.52 s in all at 122B on 4 nodes."""
    switch_to_rollout_fixed_s: float = Field(1.02, ge=0)
    """Training -> rollout besides moving weights; 3.46 s in all at 122B on 4 nodes (paper)."""
    publish_fixed_s: float = Field(10.0, ge=0)
    """Publication besides moving weights (engines pause, load, resume)."""
    reroute_context_tokens: float = Field(100_000.0, ge=0)
    """Context a rerouted execution re-prefills at its destination."""
    warmup_s: float = Field(0.0, ge=0)
    """One-off per cell before its first micro-step of the run (loading, first kernels): seconds on the CPU runs."""

    train_node_s_per_group: float | None = Field(None, gt=0)
    """Override: node-seconds to train one group."""
    microsteps_per_group: int | None = Field(None, ge=1)
    """Override: micro-steps per group."""
    pipeline_startup_s: float | None = Field(None, ge=0)
    pipeline_drain_s: float | None = Field(None, ge=0)
    optimizer_s: float | None = Field(None, ge=0)
    broadcast_s: float | None = Field(None, ge=0)
    switch_to_training_s: float | None = Field(None, ge=0)
    switch_to_rollout_s: float | None = Field(None, ge=0)
    satellite_join_s: float | None = Field(None, ge=0)
    """Override: a satellite pulling the core's weights (added to its switch)."""
    publish_s: float | None = Field(None, ge=0)
    reroute_penalty_s: float | None = Field(None, ge=0)
    """Override: delay added to a rerouted execution."""

    @property
    def weights_gb(self) -> float:
        return self.model_params_b * self.weight_bytes

    @property
    def execution_tokens(self) -> float:
        """Tokens trained per execution: J * L unless given."""
        return self.tokens_per_execution or self.trajectories_per_execution * self.trajectory_tokens

    @property
    def train_flops_per_token(self) -> tuple[float, float]:
        """(matrices, attention) FLOPs of training one token, forward and backward."""
        active = self.active_params_b or self.model_params_b
        attention = 6 * self.attention_layers * self.attention_width * self.trajectory_tokens
        return 6 * active * 1e9, float(attention)

    @property
    def node_tflops(self) -> float:
        return self.node_train_tflops or self.gpus_per_node * self.gpu_peak_tflops * self.mfu

    def basis(self, *, nodes_per_cell: int, N: int) -> dict[str, float | str]:
        """The training cost's basis and what it comes to, for a run's output."""
        matrices, attention = self.train_flops_per_token
        c = self.resolve(nodes_per_cell=nodes_per_cell, N=N)
        return {
            "model": "dense" if self.active_params_b in (None, self.model_params_b) else "moe",
            "active_params_b": self.active_params_b or self.model_params_b,
            "tokens_per_execution": self.execution_tokens,
            "train_tflop_per_token": (matrices + attention) / 1e12,
            "attention_share": attention / (matrices + attention),
            "node_train_tflops": self.node_tflops,
            "train_node_s_per_group": c.train_node_s_per_group,
            "cell_train_s_per_group": c.cell_train_s_per_group,
        }

    def resolve(self, *, nodes_per_cell: int, N: int) -> Costs:
        """Every cost in seconds for cells of ``nodes_per_cell`` nodes and groups of N trained executions."""
        active = self.active_params_b or self.model_params_b
        tokens = N * self.execution_tokens
        node_s = self.train_node_s_per_group
        if node_s is None:
            node_s = sum(self.train_flops_per_token) * tokens / (self.node_tflops * 1e12)
        ms = self.microsteps_per_group or max(1, math.ceil(tokens / self.microstep_tokens - 1e-9))
        cell_s = node_s / nodes_per_cell**self.train_scaling
        compute_ms = cell_s / ms
        per_node_gb = self.weights_gb / nodes_per_cell
        net = per_node_gb / self.network_gbps
        host = per_node_gb / self.host_gbps
        prefill = (
            2
            * active
            * 1e9
            * self.reroute_context_tokens
            / (nodes_per_cell**self.train_scaling * self.node_tflops * 1e12)
        )

        def pick(override: float | None, derived: float) -> float:
            return derived if override is None else override

        return Costs(
            train_node_s_per_group=node_s,
            cell_train_s_per_group=cell_s,
            microsteps_per_group=ms,
            microstep_s=compute_ms + self.microstep_overhead_s,
            pipeline_startup_s=pick(self.pipeline_startup_s, self.pipeline_startup_microsteps * compute_ms),
            pipeline_drain_s=pick(self.pipeline_drain_s, self.pipeline_drain_microsteps * compute_ms),
            optimizer_s=pick(self.optimizer_s, self.optimizer_fixed_s + net),
            broadcast_s=pick(self.broadcast_s, net),
            switch_to_training_s=pick(self.switch_to_training_s, self.switch_to_training_fixed_s + host),
            switch_to_rollout_s=pick(self.switch_to_rollout_s, self.switch_to_rollout_fixed_s + host),
            satellite_join_s=pick(self.satellite_join_s, net),
            publish_s=pick(self.publish_s, self.publish_fixed_s + net),
            reroute_penalty_s=pick(self.reroute_penalty_s, prefill),
            warmup_s=self.warmup_s,
        )


class SimConfig(_Cfg):
    """A simulator run: `gyre-sched simulate CONFIG`."""

    name: str = "sim"
    seed: int = 0
    steps: int = Field(48, ge=1)
    """Optimizer steps to simulate."""
    warmup_bursts: int = Field(1, ge=0)
    """Bursts excluded from the steady-state staleness mean."""
    policy: PolicyConfig = PolicyConfig()
    cluster: ClusterConfig = ClusterConfig()
    workload: WorkloadConfig = WorkloadConfig()
    cost: CostConfig = CostConfig()

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if self.workload.overall_budget_s < self.workload.harness_timeout_s:
            raise ValueError("workload.overall_budget_s must be >= workload.harness_timeout_s")
        self.policy_params()  # raises ValueError with every problem named
        return self

    def policy_params(self) -> PolicyParams:
        c, w = self.cluster, self.workload
        return self.policy.params(
            K=c.K,
            C_e=c.C_e,
            C_s=c.C_s_resolved,
            harness_timeout_s=w.harness_timeout_s,
            overall_budget_s=w.overall_budget_s,
        )

    def costs(self) -> Costs:
        """Every cost in seconds at this cell size and group size."""
        return self.cost.resolve(nodes_per_cell=self.cluster.nodes_per_cell, N=self.policy.N)

    def cell_train_s_per_group(self) -> float:
        """Seconds one cell needs per group at this cell size."""
        return self.costs().cell_train_s_per_group


def load_config_dict(path: str | Path) -> dict:
    """Read a TOML or JSON config file into a dict (ValueError naming the problem on bad input)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror}") from e
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(
            f"config {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}"
        ) from e
