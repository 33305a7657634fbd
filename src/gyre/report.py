"""RUN/report.html: one self-contained page with the role timeline, waterlevel vs capacity, staleness and rewards.

Everything on it is recomputed from files of the run directory (trace.jsonl and metrics/steps.jsonl), so a report can
be rebuilt for any run, finished or not: `gyre report RUN`.
"""

from __future__ import annotations

import base64
import html
from collections import Counter
from pathlib import Path

import orjson

from gyre_sched.plots import role_timeline_png, waterlevel_png
from gyre_sched.trace import read_trace

__all__ = ["write_report"]


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}" style="max-width:100%">'


def write_report(run_dir: Path) -> Path:
    summary = read_trace(run_dir / "trace.jsonl")
    plots = run_dir / "metrics"
    plots.mkdir(parents=True, exist_ok=True)
    role_timeline_png(summary, plots / "roles.png", title="cell roles")
    waterlevel_png(summary, plots / "waterlevel.png", title="waterlevel vs rollout capacity")
    steps_file = run_dir / "metrics" / "steps.jsonl"
    steps = (
        [orjson.loads(line) for line in steps_file.read_bytes().splitlines()] if steps_file.exists() else []
    )
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            s["policy_version"], f"{s['t']:.1f}",
            "n/a" if s["mean_reward"] is None else f"{s['mean_reward']:.4f}",
            f"{s['loss']:.6f}", f"{s['grad_norm']:.4f}", s["num_target_tokens"], s["training_cells"],
            ",".join(map(str, s["staleness"])),
        )) + "</tr>"
        for s in steps
    )  # fmt: skip
    hist = Counter(summary.staleness)
    staleness = ", ".join(f"d={d}: {n}" for d, n in sorted(hist.items())) or "no step yet"
    share = ", ".join(f"{role}: {100 * v:.1f}%" for role, v in summary.role_share().items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>Gyre run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 10px;text-align:right}}</style></head><body>
<h1>Gyre run <code>{html.escape(str(run_dir))}</code></h1>
<p>{summary.steps} steps in {summary.end_time_s:.1f} s; executions dispatched {summary.d}, launched {summary.p},
terminated {summary.f}, withdrawn {summary.x}. Time share per role: {html.escape(share)}.</p>
<h2>Steps</h2><table><tr><th>version</th><th>t (s)</th><th>mean reward</th><th>loss</th><th>grad norm</th>
<th>target tokens</th><th>training cells</th><th>staleness</th></tr>{rows}</table>
<h2>Staleness per consumed group</h2><p>{html.escape(staleness)}</p>
<h2>Cell roles</h2>{_img(plots / "roles.png")}
<h2>Waterlevel and rollout capacity</h2>{_img(plots / "waterlevel.png")}
</body></html>"""
    out = run_dir / "report.html"
    out.write_text(page)
    return out
