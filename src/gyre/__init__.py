"""Gyre meta-package: CLI and pipeline assembly."""
