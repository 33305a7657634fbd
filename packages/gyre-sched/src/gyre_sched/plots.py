"""PNG plots recomputed from a trace: the cell role timeline and waterlevel vs rollout capacity."""

from __future__ import annotations

from pathlib import Path

from gyre_sched.errors import PlotsUnavailable
from gyre_sched.trace import TraceSummary

ROLE_COLORS = {"rollout": "#4c9be8", "to_training": "#f5b041", "training": "#c0392b", "to_rollout": "#58d68d"}


def _plt():  # imported lazily: plotting is optional and slow to import
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable("plots need matplotlib: pip install 'gyre-sched[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def role_timeline_png(s: TraceSummary, path: str | Path, title: str = "") -> None:
    plt = _plt()
    K = len(s.roles)
    fig, ax = plt.subplots(figsize=(12, 0.45 * K + 1.5))
    for c, spans in enumerate(s.roles):
        for role in ROLE_COLORS:
            bars = [(a / 3600, (b - a) / 3600) for a, b, r in spans if r == role and b > a]
            if bars:
                ax.broken_barh(bars, (c - 0.4, 0.8), facecolors=ROLE_COLORS[role])
    for t, _v in s.publishes:
        ax.axvline(t / 3600, color="k", lw=0.4, alpha=0.4)
    ax.set_yticks(range(K), [f"cell {c}" + (" (core)" if c == 0 else "") for c in range(K)])
    ax.invert_yaxis()
    ax.set_xlabel("hours (vertical lines: publications)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=col) for col in ROLE_COLORS.values()]
    ax.legend(handles, list(ROLE_COLORS), loc="upper center", ncol=4, bbox_to_anchor=(0.5, -0.25), fontsize=8)
    ax.set_title(title or "cell roles")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def waterlevel_png(s: TraceSummary, path: str | Path, title: str = "") -> None:
    plt = _plt()
    t = [p[0] / 3600 for p in s.timeline]
    fig, ax = plt.subplots(figsize=(12, 4))
    ax.step(t, [p[1] for p in s.timeline], where="post", label="waterlevel w = d - x - f", lw=0.9)
    ax.step(t, [p[2] for p in s.timeline], where="post", label="rollout capacity C(t)", lw=0.9)
    ax.step(t, [p[3] for p in s.timeline], where="post", label="running p - f", lw=0.6, alpha=0.7)
    ax.set_xlabel("hours")
    ax.set_ylabel("executions")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title or "waterlevel and capacity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_png(rows, best: dict, path: str | Path, title: str = "") -> None:
    """``gyre-sched plan``: end-to-end time against realized staleness, one marker per run, the recommendation and
    its ideal bound per target."""
    plt = _plt()
    marks = {"elastic": "o", "async": "s", "colocate": "^"}
    colors = {
        t: c
        for t, c in zip(
            sorted({r.target for r in rows}), ("#1f77b4", "#d62728", "#2ca02c", "#9467bd"), strict=False
        )
    }
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        face = colors.get(r.target, "#555") if r.planner == "adaptive" else "none"
        ax.scatter(
            r.staleness,
            r.time_h,
            marker=marks[r.kind],
            edgecolors=colors.get(r.target, "#555"),
            facecolors=face,
            s=45,
        )
    for t, b in best.items():
        rec = b["recommended"]
        ax.scatter(
            rec["staleness"],
            rec["time_h"],
            marker="*",
            s=260,
            color=colors.get(t, "#555"),
            zorder=5,
            label=f"E[d]={t}: {b['label']} ({rec['time_h']:.1f} h)",
        )
        ax.axhline(b["bound_h"], color=colors.get(t, "#555"), ls=":", lw=1)
        ax.axvline(t, color=colors.get(t, "#555"), ls="--", lw=0.6)
    if best:  # runs far slower than the recommendations would flatten the plot: they stay above its top
        low = min(b["bound_h"] for b in best.values())
        high = max(b["recommended"]["time_h"] for b in best.values())
        ax.set_ylim(0.95 * low, 1.6 * high)
    ax.set_xlabel("realized mean staleness (every consumed group)")
    ax.set_ylabel("end-to-end time (h)")
    ax.set_title(
        title + "  (o elastic, filled: adaptive; s async; ^ colocate; dotted: ideal bound)", fontsize=9
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
