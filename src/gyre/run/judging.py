"""Judge scoring in `gyre run`: tasks whose scoring rule is a rubric are scored by gyre-eval's judge through a model.

The judge is `[judge]` of the run config. By default it is the run's own TITO proxy: the judge is registered there as
one more execution (`JUDGE_EXECUTION`) with its own credential and no route of its own, so its calls go to the
engines serving rollouts and are recorded under that id. The controller exports and trains only the executions it
launched, so the judge's calls are kept (auditable, like the critique in each assessment) and never trained on.
`[judge] base_url` points at any other OpenAI-compatible endpoint instead, with its key from `api_key_env`.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gyre.config import JudgeSection
from gyre_eval.judge import JudgeConfig

__all__ = ["JUDGE_EXECUTION", "judge_endpoint", "judge_evaluator"]

JUDGE_EXECUTION = "judge"
"""The judge's execution id at the run's proxy (also its group id): never dispatched, exported or trained."""

AdminCall = Callable[[str, str, dict | None], Awaitable[dict]]


async def judge_endpoint(
    cfg: JudgeSection, proxy_url: str, admin_call: AdminCall, private_dir: Path
) -> dict[str, Any]:
    """The judge's endpoint, model and credential: `cfg.base_url`, or the run's proxy with its own execution
    (its credential in a 0600 file under `private_dir`, never in a config that is written out)."""
    common = {
        "model": cfg.model,
        "temperature": cfg.temperature,
        "max_tokens": cfg.max_tokens,
        "max_artifact_chars": cfg.max_artifact_chars,
    }
    if cfg.base_url is not None:
        return common | {"base_url": cfg.base_url, "api_key_env": cfg.api_key_env}
    body = {"execution_id": JUDGE_EXECUTION, "group_id": JUDGE_EXECUTION, "metadata": {"role": "judge"}}
    registered = await admin_call("POST", "/executions", body)
    private_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_file = private_dir / "judge.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(registered["credential"])
    return common | {"base_url": f"{proxy_url.rstrip('/')}/v1", "api_key_file": str(key_file)}


def judge_evaluator(query_id: str, spec: dict[str, Any], endpoint: dict[str, Any] | None) -> JudgeConfig:
    """gyre-eval's judge for one task's rubric (`spec` = the task's evaluator config)."""
    if endpoint is None:
        raise ValueError(f"task {query_id}: judge scoring needs the run's [judge] endpoint")
    return JudgeConfig.model_validate(endpoint | {"rubric": spec["rubric"]})
