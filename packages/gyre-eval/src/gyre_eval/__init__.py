"""gyre_eval."""
