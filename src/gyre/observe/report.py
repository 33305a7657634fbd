"""RUN/report.html: the live dashboard's views as one static, self-contained page, written at the end of a run.

The page is the dashboard's own HTML, stylesheet and script with Chart.js inlined and the data embedded
(`window.GYRE_DATA`): role timeline, waterlevel vs capacity, reward/loss/clip/importance-weight curves per step, staleness
histogram, rollout tokens/s and proxy latency, switch and publication times, the steps table, a few sample answers per
step, every execution with its trajectory tree, selected trajectories and assessment history. Time axes are in s, min
or h, chosen by the run's length. It opens from disk with no server and no network.

Execution details are embedded for at most `MAX_DETAILS` executions, sampled across the whole run (the executions of
the last step's groups first, the rest evenly spread in dispatch order); the table lists every one.

Everything an agent or the model wrote (answers, model output) is in the embedded JSON: its `<`, `>` and `&` are
written as `\u003c`, `\u003e`, `\u0026`, so no text (`</script>`, `<!--<script>`) can end or reopen the script element.

Everything is read from the run directory (`gyre.observe.rundata.RunView`), so `gyre report RUN` rebuilds it for any run:
finished, still running, or interrupted (a torn last line of any file is ignored).
"""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from gyre.observe.dashboard.server import STATIC, page
from gyre.observe.rundata import RunView

__all__ = ["MAX_DETAILS", "report_data", "sample_details", "script_json", "write_report"]

log = logging.getLogger("gyre")

MAX_DETAILS = 200
"""Executions whose full view (tree, trajectories, assessments) is embedded; the table lists every one."""


def sample_details(ids: list[str], k: int, first: set[str]) -> list[str]:
    """At most `k` of `ids` (in their order): those in `first`, then the rest evenly spread from the first to the last."""
    if len(ids) <= k:
        return list(ids)
    keep = [i for i in ids if i in first][:k]
    rest = [i for i in ids if i not in first]
    room = k - len(keep)
    if room == 1:
        keep.append(rest[-1])
    elif room > 1:
        keep += [rest[round(j * (len(rest) - 1) / (room - 1))] for j in range(room)]
    chosen = set(keep)
    return [i for i in ids if i in chosen]


def report_data(run_dir: Path, max_details: int = MAX_DETAILS) -> dict:
    view = RunView(run_dir)
    try:
        view.refresh()
        executions = view.executions()
        series = view.series()
        last = set(series["steps"][-1]["group_ids"]) if series["steps"] else set()
        ids = [row["execution"] for row in executions]
        details = {}
        for eid in sample_details(
            ids, max_details, {r["execution"] for r in executions if r["group"] in last}
        ):
            try:
                details[eid] = view.execution(eid, refresh=False)
            except Exception as exc:  # one unreadable execution must not cost the whole report
                log.warning("report: execution %s left out: %s", eid, exc)
        return {"summary": view.summary(), "series": series, "executions": executions, "details": details}
    finally:
        view.close()


def _inline_script(text: str) -> str:
    return "<script>" + text.replace("</script", "<\\/script") + "</script>"


_JSON_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def script_json(data: object) -> str:
    """JSON that is safe inside a <script> element: outside strings JSON has no `<`, `>` or `&`, and inside them the
    escapes read back as the same characters."""
    return orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY).decode().translate(_JSON_ESCAPES)


def write_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    data = script_json(report_data(run_dir))
    head = "<style>" + (STATIC / "dashboard.css").read_text() + "</style>"
    scripts = (
        _inline_script((STATIC / "chart.umd.min.js").read_text())
        + _inline_script("window.GYRE_DATA = " + data + ";")
        + _inline_script((STATIC / "dashboard.js").read_text())
    )
    out = run_dir / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page(head, scripts, 0, "report"))
    tmp.replace(out)
    return out
