"""Choosing a port for a server that binds it a moment later: `gyre_train.ports`, the one home of the rule, which
gyre-train's own rendezvous and coordinator ports need too (gyre-cell depends on gyre-train, not the reverse)."""

from gyre_train.ports import free_port, free_ports

__all__ = ["free_port", "free_ports"]
