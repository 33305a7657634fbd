"""PNG plots recomputed from a trace: the cell role timeline and waterlevel vs rollout capacity."""

from __future__ import annotations

from pathlib import Path

from gyre_sched.trace import TraceSummary

ROLE_COLORS = {"rollout": "#4c9be8", "to_training": "#f5b041", "training": "#c0392b", "to_rollout": "#58d68d"}


def _plt():  # imported lazily: plotting is optional and slow to import
    import matplotlib

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
