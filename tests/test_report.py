"""report.html: the dashboard's views, static, self-contained; rebuilt by `gyre report RUN` for any run, an interrupted
one included. Rendered in headless Chromium (Debian's chromium driven by playwright)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.cli import main
from gyre.report import report_data
from gyre.rundata import RunView

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

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
        {"t": 0.0, "ev": "header", "schema_version": 1, "K": 2, "C_e": 2, "C_s": 0, "N": 2, "B": 1, "phi": 0.0,
         "mu": 1, "policy": "elastic", "real": True},
        {"t": 0.0, "ev": "dispatch", "group": "g0", "query": "q0", "executions": ["g0.e0", "g0.e1"], "v_d": 0},
        {"t": 0.0, "ev": "launch", "execution": "g0.e0", "group": "g0", "engine": "cell:0"},
        {"t": 0.0, "ev": "launch", "execution": "g0.e1", "group": "g0", "engine": "cell:1"},
        {"t": 2 * s, "ev": "terminate", "execution": "g0.e0", "outcome": "completed"},
        {"t": 3 * s, "ev": "terminate", "execution": "g0.e1", "outcome": "completed"},
        {"t": 4 * s, "ev": "transition_begin", "cell": 0, "from": "rollout", "to": "to_training"},
        {"t": 5 * s, "ev": "transition_end", "cell": 0, "from": "to_training", "to": "training"},
        {"t": 9 * s, "ev": "step_end", "version": 1, "groups": ["g0"], "staleness": [0]},
        {"t": 10 * s, "ev": "dispatch", "group": "g1", "query": "q1", "executions": ["g1.e0", "g1.e1"], "v_d": 1},
    ]  # fmt: skip
    _write(run_dir / "trace.jsonl", trace, torn=b'{"t": 10.5, "ev": "lau')
    step = {"policy_version": 1, "loss": -0.5, "surrogate": -0.1, "grad_norm": 0.9, "num_target_tokens": 64,
            "microsteps_by_cell": {"0": 2}, "group_ids": ["g0"], "staleness": [0], "metrics": {"clip_frac_all": 0.0},
            "seconds": 1.0, "mean_reward": 0.3, "reward_std": 0.1, "training_cells": 1, "t": 9 * s}  # fmt: skip
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
    from playwright.sync_api import sync_playwright

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

    assert Path(CHROMIUM).exists(), (
        "Debian's chromium is needed: apt-get install chromium (bash .ci/run does)"
    )
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
        )
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
        browser.close()


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
    from playwright.sync_api import sync_playwright

    run_dir = tmp_path / "run"
    steps_file = run_dir / "metrics" / "steps.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gyre.cli", "demo", "--run-dir", str(run_dir), "--steps", "4", "--quiet",
         "--set", "dashboard.enabled=false"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
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
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
        )
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        layout = _render(page, run_dir / "report.html")
        assert layout["reward"]["points"][0] == len(steps) >= 1
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
        browser.close()
