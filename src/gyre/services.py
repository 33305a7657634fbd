"""Compatibility: the local launcher under its former name. New code uses `gyre.launch`."""

from gyre.launch.base import ServiceError, cell_configs, free_port
from gyre.launch.local import LocalLauncher as LocalServices

__all__ = ["LocalServices", "ServiceError", "cell_configs", "free_port"]
