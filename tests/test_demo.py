"""`gyre demo`: the task family, the demo policy, and the whole loop for real on this machine (the default demo learns)."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from gyre import tasks
from gyre.cli import main
from gyre.config import RunConfig
from gyre.demo import evaluation as demo_eval
from gyre.demo import model as demo_model
from gyre.run.pipeline import _assessment_config
from gyre_sched.trace import iter_trace, read_trace
from gyre_tito.records import read_log
from gyre_tito.render import ChatTokenizer


def test_config_prints_resolved_defaults(capsys):
    assert main(["config", "--json", "--set", "train.steps=7"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["train"]["steps"] == 7
    assert cfg["cluster"]["cells"] == 2
    assert cfg["scheduler"]["kind"] == "elastic" and cfg["train"]["loss"]["weight_cap"] == 5.0


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("scheduler.phi=0.3", "phi * B must be a non-negative whole number"),
        ("scheduler.kind=fastest", "scheduler.kind"),
        ("train.bogus=1", "train.bogus"),
        ("nonsense", "expected key=value"),
        ("scheduler.kind=colocate", "colocate with phi > 0 needs a standalone pool"),
        ("cluster.standalone_engines=1", "cluster.standalone_capacity"),
        ("train.lr_warmup_steps=-2", "train.lr_warmup_steps"),
        ("assessment.max_concurrent=0", "assessment.max_concurrent"),
        ("assessment.retry_wait_max_s=0.1", "retry_wait_max_s must be >= retry_wait_min_s"),
    ],
)
def test_bad_config_is_a_clear_cli_error(override, needle, capsys):
    assert main(["demo", "--set", override]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_the_assessment_section_is_what_gyre_eval_runs_with(tmp_path):
    queries = tasks.demo_queries(0, 3)
    default = _assessment_config(tmp_path, queries, None, RunConfig().assessment)
    assert (default.max_concurrent, default.retry_wait_min_s, default.retry_wait_max_s) == (4, 0.2, 2.0)
    assert {(e.sandbox.timeout_s, e.sandbox.cpu_s) for e in default.evaluators.values()} == {(30.0, 30)}
    cfg = RunConfig.model_validate(
        {
            "assessment": {
                "max_concurrent": 2,
                "retry_wait_max_s": 5,
                "check_sandbox": {"timeout_s": 7, "cpu_s": 3},
            }
        }
    )
    service = _assessment_config(tmp_path, queries, None, cfg.assessment)
    assert (service.max_concurrent, service.retry_wait_min_s, service.retry_wait_max_s) == (2, 0.2, 5.0)
    assert set(service.evaluators) == {f"task-{q.query_id}" for q in queries}
    assert {(e.sandbox.timeout_s, e.sandbox.cpu_s) for e in service.evaluators.values()} == {(7.0, 3)}


# ---- the task family ----------------------------------------------------------------------------------------------
def test_queries_are_seeded_chains_of_links():
    assert [q.prompt for q in tasks.demo_queries(3, 20)] == [q.prompt for q in tasks.demo_queries(3, 20)]
    assert [q.files for q in tasks.demo_queries(3, 20)] != [q.files for q in tasks.demo_queries(4, 20)]
    for q in tasks.demo_queries(0, 50):
        assert f'"{q.chain[0]}"' in q.prompt and len(q.chain) == 3  # the run's queries: chains of three
        names = [name for name, _ in q.files]
        assert names == list(tasks.FILE_NAMES) and len({q.field(n, "code") for n in names}) == len(names)
        for here, there in zip(q.chain, q.chain[1:], strict=False):
            assert q.field(here, "next") == there
        assert q.field(q.chain[-1], "next") is None
        assert [q.field(n, "code") for n in q.chain] == list(q.codes)
        off = [n for n in names if n not in q.chain]  # a wrong turn loops among these, never reaching an end
        assert all(q.field(n, "next") in off for n in off)
    rng = random.Random(5)  # the pre-training draws mix chains of two and three
    assert {len(tasks.random_query(rng).chain) for _ in range(40)} == {2, 3}
    with pytest.raises(ValueError, match="chain_lengths must be 2s and 3s"):
        tasks.random_query(rng, chain_lengths=(4,))


def test_score_is_graded_and_the_sandboxed_scorer_agrees(tmp_path):
    codes = ("rose", "gold", "mint")
    cases = {
        "The code is mint.": 1.0,
        "mint": 1.0,
        "The code is gold.": 0.25,
        "rose": 1 / 16,
        "teal": 0.0,
        "mint gold": 0.5,
        "red blue green gold pink gray": 0.25 / 6,
        "": 0.0,
        "The code is.": 0.0,
        "MINT!": 1.0,
    }
    q = tasks.Query("q", "p", (), ("a.txt", "b.txt", "c.txt"), codes)
    for answer, expected in cases.items():
        assert tasks.score_answer(answer, codes) == pytest.approx(expected)
        (tmp_path / "answer.txt").write_text(answer)
        score_file = tmp_path / "score"
        subprocess.run(
            tasks.scoring_command(q),
            cwd=tmp_path,
            check=True,
            timeout=60,
            env={**os.environ, "GYRE_SCORE_FILE": str(score_file)},
        )
        assert float(score_file.read_text()) == pytest.approx(expected), answer
    (tmp_path / "answer.txt").unlink()
    subprocess.run(
        tasks.scoring_command(q),
        cwd=tmp_path,
        check=True,
        timeout=60,
        env={**os.environ, "GYRE_SCORE_FILE": str(score_file)},
    )
    assert float(score_file.read_text()) == 0.0  # no answer: a valid zero


def test_setup_writes_the_workspace(tmp_path):
    q = tasks.demo_queries(0, 1)[0]
    q.launch_options()["setup"](tmp_path / "ws")
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == list(tasks.FILE_NAMES)
    assert (tmp_path / "ws" / q.chain[0]).read_text() == dict(q.files)[q.chain[0]]


# ---- the demo policy's data and build -----------------------------------------------------------------------------
def test_transcripts_become_the_tokens_the_proxy_would_send(tmp_path):
    transcripts = list(demo_model.synthetic_transcripts(60, demo_model.Teacher(), 7, 150, 6))
    assert any(t.resets for t in transcripts) and any(t.reward == 1.0 for t in transcripts)
    assert len({t.reward for t in transcripts}) >= 3  # graded
    demo_model.build_tokenizer(
        tmp_path, [x for t in transcripts for x in demo_model._transcript_text(t)], 1024
    )
    chat = ChatTokenizer(tmp_path)
    assert chat.native  # the Qwen3 template, rendered as the proxy renders it
    for t in transcripts:
        sequences = demo_model.training_sequences(chat, t)
        assert len(sequences) == t.resets + 1  # one per context
        outputs = []
        for ids, marks in sequences:
            assert len(ids) == len(marks)
            runs, current = [], []
            for token, mark in zip(ids, marks, strict=True):
                if mark:
                    current.append(token)
                elif current:
                    runs.append(current)
                    current = []
            runs.append(current)
            outputs += [chat.decode(r) for r in runs if r]
            context = chat.decode([tok for tok, m in zip(ids, marks, strict=True) if not m])
            assert context.startswith("<|im_start|>system\n" + demo_model.agent.SYSTEM_PROMPT)
        # Targets are exactly the teacher's outputs (each ended by <|im_end|>), in order; nothing else.
        assert outputs == [raw + "<|im_end|>" for _, raw in t.calls]
        # Tool results are context: every file read appears unmarked in the context of the next call.
        short = demo_model.training_sequences(chat, t, short=True)
        assert len(short) == len(sequences) and all(
            len(s[0]) < len(f[0]) for s, f in zip(short, sequences, strict=True)
        )


def test_demo_policy_build_is_cached_atomic_and_deterministic(tmp_path):
    cfg = demo_model.DemoPolicyConfig(
        transcripts=40, steps=4, warmup_steps=2, decay_steps=2, short_fraction=0.5
    )
    path = demo_model.demo_policy(cfg, root=tmp_path / "cache")
    assert path.parent == tmp_path / "cache" and path.name == f"demo-policy-{demo_model.cache_key(cfg)}"
    report = json.loads((path / "gyre_demo_policy.json").read_text())
    assert report["sequences"] > 40 and report["parameters"] > 100_000 and report["final_loss"] > 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()
    }
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".building-")]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_model.demo_policy(cfg, root=tmp_path / "cache") == path  # the cache answers
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert demo_model.cache_key(cfg) != demo_model.cache_key(
        demo_model.DemoPolicyConfig(transcripts=41, steps=4)
    )
    again = demo_model.build_demo_policy(tmp_path / "again", cfg)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        path / "model.safetensors"
    ).read_bytes()
    assert again["final_loss"] == report["final_loss"]


def test_the_run_and_the_build_use_the_same_agent_settings():
    cfg, built = RunConfig(), demo_model.DemoPolicyConfig()
    assert (cfg.agent.context_chars, cfg.agent.max_turns) == (built.context_chars, built.max_turns)


@pytest.mark.slow
def test_demo_policy_acts_before_rl():
    """The cached demo policy (built here on first use) emits well-formed tool calls part of the time and solves a
    minority of tasks."""
    report = demo_eval.evaluate_policy(demo_model.demo_policy(), episodes=48, seed=3)
    assert 0.3 < report["tool_call_share"] < 0.95, report
    assert 0.0 < report["solved"] < 0.5 and report["mean_reward"] < 0.5, report


# ---- the default demo, for real -----------------------------------------------------------------------------------
def _records(run_dir: Path) -> dict[str, list]:
    return {
        p.name.split(".tito")[0]: read_log(p).records
        for p in (run_dir / "records" / "records").glob("*.jsonl")
    }


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the run's own budget is 1200 s; the suite's 600 s would cut a slow machine short
def test_default_demo_learns_and_exercises_the_whole_path(tmp_path):
    run_dir = tmp_path / "run"
    # The defaults, plus one test gate: a satellite joins the core's batches only when training lags the rollouts,
    # which on an idle 2-core machine may never happen in 40 steps (CI saw no join once; an idle run here had joins
    # in 8 of its first 24 steps, none before step 16). The gate holds the core at a batch's second micro-step (30 s
    # at most, until it has once) so that the rollouts finish and cell 1 joins and claims.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gyre.cli",
            "demo",
            "--run-dir",
            str(run_dir),
            "--set",
            "debug.hold_core_for_join=1",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    defaults = RunConfig()
    steps_n = defaults.train.steps
    assert summary["steps"] == steps_n

    # The policy learned. Decided on held-out queries: the initial and the final policy play the same 64 episodes
    # (same queries, same sampling seed; `demo_eval`, no proxy), so neither the order in which the run met its
    # queries nor their difficulty enters the comparison. Measured: 0.32 before; after 40 steps 0.78 and 0.80
    # (default runs), 0.56 to 0.67 for runs whose training curve rose least, and once 0.45 (a CI run: +0.13, which
    # failed the +0.15 this asked before). An untrained or broken trainer stays within 0.05 of before.
    before = demo_eval.evaluate_policy(demo_model.demo_policy(), episodes=64, seed=5)
    after = demo_eval.evaluate_policy(run_dir / "checkpoints" / f"policy-v{steps_n}", episodes=64, seed=5)
    assert after["mean_reward"] >= before["mean_reward"] + 0.1, (before, after)
    # And the run's own curve rose: its last quarter of steps well above where the policy started, which the held-out
    # `before` measures on the same kind of queries (chains of three). The first quarter of the run's own steps is no
    # such baseline: lr warms up over those 10 steps and the policy already learns in them, faster or slower with the
    # machine's load (a clean-clone CI run on two xdist workers: first quarter 0.37, last 0.55, held-out after
    # +0.1 or more; the 1.5x of the first quarter it asked then failed a run that learned). bench/demo_learning.py
    # measures the curve: last quarters 0.69-0.70 on seeds 0-2; the held-out before is 0.32 here, so this asks 0.42
    # (1.5x of a typical first quarter of 0.25-0.27 asked 0.38-0.40). A flat or collapsing curve fails.
    rewards = summary["mean_reward_per_step"]
    quarter = steps_n // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last >= before["mean_reward"] + 0.1 and last >= 0.3, (before, first, last, rewards)

    # Counters, steps and staleness recomputed from the trace alone.
    trace = read_trace(run_dir / "trace.jsonl")
    assert trace.steps >= steps_n
    assert 0 <= trace.f <= trace.p <= trace.d - trace.x
    v_d = {x["group"]: x["v_d"] for x in iter_trace(run_dir / "trace.jsonl") if x["ev"] == "dispatch"}
    expected = [
        x["version"] - 1 - v_d[g]
        for x in iter_trace(run_dir / "trace.jsonl")
        if x["ev"] == "step_end"
        for g in x["groups"]
    ]
    assert trace.staleness == expected  # d = v_t - v_d for every consumed group
    batch = defaults.scheduler.B
    # the first batch was dispatched at version 0 and trained at 0
    assert trace.staleness[:batch] == [0] * batch
    assert max(trace.staleness) >= 1  # phi > 0: later batches hold groups dispatched one version earlier
    assert any(role == "training" for cell in trace.roles for _, _, role in cell)

    # Executions make several model calls; tool calls are policy tokens and their results context.
    records = _records(run_dir)
    calls = [len(r) for r in records.values()]
    assert sum(calls) / len(calls) >= 3, Counter(calls)
    chat = ChatTokenizer(run_dir / "model")
    tool_call_then_result = 0
    for recs in records.values():
        by_id = {r.call_id: r for r in recs}
        for r in recs:
            parent = by_id.get(r.parent_id)
            if parent is None or "<tool_call>" not in chat.decode(parent.output_ids):
                continue
            provenance = [source for source, length in r.input_provenance for _ in range(length)]
            text = chat.decode([t for t, p in zip(r.input_ids, provenance, strict=True) if p == "external"])
            tool_call_then_result += "<tool_response>" in text
    assert tool_call_then_result > 0

    # Context resets branch trees: some executions have 2 or more selected trajectories.
    per_execution = Counter()
    targets = 0
    for path in (run_dir / "trajectories").glob("*.parquet"):
        for row in pq.read_table(path).to_pylist():
            per_execution[row["execution_id"]] += 1
            mask, logprobs = row["target_mask"], row["behavior_logprobs"]
            assert len(mask) == len(row["token_ids"]) == len(logprobs)
            targets += sum(mask)
            assert all(lp <= 0.0 for lp, m in zip(logprobs, mask, strict=True) if m)
    assert targets > 0 and max(per_execution.values()) >= 2, Counter(per_execution.values())

    # Every consumed execution was scored by the task's rule on its own artifact.
    queries = {f"task-{q.query_id}": q for q in tasks.demo_queries(defaults.train.seed)}
    db = sqlite3.connect(run_dir / "assessments.sqlite")
    rows = db.execute(
        "SELECT execution_id, evaluator, status, score FROM assessments WHERE designated = 1"
    ).fetchall()
    assert rows
    for execution_id, evaluator, status, score in rows:
        assert status == "valid"
        answer = run_dir / "workspaces" / execution_id / "answer.txt"
        text = answer.read_text(errors="replace") if answer.exists() else ""
        assert score == pytest.approx(tasks.score_answer(text, queries[evaluator].codes), abs=1e-12)

    # Batches span several micro-steps; in some step two cells claim them (a satellite joined).
    steps = [json.loads(line) for line in (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert [s["policy_version"] for s in steps] == list(range(1, steps_n + 1))
    assert all(s["num_microsteps"] >= 4 for s in steps), [s["num_microsteps"] for s in steps]
    assert any(sum(n > 0 for n in s["microsteps_by_cell"].values()) >= 2 for s in steps)
    # the final version, saved
    assert (run_dir / "checkpoints" / f"policy-v{steps_n}" / "config.json").exists()

    # Role switches went through gyre-cell's role manager (pause, flush, release / offload, resume, load, continue).
    switches = [
        json.loads(line) for line in (run_dir / "metrics" / "switches.jsonl").read_text().splitlines()
    ]
    to_training = [s for s in switches if s["to_role"] == "training"]
    assert to_training and [p["name"] for p in to_training[0]["phases"]][:3] == [
        "pause_generation",
        "flush_cache",
        "release_memory",
    ]
    assert all(s["weight_version"] is not None for s in switches if s["to_role"] == "rollout")
    report = (run_dir / "report.html").read_text()
    assert "window.GYRE_DATA" in report and "mean reward" in report  # the dashboard's views, static

    # A second run never overwrites the first one's records.
    before = (run_dir / "trace.jsonl").read_bytes()
    assert main(["demo", "--run-dir", str(run_dir)]) == 2
    assert (run_dir / "trace.jsonl").read_bytes() == before


def test_summary_wall_time_counts_the_whole_process():
    # The process busies itself 0.3 s before asking: its age includes that (and interpreter start), not just the run.
    code = (
        "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 0.3: pass\n"
        "from gyre.run.pipeline import process_age_s\nprint(process_age_s(), time.monotonic() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    age, since_loop = float(out[0]), float(out[1])
    assert since_loop - 0.05 <= age <= since_loop + 30.0
