"""Service tokens: the one reader lives in `gyre_sched.secret` (every service's token, one set of rules).

Re-exported here so `gyre_cell`'s callers keep their import; new code imports `gyre_sched.secret`.
"""

from __future__ import annotations

from gyre_sched.secret import SecretError, read_secret

__all__ = ["SecretError", "read_secret"]
