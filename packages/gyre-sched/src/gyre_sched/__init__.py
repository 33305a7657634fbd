"""gyre_sched."""
