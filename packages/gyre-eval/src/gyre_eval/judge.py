"""Built-in evaluator: a judge model behind an OpenAI-compatible chat completions endpoint scores against a rubric.

The judge has its own endpoint and key. It never calls the policy with an execution's credential: its tokens would be
recorded as policy tokens by the proxy. Its critique is kept in the assessment's provenance (context, never a target).
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any, Literal

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from gyre_eval.errors import EvaluatorError
from gyre_eval.evaluator import EvaluationRequest, Verdict

_SYSTEM = (
    "You are a strict evaluator. Score the artifact against the rubric. Reply with only a JSON object: "
    '{"score": <number from 0 to 1>, "critique": "<short justification>"}.'
)
_SKIP_DIRS = {".git", "__pycache__", "node_modules", ".venv"}


class JudgeConfig(BaseModel):
    """A rubric judge on an OpenAI-compatible endpoint, with its own credential."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["judge"] = "judge"
    base_url: str = Field(min_length=1)
    """Endpoint root, e.g. http://host:port/v1 (``/chat/completions`` is appended)."""
    model: str = Field(min_length=1)
    rubric: str = Field(min_length=1)
    api_key: SecretStr | None = None
    """The judge's own key (never an execution's credential)."""
    api_key_env: str | None = None
    """Read the key from this environment variable instead of the config file."""
    api_key_file: str | None = None
    """Read the key from this file instead (a private file: the config itself may be written out with the key
    masked, e.g. when a run hands the service its config as a file)."""
    temperature: float = 0.0
    max_tokens: int = Field(default=1024, ge=1)
    timeout_s: float = Field(default=120.0, gt=0)
    max_artifact_chars: int = Field(default=60_000, ge=100)
    """Text of the workspace shown to the judge; larger artifacts are truncated (noted in the prompt)."""


class Judge:
    kind = "judge"

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        key = config.api_key.get_secret_value() if config.api_key else None
        if config.api_key_env:
            key = os.environ.get(config.api_key_env) or key
        if config.api_key_file:
            key = Path(config.api_key_file).read_text().strip() or key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.AsyncClient(base_url=config.base_url.rstrip("/"), headers=headers)

    def describe(self) -> dict[str, Any]:
        return {
            "endpoint": self.config.base_url,
            "model": self.config.model,
            "rubric": self.config.rubric,
            "temperature": self.config.temperature,
        }

    async def aclose(self) -> None:
        await self._client.aclose()

    async def evaluate(self, request: EvaluationRequest) -> Verdict:
        if not request.workspace.is_dir():
            raise EvaluatorError(f"workspace {request.workspace} is not a directory")
        timeout = min(self.config.timeout_s, request.deadline - time.time())
        if timeout <= 0:
            raise EvaluatorError("no time left before the deadline")
        body = {
            "model": self.config.model,
            "messages": [
                {"role": "system", "content": _SYSTEM},
                {"role": "user", "content": self._prompt(request)},
            ],
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
        }
        try:
            response = await self._client.post("/chat/completions", json=body, timeout=timeout)
        except httpx.HTTPError as e:
            raise EvaluatorError(f"judge request failed: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise EvaluatorError(f"judge answered HTTP {response.status_code}: {response.text[:300]}")
        try:
            payload = response.json()
            content = payload["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise EvaluatorError(f"judge response is not a chat completion: {response.text[:300]}") from e
        score, critique = parse_judgement(content)
        details = {
            "response_id": payload.get("id"),
            "judge_model": payload.get("model", self.config.model),
            "usage": payload.get("usage"),
        }
        return Verdict(score=score, critique=critique, details=details)

    def _prompt(self, request: EvaluationRequest) -> str:
        task = request.task.get("prompt") or request.task.get("description") or "(no task text given)"
        artifact = render_workspace(request.workspace, self.config.max_artifact_chars)
        return f"# Task\n{task}\n\n# Rubric\n{self.config.rubric}\n\n# Artifact\n{artifact}"


def render_workspace(root: Path, budget: int) -> str:
    """Text files of the workspace in path order, each under a header; binary files are listed, not shown.

    Symlinks are never followed, so an artifact cannot show the judge files from outside the workspace."""
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath) / f for f in filenames)
    parts: list[str] = []
    used = 0
    for path in sorted(files):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            block = f"## {rel} (binary, {len(data)} bytes)\n"
        else:
            block = f"## {rel}\n{data.decode(errors='replace')}\n"
        if used + len(block) > budget:
            parts.append(f"(artifact truncated at {budget} characters)")
            break
        parts.append(block)
        used += len(block)
    return "\n".join(parts) if parts else "(empty workspace)"


def parse_judgement(content: str) -> tuple[float, str | None]:
    """Extract ``{"score": x, "critique": ...}`` from the judge's reply (code fences and prose around it allowed)."""
    match = re.search(r"\{.*\}", content or "", re.DOTALL)
    if not match:
        raise EvaluatorError(f"judge reply holds no JSON object: {content[:200]!r}")
    try:
        obj = orjson.loads(match.group(0))
    except orjson.JSONDecodeError as e:
        raise EvaluatorError(f"judge reply is not valid JSON: {match.group(0)[:200]!r}") from e
    score = obj.get("score") if isinstance(obj, dict) else None
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise EvaluatorError(f"judge reply has no numeric score: {match.group(0)[:200]!r}")
    if not 0.0 <= score <= 1.0:
        raise EvaluatorError(f"judge score {score} is outside [0, 1]")
    critique = obj.get("critique")
    return float(score), (str(critique) if critique is not None else None)
