"""Orchestration of one run: the pipeline that assembles it, the controller that carries out the
policy's decisions on real processes (and its cell effects and engine routes), resuming, judging."""

__all__: list[str] = []
