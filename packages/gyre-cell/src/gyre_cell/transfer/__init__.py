"""Weight transfer over the Mooncake transfer engine (DESIGN §8): the core publishes, satellites and engines pull.

`WeightPublisher` keeps a registered flat buffer of the model's tensors (HF names) and refreshes it in place under
a seqlock; `WeightSubscriber` reads the whole buffer with batched Mooncake reads and never returns a torn
snapshot; `WeightManifest` is the handshake (peer, address, length, version, layout), sent directly or over HTTP.
"""

from .engine_loader import mooncake_engine_loader, published_weights_loader, pull_into_engine
from .manifest import TensorEntry, WeightManifest
from .mooncake import MooncakeConfig, MooncakeUnavailableError, import_transfer_engine, open_transfer_engine
from .publisher import WeightPublisher
from .snapshot_channel import MooncakeSnapshotChannel, StaleSnapshotError
from .subscriber import (
    Snapshot,
    SubscriberConfig,
    TornSnapshotError,
    TransferError,
    WeightSubscriber,
    fetch_manifest,
)

__all__ = [
    "MooncakeConfig",
    "MooncakeSnapshotChannel",
    "MooncakeUnavailableError",
    "Snapshot",
    "StaleSnapshotError",
    "SubscriberConfig",
    "TensorEntry",
    "TornSnapshotError",
    "TransferError",
    "WeightManifest",
    "WeightPublisher",
    "WeightSubscriber",
    "fetch_manifest",
    "import_transfer_engine",
    "mooncake_engine_loader",
    "open_transfer_engine",
    "published_weights_loader",
    "pull_into_engine",
]
