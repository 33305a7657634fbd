"""gyre-tito as SkyRL's generator (issue 40), against SkyRL 0.4's real package: `TitoGenerator` subclasses SkyRL's
`GeneratorInterface`, and what it returns for a tool-using harness (model calls the tool, gets its result, answers)
passes SkyRL's own `validate_generator_output` and becomes SkyRL's training tensors
(`convert_prompts_responses_to_batch_tensors`). Every row is an execution's selected trajectory exactly as the proxy
recorded it: each response token the recorded one, each policy token's log-prob the recorded behaviour log-prob,
loss mask 0 exactly on the tool result between the two calls. Without step-wise training each prompt gives one row;
step-wise with J_max=2 an execution whose agent compacted its context (a second branch) gives two adjacent rows with
`is_last_step` on the second, which carries the reward.

SkyRL pins transformers<=5.16.1, which the workspace cannot share, so it runs in an environment of its own
(tests/stack_venv.py: uv, kept between runs) and tests/tito_skyrl_child.py runs there. The proxy and gyre-tito's
scripted engine (deterministic replies with known log-probs, a real HTTP server) run here, on loopback."""

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
    "skyrl==0.4.0", "skyrl-gym==0.4.0",
    # what skyrl.train.utils.trainer_utils imports beyond skyrl's own requirements (its `skyrl-train` extra
    # brings them with flash-attn, an sdist that needs CUDA to build); ray at that extra's pin
    "ray==2.57.0", "loguru", "torchdata", "omegaconf", "jaxtyping", "aiohttp", "orjson", "pybase64",
]  # fmt: skip


def reply(prompt: str, last: str) -> str:
    n = int(re.findall(r"square of (\d+)", prompt)[-1])
    if "Summary:" in last:
        return f"Again: {n * n}."
    if "<tool_response>" in last:
        return f"The square of {n} is {n * n}."
    return f'<tool_call>\n{{"name": "square", "arguments": {{"n": {n}}}}}\n</tool_call>'


def path_calls(calls, leaf_id):
    by_id = {c.call_id: c for c in calls}
    path = [by_id[leaf_id]]
    while path[-1].parent_id is not None:
        path.append(by_id[path[-1].parent_id])
    return path[::-1]


def test_the_skyrl_and_verl_adapters_import_nothing_of_their_stacks():
    """gyre-tito installs alone: its adapter modules import no SkyRL, verl or torch, and their stack classes are built
    when first looked up (here, where SkyRL is not installed, that look-up names what is missing)."""
    code = (
        "import sys, gyre_tito.integrations.skyrl as s\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'skyrl', 'verl', 'torch', 'ray'}))\n"
        "try:\n    s.TitoGenerator\nexcept ModuleNotFoundError as e:\n    print(e.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "skyrl"]


@pytest.mark.slow
def test_skyrl_trains_exactly_the_recorded_tokens_and_behaviour_logprobs(tmp_path):
    python = subprocess.run(
        [sys.executable, str(TESTS / "stack_venv.py"), "skyrl", *SKYRL], capture_output=True, text=True
    )
    assert python.returncode == 0, python.stderr[-3000:]
    tok = build_tiny_tokenizer(tmp_path / "tok")
    engine = ScriptedEngine(ScriptedEngineConfig(tokenizer=str(tok)), reply_fn=reply)
    store = tmp_path / "store"
    config = ProxyConfig(engines=[engine.start()], tokenizer=str(tok), store=str(store), admin_token="adm")
    try:
        with ProxyServer(config) as proxy:
            out = tmp_path / "out.json"
            child = subprocess.run(
                [python.stdout.strip(), str(TESTS / "tito_skyrl_child.py"), proxy.url, "adm", str(out)],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert child.returncode == 0, child.stderr[-5000:]
            trajectories = {
                eid: proxy.admin("POST", f"/admin/executions/{eid}/export", {"j_max": 2}).json()[
                    "trajectories"
                ]
                for mode in json.loads(out.read_text()).values()
                for eid in mode["executions"]
            }
    finally:
        engine.stop()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok / "tokenizer.json"))

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=False)

    results = json.loads(out.read_text())

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
            calls = read_log(log_path(store / "records", eid)).records
            assert len(calls) == (2 if mode == "flat" else 3)
            targeted: set[str] = set()
            for trajectory in trajectories[eid][:rows_per_execution]:
                # the row, from the recorded calls alone: the path's context and outputs, its outputs the targets
                path = path_calls(calls, trajectory["leaf_call_id"])
                tokens, mask, logprobs = [], [], []
                for c in path:
                    new = c.call_id not in targeted
                    tokens += c.input_ids + c.output_ids
                    mask += [0] * len(c.input_ids) + [int(new)] * len(c.output_ids)
                    logprobs += [0.0] * len(c.input_ids) + (
                        c.output_logprobs if new else [0.0] * len(c.output_ids)
                    )
                targeted |= {c.call_id for c in path}
                k = mask.index(1)
                assert gen["prompt_token_ids"][row] == tokens[:k]
                assert gen["response_ids"][row] == tokens[k:]
                assert gen["loss_masks"][row] == mask[k:]
                assert gen["rollout_logprobs"][row] == logprobs[k:]
                if len(path) == 2:  # the main line: tool call, tool result (mask 0, exactly), answer
                    first, second = path
                    assert mask[k:] == [1] * len(first.output_ids) + [0] * len(second.input_ids) + [1] * len(
                        second.output_ids
                    )
                    n = int(re.findall(r"square of (\d+)", decode(tokens[:k]))[-1])
                    assert f"<tool_response>\n{n * n}\n</tool_response>" in decode(second.input_ids)
                    assert decode(second.output_ids).startswith(f"The square of {n} is {n * n}.")
                else:
                    assert len(path) == 1 and decode(path[0].output_ids).startswith("Again:")
                # SkyRL's training tensors: right-aligned, so the row's values are the last len(response) ones
                width = len(gen["response_ids"][row])
                t = {k2: v[row][len(v[row]) - width :] for k2, v in res["tensors"].items()}
                assert t["loss_masks"] == gen["loss_masks"][row]
                assert t["logprobs"] == pytest.approx(gen["rollout_logprobs"][row], abs=1e-6)
                assert t["response_mask"] == [1] * width
                assert t["rewards"] == [0.0] * (width - 1) + [gen["rewards"][row]]
                row += 1
            assert targeted == {c.call_id for c in calls}  # every recorded call trained once
