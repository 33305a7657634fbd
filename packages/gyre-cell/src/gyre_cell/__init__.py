"""gyre_cell."""
