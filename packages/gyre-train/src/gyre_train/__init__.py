"""gyre_train."""
