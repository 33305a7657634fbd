"""The demo's own content: the built-in agent, the demo model and its evaluation (what `gyre demo` runs)."""

__all__: list[str] = []
