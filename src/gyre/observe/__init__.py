"""What a run shows while it runs and after: metrics, the progress line, the live dashboard, the run
monitor, the report and the run-directory reader."""

__all__: list[str] = []
