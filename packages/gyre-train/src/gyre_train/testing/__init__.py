"""Test doubles and references that are documented features of gyre-train: synthetic trajectories and groups
(`synthetic`) and the plain per-token GSPO loss the streamed one is checked against (`loss_reference`)."""

__all__: list[str] = []
