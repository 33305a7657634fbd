"""gyre-tito in SkyRL and verl (issue 40), against their real packages: SkyRL 0.4's `GeneratorInterface` and verl
0.9's `AgentLoopBase`. A tool-using agent (tests/tito_stack_harness.py: the model asks for a tool, gets its result,
answers) runs through gyre-tito's adapters, and what each stack trains is the executions' selected trajectories
exactly as the proxy recorded them: each token the recorded one, each policy token's log-prob the recorded behaviour
log-prob, the loss/response mask 0 exactly on the tool result between the two calls. The expected rows are rebuilt
here from the record logs alone.

- SkyRL: the output passes SkyRL's own `validate_generator_output` and becomes its training tensors
  (`convert_prompts_responses_to_batch_tensors`). Without step-wise training each prompt gives one row; step-wise with
  J_max=2 an execution whose agent compacted its context (a second branch of its tree) gives two adjacent rows with
  `is_last_step` on the second, which carries the reward.
- verl: the loop, registered by a YAML entry and by `@register` on a subclass, is instantiated, run and padded by
  verl's own `AgentLoopWorker._run_agent_loop`, and batched by its `_postprocess` (what the trainer gets).

SkyRL pins transformers<=5.16.1 and verl's wheel lacks three of its imports, so each runs in a uv environment of its
own (tests/stack_venv.py: built once, then kept) where tests/tito_{skyrl,verl}_child.py run. The proxy and
gyre-tito's scripted engine (deterministic replies with known log-probs, a real HTTP server) run here, on
loopback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_tito.proxy import ProxyConfig
from gyre_tito.records import log_path, read_log
from gyre_tito.scripted_engine import ScriptedEngine, ScriptedEngineConfig
from gyre_tito.testing import ProxyServer
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer

TESTS = Path(__file__).resolve().parent
SKYRL = [
    "skyrl==0.4.0",
    "skyrl-gym==0.4.0",
    # what skyrl.train.utils.trainer_utils imports beyond skyrl's own requirements (its `skyrl-train` extra
    # brings them with flash-attn, an sdist that needs CUDA to build); ray at that extra's pin
    "ray==2.57.0",
    "loguru",
    "torchdata",
    "omegaconf",
    "jaxtyping",
    "aiohttp",
    "orjson",
    "pybase64",
]
VERL = [
    "verl==0.9.1",
    "cachetools",
    "uvicorn",
    "fastapi",
]  # verl imports the last three and does not require them


def reply(prompt: str, last: str) -> str:
    n = int(re.findall(r"square of (\d+)", prompt)[-1])
    if "Summary:" in last:
        return f"Again: {n * n}."
    if "<tool_response>" in last:
        return f"The square of {n} is {n * n}."
    return f'<tool_call>\n{{"name": "square", "arguments": {{"n": {n}}}}}\n</tool_call>'


def run_child(stack: str, requirements: list[str], child: str, args: list[str], tmp_path: Path):
    """Run tests/`child` in `stack`'s environment against a live proxy; its JSON output, each execution's exported
    trajectories (J_max=2) and record log, the tokenizer's decode."""
    python = subprocess.run(
        [sys.executable, str(TESTS / "stack_venv.py"), stack, *requirements], capture_output=True, text=True
    )
    assert python.returncode == 0, python.stderr[-3000:]
    tok = build_tiny_tokenizer(tmp_path / "tok")
    engine = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok)), reply_fn=reply)
    store = tmp_path / "store"
    config = ProxyConfig(engines=[engine.start()], tokenizer=str(tok), store=str(store), admin_token="adm")
    out = tmp_path / "out.json"
    try:
        with ProxyServer(config) as proxy:
            argv = [python.stdout.strip(), str(TESTS / child), proxy.url, "adm", *args, str(out)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
            assert done.returncode == 0, done.stderr[-5000:]
            assert not proxy.proxy.executions  # every execution the adapter opened, it ended
            exported = {
                eid: proxy.admin("POST", f"/admin/executions/{eid}/export", {"j_max": 2}).json()[
                    "trajectories"
                ]
                for eid in proxy.proxy.ended
            }
    finally:
        engine.stop()
    logs = {eid: read_log(log_path(store / "records", eid)).records for eid in exported}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok / "tokenizer.json"))
    return (
        json.loads(out.read_text()),
        exported,
        logs,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )


def expected_rows(calls, trajectories, decode):
    """What each admitted trajectory must be, from the recorded calls alone: (prompt, response, mask, logprobs),
    split before the first target. A trajectory's tokens are its root path's inputs and outputs; its targets are its
    calls' outputs that no earlier trajectory of the execution took. The main line (tool call, tool result, answer) is
    checked to hold exactly that: mask 0 on the second call's input, which is the tool result."""
    targeted: set[str] = set()
    rows = []
    for trajectory in trajectories:
        by_id = {c.call_id: c for c in calls}
        path = [by_id[trajectory["leaf_call_id"]]]
        while path[-1].parent_id is not None:
            path.append(by_id[path[-1].parent_id])
        path.reverse()
        tokens, mask, logprobs = [], [], []
        for c in path:
            new = c.call_id not in targeted
            tokens += c.input_ids + c.output_ids
            mask += [0] * len(c.input_ids) + [int(new)] * len(c.output_ids)
            logprobs += [0.0] * len(c.input_ids) + (c.output_logprobs if new else [0.0] * len(c.output_ids))
        targeted |= {c.call_id for c in path}
        k = mask.index(1)
        if len(path) == 2:
            first, second = path
            assert mask[k:] == [1] * len(first.output_ids) + [0] * len(second.input_ids) + [1] * len(
                second.output_ids
            )
            n = int(re.findall(r"square of (\d+)", decode(tokens[:k]))[-1])
            assert f"<tool_response>\n{n * n}\n</tool_response>" in decode(second.input_ids)
            assert decode(second.output_ids).startswith(f"The square of {n} is {n * n}.")
        else:
            assert len(path) == 1 and decode(path[0].output_ids).startswith("Again:")
        rows.append((tokens[:k], tokens[k:], mask[k:], logprobs[k:]))
    assert targeted == {c.call_id for c in calls}  # every recorded call trained once
    return rows


def test_the_skyrl_and_verl_adapters_import_nothing_of_their_stacks():
    """gyre-tito installs alone: its adapter modules import no SkyRL, verl or torch, and their stack classes are built
    when first looked up (here, where neither stack is installed, that look-up names what is missing)."""
    code = (
        "import sys, gyre_tito.integrations.skyrl as s, gyre_tito.integrations.verl as v\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'skyrl', 'verl', 'torch', 'ray'}))\n"
        "for get in (lambda: s.TitoGenerator, lambda: v.TitoAgentLoop):\n"
        "    try:\n        get()\n    except ModuleNotFoundError as e:\n        print(e.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["[]", "skyrl", "verl"]


@pytest.mark.slow
def test_skyrl_trains_exactly_the_recorded_tokens_and_behaviour_logprobs(tmp_path):
    results, exported, logs, decode = run_child("skyrl", SKYRL, "tito_skyrl_child.py", [], tmp_path)
    for mode, rows_per_execution in (("flat", 1), ("step_wise", 2)):
        res = results[mode]
        gen, executions = res["output"], res["executions"]
        assert len(executions) == len(set(executions)) == 4  # one execution per prompt, in input order
        assert len(gen["response_ids"]) == 4 * rows_per_execution
        # the harness answered right every time; step-wise, the reward is on each execution's last row only
        assert gen["rewards"] == ([1.0] * 4 if mode == "flat" else [0.0, 1.0] * 4)
        if mode == "flat":
            assert gen["trajectory_ids"] is None and gen["is_last_step"] is None
        else:
            assert gen["is_last_step"] == [False, True] * 4
            assert gen["trajectory_ids"] == [t for t in ("a_0", "a_1", "b_0", "b_1") for _ in range(2)]
        row = 0
        for eid in executions:
            assert len(logs[eid]) == (2 if mode == "flat" else 3)
            for prompt, response, mask, logprobs in expected_rows(logs[eid], exported[eid], decode):
                assert gen["prompt_token_ids"][row] == prompt
                assert gen["response_ids"][row] == response
                assert gen["loss_masks"][row] == mask
                assert gen["rollout_logprobs"][row] == logprobs
                # SkyRL's training tensors: right-aligned, so the row's values are the last len(response) ones
                width = len(response)
                t = {k: v[row][len(v[row]) - width :] for k, v in res["tensors"].items()}
                assert t["loss_masks"] == mask
                assert t["logprobs"] == pytest.approx(logprobs, abs=1e-6)
                assert t["response_mask"] == [1] * width
                assert t["rewards"] == [0.0] * (width - 1) + [gen["rewards"][row]]
                row += 1


@pytest.mark.slow
def test_verl_trains_exactly_the_recorded_tokens_and_behaviour_logprobs(tmp_path):
    tok_args = [str(tmp_path / "tok"), str(tmp_path)]
    batch, exported, logs, decode = run_child("verl", VERL, "tito_verl_child.py", tok_args, tmp_path)
    assert len(batch["execution_id"]) == len(set(batch["execution_id"])) == len(logs) == 4
    prompt_width = len(batch["prompts"][0])
    for i, eid in enumerate(batch["execution_id"]):
        assert len(logs[eid]) == 2
        [(prompt, response, mask, logprobs)] = expected_rows(logs[eid], exported[eid][:1], decode)
        # verl's padding: prompts left-padded, responses right-padded, the attention mask 1 on the real tokens
        attention = batch["attention_mask"][i]
        assert attention == [0] * (prompt_width - len(prompt)) + [1] * (len(prompt) + len(response)) + [0] * (
            len(batch["responses"][i]) - len(response)
        )
        real = [t for t, a in zip(batch["input_ids"][i], attention, strict=True) if a]
        assert real == prompt + response
        n = len(response)
        assert batch["response_mask"][i][:n] == mask and not any(batch["response_mask"][i][n:])
        assert batch["rollout_log_probs"][i][:n] == pytest.approx(logprobs, abs=1e-6)
        assert batch["rm_scores"][i] == [0.0] * (n - 1) + [1.0] + [0.0] * (len(batch["responses"][i]) - n)
        assert batch["num_turns"][i] == 4  # user, assistant (tool call), tool, assistant
        assert batch["role_class"][i] == "main/task"
