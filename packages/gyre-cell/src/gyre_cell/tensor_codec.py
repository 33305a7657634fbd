"""The CPU-safe serialization of `/update_weights_from_tensor` for the Gyre torch engine.

SGLang's own format is a pickled `MultiprocessingSerializer` payload of CUDA IPC handles: only valid on
the same node and unsafe to unpickle from a network peer. The torch engine instead takes, in each entry of
`serialized_named_tensors`, the base64 text of a safetensors blob (`safetensors.torch.save`) mapping Hugging
Face parameter names to tensors, with `load_format` null or `"safetensors"`. Safetensors holds only dtype,
shape and raw bytes, so decoding never executes code.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SAFETENSORS_LOAD_FORMAT = "safetensors"


def encode_named_tensors(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """base64(safetensors(named)); tensors are moved to CPU and made contiguous."""
    items = named.items() if isinstance(named, Mapping) else named
    blob = st_save({name: t.detach().to("cpu").contiguous() for name, t in items})
    return base64.b64encode(blob).decode("ascii")


def decode_named_tensors(payload: str | bytes) -> dict[str, torch.Tensor]:
    """Inverse of `encode_named_tensors`; raises ValueError on malformed input."""
    try:
        blob = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
        return st_load(blob)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"serialized_named_tensors is not base64 safetensors: {e}") from e
    except Exception as e:  # safetensors raises its own SafetensorError on corrupt headers
        raise ValueError(f"serialized_named_tensors is not a valid safetensors blob: {e}") from e
