"""Training backends: the protocol (``base``), the torch implementation (``torch_backend``; the Megatron one lives in
``gyre_train.megatron``), and ``build_backend`` / ``check_backend`` to choose one by name (``factory``)."""

from gyre_train.backends.factory import BACKENDS, build_backend, check_backend

__all__ = ["BACKENDS", "build_backend", "check_backend"]
