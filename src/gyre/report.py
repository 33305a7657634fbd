"""RUN/report.html: the live dashboard's views as one static, self-contained page, written at the end of a run.

The page is the dashboard's own HTML, stylesheet and script with Chart.js inlined and the data embedded
(`window.GYRE_DATA`): role timeline, waterlevel vs capacity, reward/loss/clip/importance-weight curves per step, staleness
histogram, rollout tokens/s and proxy latency, switch and publication times, the steps table, a few sample answers per
step, every execution with its trajectory tree, selected trajectories and assessment history. Time axes are in s, min
or h, chosen by the run's length. It opens from disk with no server and no network.

Everything is read from the run directory (`gyre.rundata.RunView`), so `gyre report RUN` rebuilds it for any run:
finished, still running, or interrupted (a torn last line of any file is ignored).
"""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from gyre.dashboard.server import STATIC, page
from gyre.rundata import RunView

__all__ = ["MAX_DETAILS", "report_data", "write_report"]

log = logging.getLogger("gyre")

MAX_DETAILS = 200
"""Executions whose full view (tree, trajectories, assessments) is embedded; the table lists every one."""


def report_data(run_dir: Path, max_details: int = MAX_DETAILS) -> dict:
    view = RunView(run_dir)
    try:
        view.refresh()
        executions = view.executions()
        details = {}
        for row in executions[:max_details]:
            try:
                details[row["execution"]] = view.execution(row["execution"], refresh=False)
            except Exception as exc:  # one unreadable execution must not cost the whole report
                log.warning("report: execution %s left out: %s", row["execution"], exc)
        return {
            "summary": view.summary(),
            "series": view.series(),
            "executions": executions,
            "details": details,
        }
    finally:
        view.close()


def _inline_script(text: str) -> str:
    return "<script>" + text.replace("</script", "<\\/script") + "</script>"


def write_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    data = orjson.dumps(report_data(run_dir), option=orjson.OPT_SERIALIZE_NUMPY).decode()
    head = "<style>" + (STATIC / "dashboard.css").read_text() + "</style>"
    scripts = (
        _inline_script((STATIC / "chart.umd.min.js").read_text())
        + _inline_script("window.GYRE_DATA = " + data.replace("</", "<\\/") + ";")
        + _inline_script((STATIC / "dashboard.js").read_text())
    )
    out = run_dir / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page(head, scripts, 0, "report"))
    tmp.replace(out)
    return out
