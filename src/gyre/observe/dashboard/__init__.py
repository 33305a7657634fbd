"""The live dashboard of a run: `gyre.observe.dashboard.server` and its static page (static/)."""
