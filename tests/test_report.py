"""report.html: the dashboard's views, static, self-contained; rebuilt by `gyre report RUN` for any run, an interrupted
one included. Rendered in headless Chromium (Debian's chromium driven by playwright).

It explains itself and survives what a model writes: a legend for every short label it shows, charts of learning rate,
gradient norm, response length and turns per step, a reward band within the rewards' range, a finished run's end state
in its header, execution details sampled across the whole run, and answers or model output holding `<!--<script>`,
`</script>` or `<script>` that leave every section drawn (a recorded finished run, written here)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.cli import main
from gyre.observe.report import report_data, sample_details, script_json
from gyre.observe.rundata import RunView
from gyre_eval.store import AssessmentStore
from gyre_eval.types import AttemptRecord, Provenance, Submission
from gyre_tito.records import ExecutionRecords
from gyre_tito.testing.synthetic import SessionDriver
from gyre_tito.tiny_tokenizer import build_tiny_tokenizer, load_tiny_tokenizer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@contextlib.contextmanager
def chromium():
    """Headless Debian chromium through playwright (in a container: no setuid sandbox, no /dev/shm, no GPU)."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), (
        "Debian's chromium is needed: apt-get install chromium (bash .ci/run does)"
    )
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
        )
        try:
            yield browser
        finally:
            browser.close()


# Every chart's legend box against every one of its axes (ticks and title): overlapping boxes = a covered label.
LAYOUT_JS = """() => Object.fromEntries(Object.entries(window.gyreCharts).map(([name, c]) => {
  const L = c.legend;
  const hits = Object.values(c.scales).filter(s => !(L.right <= s.left || L.left >= s.right || L.bottom <= s.top
                                                      || L.top >= s.bottom)).map(s => s.id);
  return [name, {hits, legendBottom: L.bottom, areaTop: c.chartArea.top, x: c.options.scales.x.title.text,
                 points: c.data.datasets.map(d => d.data.length)}];
}))"""


def _write(path: Path, rows: list[dict], torn: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + torn)


def interrupted_run(run_dir: Path, length_s: float) -> None:
    """A run killed mid-write: torn last lines, no scheduler.json, no records or assessments yet."""
    s = length_s / 10
    trace = [
        {
            "t": 0.0,
            "ev": "header",
            "schema_version": 1,
            "K": 2,
            "C_e": 2,
            "C_s": 0,
            "N": 2,
            "B": 1,
            "phi": 0.0,
            "mu": 1,
            "policy": "elastic",
            "real": True,
        },
        {
            "t": 0.0,
            "ev": "dispatch",
            "group": "g0",
            "query": "q0",
            "executions": ["g0.e0", "g0.e1"],
            "v_d": 0,
        },
        {"t": 0.0, "ev": "launch", "execution": "g0.e0", "group": "g0", "engine": "cell:0"},
        {"t": 0.0, "ev": "launch", "execution": "g0.e1", "group": "g0", "engine": "cell:1"},
        {"t": 2 * s, "ev": "terminate", "execution": "g0.e0", "outcome": "completed"},
        {"t": 3 * s, "ev": "terminate", "execution": "g0.e1", "outcome": "completed"},
        {"t": 4 * s, "ev": "transition_begin", "cell": 0, "from": "rollout", "to": "to_training"},
        {"t": 5 * s, "ev": "transition_end", "cell": 0, "from": "to_training", "to": "training"},
        {"t": 9 * s, "ev": "step_end", "version": 1, "groups": ["g0"], "staleness": [0]},
        {
            "t": 10 * s,
            "ev": "dispatch",
            "group": "g1",
            "query": "q1",
            "executions": ["g1.e0", "g1.e1"],
            "v_d": 1,
        },
    ]
    _write(run_dir / "trace.jsonl", trace, torn=b'{"t": 10.5, "ev": "lau')
    step = {
        "policy_version": 1,
        "loss": -0.5,
        "surrogate": -0.1,
        "grad_norm": 0.9,
        "num_target_tokens": 64,
        "microsteps_by_cell": {"0": 2},
        "group_ids": ["g0"],
        "staleness": [0],
        "metrics": {"clip_frac_all": 0.0},
        "seconds": 1.0,
        "mean_reward": 0.3,
        "reward_std": 0.1,
        "training_cells": 1,
        "t": 9 * s,
    }
    _write(run_dir / "metrics" / "steps.jsonl", [step], torn=b'{"policy_version": 2, "lo')
    (run_dir / "config.json").write_text(json.dumps({"train": {"steps": 5}}))


def _render(page, path: Path) -> dict:
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_function("window.gyreState !== null")
    layout = page.evaluate(LAYOUT_JS)
    assert not errors, errors
    for name, chart in layout.items():  # legends never cover an axis label
        assert chart["hits"] == [] and chart["legendBottom"] <= chart["areaTop"], (name, chart)
    return layout


def test_report_of_an_interrupted_run_renders(tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    interrupted_run(short, 40.0)
    interrupted_run(long, 2 * 3600.0)
    for run_dir in (short, long):
        assert main(["report", str(run_dir)]) == 0
    data = report_data(short)
    assert data["summary"]["steps_done"] == 1 and not data["summary"]["finished"]
    assert [r["execution"] for r in data["executions"]] == ["g0.e0", "g0.e1", "g1.e0", "g1.e1"]
    assert data["series"]["time_unit"] == "s" and report_data(long)["series"]["time_unit"] == "min"
    html = (short / "report.html").read_text()
    assert "window.GYRE_DATA" in html and "Chart.js v4" in html and "src=" not in html  # self-contained

    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        layout = _render(page, short / "report.html")
        assert layout["reward"]["points"][0] == 1 and layout["loss"]["points"][0] == 1
        assert layout["roles"]["x"] == "time (s)" and layout["waterlevel"]["x"] == "time (s)"
        assert "did not finish" in page.inner_text("#run-status")
        assert page.eval_on_selector_all("#executions tbody tr", "t => t.length") == 4
        page.screenshot(path=str(short / "report.png"), full_page=True)
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        layout = _render(page, long / "report.html")
        assert layout["roles"]["x"] == "time (min)" and layout["throughput"]["x"] == "time (min)"
        roles = page.evaluate("window.gyreCharts.roles.data.datasets.find(d => d.label === 'training').data")
        assert roles == [{"x": [60.0, 120.0], "y": "cell 0 (core)"}]  # 3600 s .. 7200 s, in minutes


def _plant(run_dir: Path) -> dict[str, Path]:
    """g0.e0: a FIFO with no writer; g0.e1: a symlink to g1.e0's answer; g1.e0: a real answer; g1.e1: a directory."""
    ws = {e: run_dir / "workspaces" / e for e in ("g0.e0", "g0.e1", "g1.e0", "g1.e1")}
    for path in ws.values():
        path.mkdir(parents=True)
    os.mkfifo(ws["g0.e0"] / "answer.txt")
    (ws["g1.e0"] / "answer.txt").write_text("The code is mint.")
    (ws["g0.e1"] / "answer.txt").symlink_to(ws["g1.e0"] / "answer.txt")
    (ws["g1.e1"] / "answer.txt").mkdir()
    return ws


def test_the_report_and_the_views_treat_answers_as_untrusted(tmp_path, capsys):
    run_dir = tmp_path / "run"
    interrupted_run(run_dir, 40.0)
    _plant(run_dir)
    view = RunView(run_dir)
    view.refresh()
    assert view.answer("g1.e0") == "The code is mint."
    assert view.answer("g0.e1") is None  # the sibling's answer through a symlink is not this execution's
    assert view.answer("g0.e0") is None and view.answer("g1.e1") is None  # FIFO, directory
    assert view.answer("..") is None and view.answer("g1.e0/../g1.e0") is None
    assert main(["report", str(run_dir)]) == 0  # the FIFO did not hang it; the directory is no traceback
    assert "Traceback" not in capsys.readouterr().err
    assert (run_dir / "report.html").stat().st_size > 0


def test_report_of_a_folder_without_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no trace.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_report_of_a_real_interrupted_demo_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    steps_file = run_dir / "metrics" / "steps.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gyre.cli",
            "demo",
            "--run-dir",
            str(run_dir),
            "--steps",
            "4",
            "--quiet",
            "--set",
            "dashboard.enabled=false",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 400
        while not (steps_file.exists() and steps_file.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step within 400 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "interrupted by SIGTERM" in stderr and "INFO" not in stderr and " gyre: " not in stderr  # --quiet
    assert not (run_dir / "report.html").exists()  # the run stopped before writing it

    assert main(["report", str(run_dir)]) == 0  # `gyre report RUN`
    assert capsys.readouterr().out.strip() == str(run_dir / "report.html")
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()]
    trace = [
        json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines() if line.endswith("}")
    ]
    dispatched = [e for line in trace if line["ev"] == "dispatch" for e in line["executions"]]
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        layout = _render(page, run_dir / "report.html")
        assert layout["reward"]["points"][0] == len(steps) >= 1
        lr = page.evaluate("window.gyreCharts.lr.data.datasets[0].data.map(p => p.y)")
        assert lr == [s["metrics"]["lr"] for s in steps] and all(v > 0 for v in lr)  # recorded by the trainer
        assert "did not finish" in page.inner_text("#run-status")
        assert (
            page.eval_on_selector_all("#executions tbody tr", "t => t.map(r => r.dataset.execution)")
            == dispatched
        )
        eid = next(e for e in dispatched if (run_dir / "trajectories" / f"{e}.parquet").exists())
        page.click(f'#executions tr[data-execution="{eid}"]')
        page.wait_for_selector("#execution-view:not([hidden]) .tok.target")
        assert page.inner_text("#ev-id") == eid
        samples = page.inner_text("#samples")
        assert "Step 1" in samples and "reward" in samples
        page.screenshot(path=str(run_dir / "report.png"), full_page=True)


# ---- a finished run: legend, new charts, reward band, end state, sampled details, hostile text ----------------
HOSTILE = "<!--<script> </script> <script>alert(1)</script> & x > y"
STEPS, N = 4, 4
LR = [2.5e-4, 5e-4, 7.5e-4, 1e-3]  # a warm-up, as the trainer records it in metrics["lr"]
TERMS = (
    "K",
    "N",
    "B",
    "phi",
    "mu",
    "w(t)",
    "C(t)",
    "d",
    "A",
    "w",
    "l - b",
    "lr",
    "p50",
    "p99",
    "core",
    "grad norm",
)
"""Short labels the page shows whatever the run: each must have a legend entry of more than a word."""
REWARDS = [1.0, 1.0, 1.0, 0.0]  # mean 0.75, std 0.433: mean + std is 1.18, above the best reward


def _lines(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def finished_run(run_dir: Path, tokenizer: Path) -> dict:
    """STEPS steps of one group of N executions each; execution i of step k makes k + i model calls. The run finished
    (metrics/scheduler.json) with the next step's group launched and left open, as a real run leaves it."""
    tok = load_tiny_tokenizer(tokenizer)
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "config.json").write_text(
        json.dumps({"train": {"steps": STEPS}, "model": {"path": str(tokenizer)}})
    )
    trace = [
        {
            "t": 0.0,
            "ev": "header",
            "schema_version": 1,
            "K": 2,
            "C_e": 4,
            "C_s": 0,
            "N": N,
            "B": 1,
            "phi": 0.0,
            "mu": 1,
            "policy": "elastic",
            "real": True,
        }
    ]
    steps, store, calls = [], AssessmentStore(run_dir), {}
    prov = Provenance(evaluator="check", kind="exec")
    for k in range(STEPS + 1):
        t, gid = 10.0 * k, f"g{k}"
        ids = [f"{gid}.e{i}" for i in range(N)]
        trace.append({"t": t, "ev": "dispatch", "group": gid, "query": f"q{k}", "executions": ids, "v_d": k})
        trace += [{"t": t, "ev": "launch", "execution": e, "group": gid, "engine": "cell:1"} for e in ids]
        for i, eid in enumerate(ids):
            records = ExecutionRecords(run_dir / "records" / "records", eid)
            driver = SessionDriver(records)
            context = tok.encode(f"task {k}").ids
            for c in range(k + i + 1):
                text = HOSTILE if (k, i, c) == (STEPS - 1, 0, 0) else f"step {k} call {c} " * (1 + i)
                context = [*driver.context(driver.call(context, tok.encode(text).ids).call_id), 7]
            records.close()
            calls[eid] = k + i + 1
        if k == STEPS:  # the run ended here: these never terminated
            break
        for i, eid in enumerate(ids):
            trace.append({"t": t + 5 + 0.1 * i, "ev": "terminate", "execution": eid, "outcome": "completed"})
            ws = run_dir / "workspaces" / eid
            ws.mkdir(parents=True)
            (ws / "answer.txt").write_text(HOSTILE if i == 0 else f"answer {eid}")
            sub = Submission(
                execution_id=eid,
                group_id=gid,
                group_size=N,
                dispatch_index=i,
                launched_at=1000.0,
                budget_s=60.0,
                evaluator="check",
                artifact_ref=str(ws),
            )
            a, _ = store.submit(sub, "unresolved", None, False, prov, now=1000.0)
            store.record_attempt(
                AttemptRecord(
                    assessment_id=a.id,
                    number=1,
                    started_at=1000.0,
                    finished_at=1000.5,
                    ok=True,
                    score=REWARDS[i],
                ),
                prov,
            )
            store.finalize(a.id, "valid", REWARDS[i], prov, now=1000.5)
        trace.append({"t": t + 9, "ev": "step_end", "version": k + 1, "groups": [gid], "staleness": [0]})
        steps.append(
            {
                "policy_version": k + 1,
                "loss": -0.1 * k,
                "surrogate": -0.05,
                "grad_norm": 0.5 + k,
                "num_target_tokens": 10,
                "microsteps_by_cell": {"0": 1},
                "group_ids": [gid],
                "staleness": [0],
                "metrics": {"lr": LR[k], "clip_frac_all": 0.0},
                "seconds": 1.0,
                "mean_reward": 0.75,
                "reward_std": 0.4330127,
                "training_cells": 1,
                "t": t + 9,
            }
        )
    store.close()
    _lines(run_dir / "trace.jsonl", trace)
    _lines(run_dir / "metrics" / "steps.jsonl", steps)
    (run_dir / "metrics" / "scheduler.json").write_text("{}")
    return {"steps": steps, "calls": calls}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("legend")
    run_dir = root / "run"
    expect = finished_run(run_dir, build_tiny_tokenizer(root / "tokenizer"))
    assert main(["report", str(run_dir)]) == 0
    return run_dir, expect


@pytest.fixture(scope="module")
def report(run):
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto((run[0] / "report.html").as_uri())
        page.wait_for_function("window.gyreState !== null")
        yield SimpleNamespace(page=page, errors=errors)


def _points(page, chart: str) -> list[list[tuple]]:
    return [
        [(p["x"], p["y"]) for p in d]
        for d in page.evaluate(f"window.gyreCharts[{chart!r}].data.datasets.map(d => d.data)")
    ]


def test_hostile_text_in_answers_and_model_output_leaves_every_section_drawn(run, report):
    page, errors = report.page, report.errors
    run_dir, expect = run
    html = (run_dir / "report.html").read_text()
    # escaped in the embedded JSON
    assert "<!--<script>" not in html and "\\u003c!--\\u003cscript\\u003e" in html
    assert not errors, errors
    assert page.eval_on_selector_all("#executions tbody tr", "t => t.length") == (STEPS + 1) * N
    assert page.eval_on_selector_all("#steps tbody tr", "t => t.length") == STEPS
    assert page.eval_on_selector_all("#legend-terms dt", "t => t.length") > 20
    samples = page.inner_text("#samples")  # the answer is shown as text, whole
    assert f"Step {STEPS}" in samples and HOSTILE in samples
    eid = f"g{STEPS - 1}.e0"
    page.click(f'#executions tr[data-execution="{eid}"]')
    page.wait_for_selector("#execution-view:not([hidden]) .node")
    assert page.inner_text("#ev-id") == eid and page.inner_text("#ev-answer") == HOSTILE
    assert HOSTILE in page.inner_text("#ev-tree")  # the model's output, decoded, as text
    assert len(page.query_selector_all("#ev-tree .node")) == expect["calls"][eid]
    # nothing the data wrote was parsed
    assert page.evaluate("document.querySelectorAll('script').length") == 3
    assert not errors, errors


def test_script_json_reads_back_the_same_and_has_no_markup():
    data = {"a": HOSTILE, "b": ["</script>", "<script>", 1.5, None], "&": "x > y"}
    text = script_json(data)
    assert not set("<>&") & set(text)
    assert json.loads(text) == data


def test_the_legend_explains_every_short_label_the_page_shows(report):
    page = report.page
    legend = dict(
        zip(
            page.eval_on_selector_all("#legend-terms dt", "t => t.map(e => e.textContent)"),
            page.eval_on_selector_all("#legend-terms dd", "t => t.map(e => e.textContent)"),
            strict=True,
        )
    )
    for term in TERMS:
        assert len(legend.get(term, "")) > 10, term
    assert "R in" in legend["rollout"] and "T in" in legend["training"] and "L in" in legend["lost"]
    # every marked abbreviation (header facts, table headings) has its entry and carries it as hover text
    page.click('#executions tr[data-execution="g0.e1"]')
    page.wait_for_selector("#execution-view:not([hidden]) .node")
    marked = page.eval_on_selector_all("abbr", "t => t.map(e => [e.dataset.term, e.title])")
    assert {t for t, _ in marked} >= {"K", "N", "B", "phi", "mu", "C_e", "t", "v", "turns"}
    for term, title in marked:
        assert title and legend.get(term) == title, term
    # every short token of the charts' series labels and axis titles is a term of the legend
    labels = page.evaluate("""() => Object.values(window.gyreCharts).flatMap(c => [
        ...c.data.datasets.map(d => d.label), ...(c.data.labels || []),
        ...Object.values(c.options.scales).map(s => (s.title && s.title.text) || "")])""")
    words = {
        "log",
        "of",
        "per",
        "to",
        "all",
        "max",
        "mean",
        "cell",
        "time",
        "step",
        "norm",
        "by",
        "the",
        "at",
    }
    terms = set(legend) | {"s", "min", "h", "to_training", "to_rollout"}
    for label in labels:
        for special in ("w(t)", "C(t)", "l - b", "grad norm", "tokens/s"):
            label = label.replace(special, " ")
        for token in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", label):
            assert len(token) > 3 or token in words | terms, (token, label)


def test_new_charts_have_the_runs_points(run, report):
    page = report.page
    run_dir, expect = run
    steps = expect["steps"]
    xs = list(range(1, STEPS + 1))
    assert _points(page, "lr") == [list(zip(xs, LR, strict=True))]  # the lr values the trainer recorded
    assert _points(page, "gradnorm") == [list(zip(xs, [s["grad_norm"] for s in steps], strict=True))]
    turns = [[expect["calls"][f"g{k}.e{i}"] for i in range(N)] for k in range(STEPS)]
    assert _points(page, "turns") == [
        list(zip(xs, [sum(t) / N for t in turns], strict=True)),
        list(zip(xs, [max(t) for t in turns], strict=True)),
    ]
    rows = {r["execution"]: r for r in report_data(run_dir)["executions"]}
    lengths = [[rows[f"g{k}.e{i}"]["output_tokens"] for i in range(N)] for k in range(STEPS)]
    assert all(length > 0 for row in lengths for length in row)
    assert _points(page, "length") == [
        list(zip(xs, [pytest.approx(sum(v) / N) for v in lengths], strict=True)),
        list(zip(xs, [max(v) for v in lengths], strict=True)),
    ]


def test_the_reward_band_stays_within_the_rewards_range(report):
    page = report.page
    mean, upper, lower = _points(page, "reward")
    assert [y for _, y in mean] == [0.75] * STEPS
    assert [y for _, y in upper] == [1.0] * STEPS  # 0.75 + 0.433 clipped to the best reward, 1.0
    assert [y for _, y in lower] == pytest.approx([0.75 - 0.4330127] * STEPS)  # inside: unchanged


def test_a_finished_runs_header_says_finished_and_details_reach_the_last_step(run, report):
    page = report.page
    run_dir, _ = run
    status = page.inner_text("#run-status")
    assert status == f"report: finished, {STEPS} steps", status
    facts = page.inner_text("#run-facts")
    assert "running" not in facts and "queued" not in facts  # the open group at the end is not "running 4"
    statuses = page.eval_on_selector_all(
        "#executions tbody tr td:nth-child(3)", "t => t.map(e => e.innerText)"
    )
    assert statuses == ["completed"] * STEPS * N + ["open at end"] * N
    # a sample of 6 of the 20 executions: the last step's group, then the others spread from the first to the last
    data = report_data(run_dir, max_details=6)
    last = {f"g{STEPS - 1}.e{i}" for i in range(N)}
    assert set(data["details"]) == last | {"g0.e0", f"g{STEPS}.e{N - 1}"}
    ids = [f"g{k}.e{i}" for k in range(5) for i in range(4)]
    assert sample_details(ids, 5, set()) == ["g0.e0", "g1.e1", "g2.e2", "g3.e2", "g4.e3"]
    assert sample_details(ids, 30, set()) == ids
