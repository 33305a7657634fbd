"""gyre_tito."""
