"""The live dashboard of a run: `gyre.dashboard.server` and its static page (static/)."""
