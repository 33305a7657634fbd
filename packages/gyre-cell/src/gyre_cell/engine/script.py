"""A scripted model inside the real engine: the replies come from a script, the log-probs from the model.

For runs whose harness needs replies a small policy cannot give yet (Claude Code delegating to a sub-agent, then
compacting), `EngineConfig.scripted_replies` names a script in `gyre_tito.scripted_engine`'s rule format (a JSON
object: `rules`, a list of `ScriptRule`, and `default_reply`). For each request the engine matches the rules against
the decoded prompt, as the scripted test engine does, and then *forces* the reply's tokens (the Qwen3 chat format,
ended by `<|im_end|>`) instead of sampling: every forced token goes through the model's forward pass and gets the
model's own log-prob under the request's temperature. So the recorded behaviour log-probs are the policy's, the
trainer recomputes them exactly at staleness 0, and weights, role switches and KV migration work as with sampled
tokens. Only which tokens are produced is scripted. A continued request (its input ends with part of the reply after
an abort or a reroute) is forced the rest of the reply; `max_new_tokens` still cuts a reply short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gyre_tito.scripted_engine import ScriptRule, match_reply

__all__ = ["ReplyScript", "ScriptFile"]


class ScriptFile(BaseModel):
    """The script file: rules tried in order, and the reply when none matches."""

    model_config = ConfigDict(extra="forbid")
    rules: list[ScriptRule] = Field(default_factory=list)
    default_reply: str = "OK."
    hold: list[str] = Field(default_factory=list)
    """A request whose prompt contains any of these is never answered (until it is aborted): a model call the
    engines never answer, for runs that must show such a stall ends at the harness's timeout and hangs nothing."""


class ReplyScript:
    """A script bound to the engine's tokenizer: `forced(input_ids)` gives the tokens the engine must produce."""

    def __init__(self, path: str | Path, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError("scripted replies need the model's tokenizer (its checkpoint has none)")
        self.script = ScriptFile.model_validate_json(Path(path).read_text())
        self.tokenizer = tokenizer
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if not isinstance(self.end, int) or self.end < 0:
            raise ValueError("scripted replies need a Qwen-style chat tokenizer with <|im_end|>")
        self.header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def forced(self, input_ids: list[int]) -> list[int] | None:
        """The reply's tokens still to produce: all of them, or those after the part `input_ids` already ends
        with (a continued partial output); None for a request the script holds."""
        n = len(self.header)
        start = next(
            (i + n for i in range(len(input_ids) - n, -1, -1) if input_ids[i : i + n] == self.header), -1
        )
        partial = input_ids[start:] if start >= 0 else []
        prompt = self.tokenizer.decode(
            input_ids[: start if start >= 0 else len(input_ids)], skip_special_tokens=False
        )
        if any(marker in prompt for marker in self.script.hold):
            return None
        text = match_reply(self.script.rules, self.script.default_reply, prompt)
        reply = [*self.tokenizer.encode(text, add_special_tokens=False), self.end]
        if partial and reply[: len(partial)] == partial:
            return reply[len(partial) :]
        return reply
