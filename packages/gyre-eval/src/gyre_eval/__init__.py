"""gyre_eval: assessments and rewards for agent RL. A missing score is never a zero.

Public API: the wire types (``gyre_eval.types``), the evaluator interface (``Evaluator``, ``EvaluationRequest``,
``Verdict``, ``EvaluatorError``), the built-in evaluators (``ExecutableCheck``, ``Judge``), the contract check
(``gyre_eval.contract.check_evaluator``), the store and service (``AssessmentStore``, ``AssessmentService``,
``gyre_eval.server.create_app``), the async client (``EvalClient``) and group accounting (``group_status``, ``group_advantages``).
Imports are light: no torch, ever.
"""

from gyre_eval.client import EvalClient
from gyre_eval.config import PluginConfig, ServiceConfig, build_evaluator, load_config
from gyre_eval.errors import ConflictError, EvalServiceError, EvaluatorError, SandboxError
from gyre_eval.evaluator import EvaluationRequest, Evaluator, Verdict
from gyre_eval.exec_check import ExecCheckConfig, ExecutableCheck
from gyre_eval.groups import group_advantages, group_status
from gyre_eval.judge import Judge, JudgeConfig
from gyre_eval.sandbox import Sandbox, SandboxConfig
from gyre_eval.service import AssessmentService
from gyre_eval.store import AssessmentStore
from gyre_eval.types import Assessment, AttemptRecord, ExecutionReport, GroupStatus, Provenance, Submission

__all__ = [
    "Assessment",
    "AssessmentService",
    "AssessmentStore",
    "AttemptRecord",
    "ConflictError",
    "EvalClient",
    "EvalServiceError",
    "EvaluationRequest",
    "Evaluator",
    "EvaluatorError",
    "ExecCheckConfig",
    "ExecutableCheck",
    "ExecutionReport",
    "GroupStatus",
    "Judge",
    "JudgeConfig",
    "PluginConfig",
    "Provenance",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "ServiceConfig",
    "Submission",
    "Verdict",
    "build_evaluator",
    "group_advantages",
    "group_status",
    "load_config",
]
